"""What a compiled program's HLO text says beyond `cost_analysis()`: collectives with their bytes, inside
and outside loops, and FLOPs and bytes accessed with every `while` body counted as often as it runs.

Why parse the text: XLA's `cost_analysis()` counts a `while` body once (a scan over 28 layers reports the
FLOPs of one layer: measured on libtpu 0.0.42 by compiling the same scan for 2 and 8 layers, which gave
the same FLOPs), so a roofline from it would be off by the layer count. Here each computation gets a
multiplier: 1 for the entry, times the trip count for a `while` body (read from its condition: a
`compare(counter, constant(N)), direction=LT`, the form `lax.scan`/`fori_loop` compile to), and the
caller's for anything else it calls. A loop whose condition is data-dependent (decoding until every row
stops) counts once and is listed with `trip=None`.

The conventions follow XLA's HloCostAnalysis: FLOPs are 2 x output elements x contracted elements of each
dot/convolution (elementwise work is left out: small beside the matmuls); bytes accessed are, per
top-level instruction (a fusion counts as one), its operands' and its output's bytes. The HLO is the
partitioned module of one device, so every figure is per chip.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
                "s64": 8, "u64": 8, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\) -> .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w\-.]*)\((.*)$")
_CALLS = re.compile(r"\b(calls|body|condition|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
# Instructions that move no data of their own (their computations are counted where they run).
_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "iota"}


def array_bytes(shape_text: str) -> float:
    """Bytes of every array in an HLO shape (a tuple: the sum of its elements)."""
    return sum(_DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x) for d, dims in _ARRAY.findall(shape_text))


def _dims(shape_text: str) -> list[int]:
    found = _ARRAY.search(shape_text)
    return [int(x) for x in found.group(2).split(",") if x] if found else []


@dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attributes: str
    arguments: str  # the raw argument list (a constant's value)


@dataclass
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)


def _split_arguments(rest: str) -> tuple[str, str]:
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def parse(hlo_text: str) -> tuple[dict[str, Computation], str]:
    """The module's computations by name, and the entry's name."""
    computations, entry, current = {}, "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = computations.setdefault(header.group(2), Computation(header.group(2)))
            entry = header.group(2) if header.group(1) else entry
            continue
        if line.rstrip() == "}":  # a Mosaic kernel's backend_config spans lines that start with "}}"
            current = None
            continue
        match = _INSTRUCTION.match(line) if current is not None else None
        if match:
            arguments, attributes = _split_arguments(match.group(4))
            current.instructions.append(Instruction(match.group(1), match.group(2), match.group(3),
                                                    re.findall(r"%([\w.\-]+)", arguments), attributes, arguments))
    return computations, entry


def _trip_count(condition: Computation | None) -> int | None:
    if condition is None or not condition.instructions:
        return None
    root = condition.instructions[-1]
    if root.opcode != "compare" or "direction=LT" not in root.attributes:
        return None
    constants = [int(i.arguments) for i in condition.instructions if i.opcode == "constant" and i.arguments.isdigit()]
    return constants[0] if len(constants) == 1 else None


@dataclass
class Placement:
    multiplier: int = 1
    in_loop: bool = False
    fused: bool = False  # a fusion's body: its instructions are not top-level (no bytes of their own)


def placements(computations: dict[str, Computation], entry: str) -> tuple[dict[str, Placement], list[dict]]:
    """Each reachable computation's multiplier (runs per program run) and whether it is in a loop; the loops."""
    placed = {entry: Placement()}
    loops, order = [], [entry]
    while order:
        name = order.pop()
        here = placed[name]
        for instruction in computations[name].instructions if name in computations else ():
            calls = _CALLS.findall(instruction.attributes)
            for branch in _BRANCHES.findall(instruction.attributes):
                calls += [("branch", b.strip().lstrip("%")) for b in branch.split(",")]
            trip = None
            if instruction.opcode == "while":
                condition = dict(calls).get("condition")
                trip = _trip_count(computations.get(condition))
                loops.append({"while": instruction.name, "in": name, "trip": trip, "runs": here.multiplier})
            for kind, callee in calls:
                if callee in placed:
                    continue
                if instruction.opcode == "while":
                    placed[callee] = Placement(here.multiplier * (trip or 1), True)
                else:
                    placed[callee] = Placement(here.multiplier, here.in_loop, here.fused or kind == "calls"
                                               and instruction.opcode == "fusion")
                order.append(callee)
    return placed, loops


def _contracted(instruction: Instruction, shapes: dict[str, str]) -> int:
    lhs = _dims(shapes.get(instruction.operands[0], "")) if instruction.operands else []
    if instruction.opcode == "dot":
        found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
        return math.prod(lhs[int(d)] for d in found.group(1).split(",") if d) if found and lhs else 1
    # convolution: the lhs feature dimension ('f' in dim_labels) times the window elements that can meet
    # an input element. XLA:TPU writes a dot batched over heads as a convolution whose window spans the
    # heads over a padded input of size 1 (`window={size=14 pad=13_13 rhs_reversal=1}`): each output meets
    # one window element, so a window dimension counts at most the lhs's own size along it.
    labels = re.search(r"dim_labels=([\w]+)_", instruction.attributes)
    window = re.search(r"window=\{size=([\dx]+)", instruction.attributes)
    lhs_labels = labels.group(1) if labels else ""
    feature = lhs[lhs_labels.index("f")] if lhs and "f" in lhs_labels else 1
    # A grouped convolution contracts each group's features only.
    groups = re.search(r"feature_group_count=(\d+)", instruction.attributes)
    feature //= int(groups.group(1)) if groups else 1
    met = 1
    for k, size in enumerate(int(x) for x in window.group(1).split("x")) if window else ():
        spatial = lhs[lhs_labels.index(str(k))] if lhs and str(k) in lhs_labels else size
        met *= min(size, spatial)
    return feature * met


@dataclass
class HloFigures:
    flops: float
    bytes_accessed: float
    collectives: dict  # name -> {"count", "bytes", "inside_loops": {...}, "outside_loops": {...}}
    loops: list
    largest_all_gather_bytes: float
    largest_values: list  # the largest instruction results (name, opcode, shape, bytes)


def analyse(hlo_text: str, top: int = 5) -> HloFigures:
    computations, entry = parse(hlo_text)
    placed, loops = placements(computations, entry)
    flops = traffic = largest_gather = 0.0
    census = {op: {"count": 0, "bytes": 0.0, "inside_loops": {"count": 0, "bytes": 0.0},
                   "outside_loops": {"count": 0, "bytes": 0.0}} for op in COLLECTIVES}
    values = []
    for name, where in placed.items():
        computation = computations.get(name)
        if computation is None:
            continue
        shapes = {i.name: i.shape for i in computation.instructions}
        for instruction in computation.instructions:
            opcode = instruction.opcode
            if opcode in ("dot", "convolution"):
                flops += 2.0 * math.prod(_dims(instruction.shape)) * _contracted(instruction, shapes) * where.multiplier
            base = opcode.removesuffix("-start")
            if base in census and not opcode.endswith("-done") and name.startswith("async_collective_fusion"):
                # XLA:TPU's async collective fusions carry one in-flight collective (its buffer aliased from
                # operand to output) through several compute fusions, each holding the collective's
                # instruction: a step of one transfer, not a transfer of the whole buffer. Counted apart.
                census[base]["async_fusion_steps"] = census[base].get("async_fusion_steps", 0) + where.multiplier
            elif base in census and not opcode.endswith("-done"):
                size = array_bytes(instruction.shape)
                if opcode.endswith("-start") and instruction.shape.startswith("(") and base != "all-reduce":
                    # An async start's result is (operands, outputs[, context]): what arrives is the output.
                    size = array_bytes(_tuple_elements(instruction.shape)[1])
                entry_ = census[base]
                side = entry_["inside_loops" if where.in_loop else "outside_loops"]
                for bucket in (entry_, side):
                    bucket["count"] += 1
                    bucket["bytes"] += size * where.multiplier
                if base == "all-gather":
                    largest_gather = max(largest_gather, size)
            if where.fused or opcode in _NO_TRAFFIC or opcode.endswith("-done"):
                continue
            out, reads = _traffic(instruction, shapes, computations)
            traffic += (out + reads) * where.multiplier
            values.append((out, instruction.name, opcode, re.sub(r"\{[^}]*\}", "", instruction.shape)))
    values.sort(reverse=True)
    largest = [{"name": n, "opcode": o, "shape": s, "gib": b / 2 ** 30} for b, n, o, s in values[:top]]
    return HloFigures(flops, traffic, census, loops, largest_gather, largest)


def _sliced_operands(computation: Computation) -> tuple[dict[int, float], float | None]:
    """A fused computation's parameters read through a dynamic-slice (bytes: the slice's) or updated in
    place by a dynamic-update-slice (bytes: the update's), and the output's bytes when its root is one.
    XLA's cost model counts these so, since a layer loop reads one layer of the stacked weights per trip
    and writes one layer of the stacked gradients in place; the whole stack per trip would count L^2."""
    shapes = {i.name: i.shape for i in computation.instructions}
    index = {i.name: int(i.arguments) for i in computation.instructions
             if i.opcode == "parameter" and i.arguments.isdigit()}
    overrides, output = {}, None
    for instruction in computation.instructions:
        if instruction.opcode == "dynamic-slice" and instruction.operands and instruction.operands[0] in index:
            overrides[index[instruction.operands[0]]] = array_bytes(instruction.shape)
        if instruction.opcode == "dynamic-update-slice" and len(instruction.operands) > 1:
            update = array_bytes(shapes.get(instruction.operands[1], ""))
            if instruction.operands[0] in index:
                overrides[index[instruction.operands[0]]] = update
            if instruction is computation.instructions[-1]:
                output = update
    return overrides, output


def _traffic(instruction: Instruction, shapes: dict[str, str], computations: dict[str, Computation]):
    """(output bytes, operand bytes) of one top-level instruction, slices counted as XLA's cost model does."""
    operands = [array_bytes(shapes.get(o, "")) for o in instruction.operands]
    out = array_bytes(instruction.shape)
    overrides, output = {}, None
    if instruction.opcode == "fusion":
        called = dict(_CALLS.findall(instruction.attributes)).get("calls")
        if called in computations:
            overrides, output = _sliced_operands(computations[called])
    elif instruction.opcode == "dynamic-slice" and operands:
        overrides = {0: out}
    elif instruction.opcode == "dynamic-update-slice" and len(operands) > 1:
        overrides, output = {0: operands[1]}, operands[1]
    # In-place outputs (output_to_operand_aliasing, e.g. an async collective's buffer passed along): the
    # operand and that output are the same memory, neither read nor written by this instruction.
    aliased = re.search(r"output_to_operand_aliasing=\{(.*?)\}, (?:calls|kind|metadata|custom)", instruction.attributes)
    if aliased and instruction.shape.startswith("("):
        elements = _tuple_elements(instruction.shape)
        for index, operand in re.findall(r"\{(\d+)\}: \((\d+), \{\}\)", aliased.group(1)):
            if int(index) < len(elements) and int(operand) < len(operands):
                out -= array_bytes(elements[int(index)])
                overrides[int(operand)] = 0.0
    reads = sum(overrides.get(i, size) for i, size in enumerate(operands))
    return (out if output is None else output), reads


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape `(a, (b, c), d)`."""
    inner, parts, depth, start = shape.strip()[1:-1], [], 0, 0
    for i, ch in enumerate(inner):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    return parts if len(parts) > 1 else [shape, shape]
