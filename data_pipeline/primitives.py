"""The answer grammar of seed 004 ("Physical Primitives"), shared by the validator, renderer, training,
decoding and evaluation.

`parse_answer` reads one `gpt` answer into its coordinate primitives and its `atomic_decoding`
calls, or raises `PrimitiveError` naming what is wrong and at which character offset.

Announcements, the one home of the rule "which tokens after an `atomic_decoding` call form the block
the drafter drafts" (training, decoding, evaluation and the benchmarks all call these):
- `parse_announcement`: one `<tool_call>` body → its `Announcement` (block_size, count), or None for
  no `atomic_decoding` call; the same argument rules for a reference answer and for generated text.
- `Announcement.blocks`: how many blocks of `block_size` follow (dense motion: `count`; else one).
- `AtomicCalls(tokenizer)`: the same in token ids: `announced` (the call committed ids complete),
  `call_ends` (every call of an answer), `announced_spans` (the blocks of a decoded output).
- `rendered_blocks`: the blocks of a rendered Example, from its `primitive_spans`/`primitive_blocks`.

Coordinates, the one quantise/dequantise pair of the project (DESIGN, "Primitive tokens are single
tokens"). Seed 004: "Each primitive's coordinate range is quantized linearly with half-up rounding",
onto the 1,001 number tokens `<0>` … `<1000>`:

    quantise(v, lo, hi)   = clip(floor(1000 · (v − lo) / (hi − lo) + 1/2), 0, 1000)
    dequantise(k, lo, hi) = lo + k · (hi − lo) / 1000

so a value in [lo, hi] comes back within half a step, (hi − lo) / 2000.

Why the scaled value is computed exactly: in binary floating point, `(v − lo) / (hi − lo) · 1000`
lands a hair above or below a decimal half (−4.995 m in [−5, 5] is 0.49999999999991 in floats),
so float arithmetic would round the same written half up in one place and down in another. Here
every float is read as the shortest decimal that round-trips it (its `repr`, the number as a
person or JSON wrote it) and the scaling is done in rationals (`fractions.Fraction`), so written
halves always round up, and the mapping stays monotonic (the shortest round-trip decimal preserves
order). Values outside [lo, hi] clip to `<0>` / `<1000>`; NaN and ±inf are refused.

`RANGES` gives (lo, hi) per primitive kind and axis, from seed 004's table:
- image kinds (point, box, 2D robot atoms): tokens are image-normalised, `k ↔ k / 1000` of the image
  width (x, u) or height (y, v); ranges are (0, 1), so coordinates come back as fractions of the image
  and distances in "normalised image units" (0..1000 / 1000).
- 3D robot atoms, camera frame: x and y in [−5, 5] m, z in [0, 10] m.
- driving, ego frame: x in [−10, 250] m, y in [−65, 65] m, heading in [−π, π] rad.
- dense 3D motion, relative to the first query point: `(k − 500) · s / 500` m, i.e. the range
  [−s, s] on every axis, for a per-dataset scale `s` (`DENSE_SCALE` = 2.0 m by default; pass the
  dataset's own scale to `ranges`/`coordinates`).

Decisions where the seed leaves room (each refused rather than guessed, DESIGN "no silent fallbacks"):
- Only the vocabulary tags are structure; any other `<name>` is plain text. A closing tag named after
  a robot start tag (`</robot_single>`) is refused: robot atoms close with `</robot>`.
- Inside an atom only number tokens may stand, and inside `<objects>` only `<box>` atoms or the word
  `None`: any other text there would change the token count that `block_size` and `atom_loss_masks`
  rely on. Whitespace may separate `</ref>` from `<objects>`, a call from its trajectory, a left arm
  from its right arm, and consecutive dense trajectories.
- A `<tool_call>` body must be a JSON object with a string `name`; other names stay plain text.
- Without `count`, a dense call covers one trajectory; a dual-arm `count`, if given, is P per arm.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from data_pipeline import vocabulary

ATOMIC_DECODING = "atomic_decoding"

ROBOT_KINDS: tuple[str, ...] = tuple(tag[1:-1] for tag in vocabulary.ROBOT_START_TAGS)
# Seed 004: every robot atom closes with `</robot>`, driving with `</drive>`, dense motion with `</dense>`.
TRAJECTORY_CLOSERS: dict[str, str] = {**{k: "robot" for k in ROBOT_KINDS}, "drive": "drive", "dense": "dense"}
# Numbers per waypoint: u,v for 2D robot atoms; x,y,z / x,y,heading otherwise.
DIMENSIONS: dict[str, int] = {
    **{k: 2 if k.endswith("_2d") else 3 for k in ROBOT_KINDS},
    "drive": 3,
    "dense": 3,
}
KINDS: tuple[str, ...] = ("point", "box", "objects_none", *ROBOT_KINDS, "drive", "dense")

_OPEN_NAMES = frozenset({"point", "ref", "objects", "box", "action", "tool_call", *TRAJECTORY_CLOSERS})
# Closing tags named after robot start tags are read too, to refuse them with a hint.
_CLOSE_NAMES = frozenset(
    {"point", "ref", "objects", "box", "action", "tool_call", "robot", "drive", "dense", *ROBOT_KINDS}
)
_TOKEN = re.compile(r"<(?P<number>[+-]?\d[\d.]*)>|<(?P<close>/?)(?P<name>[A-Za-z_][A-Za-z0-9_]*)>")
# Seed 004: 1,001 number tokens `<0>` … `<1000>`; any other spelling is not a token of the vocabulary.
_NUMBER = re.compile(r"0|[1-9]\d{0,3}")
_TOOL_CALL_END = "</tool_call>"
_OBJECTS_NONE = "None</objects>"


@dataclass(frozen=True)
class Primitive:
    """One atom of an answer. `start`/`end` span its text from start tag to the end of its end tag."""

    kind: str
    start: int
    end: int
    values: tuple[int, ...]
    label: str | None = None  # the `<ref>` label of a box / objects_none

    @property
    def waypoints(self) -> int:
        """Waypoints (or future frames) of a trajectory atom."""
        return len(self.values) // DIMENSIONS[self.kind]


@dataclass(frozen=True)
class AtomicCall:
    """An `atomic_decoding` call. `covers` indexes the primitives it applies to (one block each,
    except a dual-arm pair, which is one block)."""

    start: int
    end: int
    block_size: int
    count: int | None
    covers: tuple[int, ...] = ()


class PrimitiveError(ValueError):
    """An answer that does not follow the primitive grammar; `offset` is a character offset."""

    def __init__(self, offset: int, reason: str):
        self.offset = offset
        self.reason = reason
        super().__init__(f"at char {offset}: {reason}")


def coordinate_count(primitives: Iterable[Primitive]) -> list[int]:
    """Coordinate tokens of each primitive that takes an `atom_loss_masks` string, in order.

    Seed 004: one mask string per primitive, one character per coordinate token;
    `<objects>None</objects>` has no coordinates and takes no string.
    """
    return [len(p.values) for p in primitives if p.values]


def expected_block_size(atoms: Sequence[Primitive]) -> int:
    """`block_size` of one block: every token of its atoms, start and end tags included.

    This gives the seed's table: single arm 2P+2 / 3P+2, dual arm 4P+4 / 6P+4, driving 3P+2,
    dense 3F+2 per trajectory.
    """
    return sum(len(a.values) + 2 for a in atoms)


def parse_answer(text: str) -> tuple[list[Primitive], list[AtomicCall]]:
    """Primitives and atomic_decoding calls of one answer, in text order."""
    parser = _Parser(text)
    parser.scan()
    return parser.primitives, parser.link()


# -- announcements: what an atomic_decoding call announces ---------------------------------------


@dataclass(frozen=True)
class Announcement:
    """The arguments of one `atomic_decoding` call (seed 004): `block_size` counts every token of the
    primitive, start and end tags included; `count`, when given, is the waypoints of a robot or driving
    trajectory (P per arm for a dual-arm pair) or the trajectories of dense motion."""

    block_size: int
    count: int | None = None

    def blocks(self, dense: bool) -> int:
        """Blocks of `block_size` tokens the call announces; `dense`: its primitive opens with `<dense>`.

        Seed 004: for dense motion `count` gives the number of trajectories, one block each (one block
        without `count`); any other primitive is one block, a dual-arm pair's two atoms included.
        """
        return self.count if self.count and dense else 1


def parse_announcement(call: object, offset: int = 0) -> Announcement | None:
    """What one `<tool_call>` body announces, or None when it is no `atomic_decoding` call.

    `call`: the body, as the text between `<tool_call>` and `</tool_call>` or as its parsed JSON value.
    None for a JSON object naming another tool, any other JSON value, and text that is not JSON: the
    seed gives those no meaning, so they stay text (`parse_answer` refuses a malformed body itself, as
    the answer grammar; a decoder meeting one in generated text decodes on). An `atomic_decoding` call
    is checked against the seed's arguments, each breach a `PrimitiveError` at `offset`: only the keys
    `name` and `arguments`; `arguments` an object of only `block_size` (required) and `count`
    (optional), each an integer >= 1 (a bool or 5.0 is not one).
    """
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except ValueError:
            return None
    if not isinstance(call, dict) or call.get("name") != ATOMIC_DECODING:
        return None
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        raise PrimitiveError(offset, f"atomic_decoding call has unknown keys {extra}")
    args = call.get("arguments")
    if not isinstance(args, dict):
        raise PrimitiveError(offset, 'atomic_decoding call needs an "arguments" object')
    extra = sorted(set(args) - {"block_size", "count"})
    if extra:
        raise PrimitiveError(
            offset, f"atomic_decoding arguments has unknown keys {extra}; allowed: block_size, count"
        )
    block_size = _positive_int(offset, "block_size", args.get("block_size"))
    count = _positive_int(offset, "count", args["count"]) if "count" in args else None
    return Announcement(block_size, count)


class BlockError(ValueError):
    """Rendered primitives that do not fill the blocks their `atomic_decoding` call announces."""


def rendered_blocks(primitive_spans, primitive_blocks) -> list[tuple[int, int]]:
    """[first, stop) token spans of the blocks announced in a rendered example, in order.

    The arrays are an Example's (`data_pipeline.examples`): `primitive_spans` rows (kind, first token,
    one past the last) and `primitive_blocks` rows (call index or -1, block_size, count). A call's
    primitives fill blocks of its `block_size` one after another, the atoms of one block adjacent in
    tokens: a dual-arm pair's two atoms make one block, each of a dense call's `count` trajectories its
    own (`Announcement.blocks`). Primitives of no call (points, boxes) are in no block. A call whose
    primitives overrun a block or leave one short raises BlockError.

    These are the blocks `AtomicCalls.announced_spans` finds in the same ids when nothing stands between
    a call and its atoms. Seed 004 allows whitespace there (after the call, between the arms of a pair,
    between dense trajectories); its tokens then shift or break the span `AtomicCalls` reads, and a
    dual-arm pair split by whitespace is refused here (its left arm leaves the block short).
    """
    found: list[tuple[int, int]] = []
    open_block = None  # (call, first token, end so far, block size)
    for (_, first, end), (call, size, _) in zip(
        np.asarray(primitive_spans).tolist(), np.asarray(primitive_blocks).tolist(), strict=True
    ):
        if call < 0:
            continue
        if open_block is not None and open_block[0] == call and open_block[2] == first:
            open_block = (call, open_block[1], end, size)
        else:
            _check_closed(open_block)
            open_block = (call, first, end, size)
        call, start, stop, size = open_block
        if stop - start > size:
            raise BlockError(
                f"atomic_decoding call {call} announces block_size={size}, but its primitive spans {stop - start} tokens"
            )
        if stop - start == size:
            found.append((start, stop))
            open_block = None
    _check_closed(open_block)
    return found


def _check_closed(open_block) -> None:
    if open_block is not None:
        call, start, stop, size = open_block
        raise BlockError(
            f"atomic_decoding call {call} announces block_size={size}, but its primitives span {stop - start} tokens"
        )


class AtomicCalls:
    """`atomic_decoding` calls and the blocks they announce, in the token ids of one tokenizer.

    By ids, not by re-reading the whole text: `<tool_call>`, `</tool_call>` and the trajectory tags are
    single tokens (data_pipeline.vocabulary), so a call ends exactly when `</tool_call>` is committed.
    An announced block is the `block_size` tokens right after the call's `</tool_call>`, `count` such
    blocks back to back when the first of them is `<dense>` (`Announcement.blocks`); a call completed
    inside a block announces nothing. `SpeculativeDecoder` drafts these blocks as it decodes (`announced`
    on the committed ids); `announced_spans` finds them afterwards in a whole output. They differ in one
    case: a call completed by a block's last token, which the decoder misses when its last pass committed
    a bonus token past that block (it reads the ids up to that bonus), and `announced_spans` announces.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.open_id = self._id("<tool_call>")
        self.close_id = self._id("</tool_call>")
        self.dense_id = self._id("<dense>")

    def _id(self, token: str) -> int:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"tokenizer: {token} is {len(ids)} tokens, not one; add the primitive tokens "
                             f"(data_pipeline.tokenizer.add_primitive_tokens)")
        return ids[0]

    def announced(self, ids) -> Announcement | None:
        """The call that `ids` (ending with `</tool_call>`) completes, or None for another tool.

        Its body (the ids back to the last `<tool_call>`) is read by `parse_announcement`; arguments
        that break the seed's rules raise ValueError quoting the body."""
        ids = list(ids)
        if not ids or ids[-1] != self.close_id:
            return None
        if self.open_id not in ids:
            return None
        start = len(ids) - 1 - ids[::-1].index(self.open_id)
        body = self.tokenizer.decode(ids[start + 1:-1])
        try:
            # A malformed tool call or another tool announces nothing: it stays text, decoding goes on.
            return parse_announcement(body)
        except PrimitiveError as err:
            raise ValueError(f"generated atomic_decoding call {body!r}: {err.reason}") from None

    def call_ends(self, ids) -> list[tuple[int, Announcement]]:
        """(j, announcement) for every `atomic_decoding` call that `ids[:j + 1]` completes, in order."""
        ids = [int(t) for t in ids]
        ends = [(j, self.announced(ids[:j + 1])) for j, t in enumerate(ids) if t == self.close_id]
        return [(j, a) for j, a in ends if a is not None]

    def announced_spans(self, prompt, output) -> list[tuple[int, int, Announcement]]:
        """(start, stop, announcement) per block announcement in `output`, decoded after `prompt`, in order.

        [start, stop) indexes `output`: from the token after the completed call (0 for a prompt that ends
        with one), `block_size` tokens, or `count` x `block_size` for dense motion. `stop` may pass the
        end of `output`, where decoding stopped inside the announced blocks (a stop token, the budget),
        and `start` equals its length for a call that the last token completes."""
        output = [int(t) for t in output]
        ids = [int(t) for t in prompt]
        spans: list[tuple[int, int, Announcement]] = []
        for t in range(len(output) + 1):
            if (not spans or t >= spans[-1][1]) and ids and ids[-1] == self.close_id:
                announcement = self.announced(ids)
                if announcement is not None:
                    blocks = announcement.blocks(output[t:t + 1] == [self.dense_id])
                    spans.append((t, t + announcement.block_size * blocks, announcement))
            if t < len(output):
                ids.append(output[t])
        return spans


# -- coordinates: number tokens <-> values (the module docstring's "Coordinates") -------------------

STEPS = vocabulary.NUMBER_MAX  # seed 004: number tokens <0> … <1000>, so 1000 steps across a range
DENSE_SCALE = 2.0  # seed 004's example scale `s` for dense motion, in metres

_IMAGE = (0.0, 1.0)
_ROBOT_3D = ((-5.0, 5.0), (-5.0, 5.0), (0.0, 10.0))
_DRIVE = ((-10.0, 250.0), (-65.0, 65.0), (-math.pi, math.pi))

RANGES: dict[str, tuple[tuple[float, float], ...]] = {
    "point": (_IMAGE, _IMAGE),
    "box": (_IMAGE, _IMAGE, _IMAGE, _IMAGE),  # x1, y1, x2, y2
    **{k: (_IMAGE, _IMAGE) if DIMENSIONS[k] == 2 else _ROBOT_3D for k in ROBOT_KINDS},
    "drive": _DRIVE,
    "dense": ((-DENSE_SCALE, DENSE_SCALE),) * 3,
}


def ranges(kind: str, dense_scale: float = DENSE_SCALE) -> tuple[tuple[float, float], ...]:
    """(lo, hi) per axis of one waypoint of `kind`; dense motion uses the dataset's scale `s`."""
    if kind == "dense":
        if not (math.isfinite(dense_scale) and dense_scale > 0):
            raise ValueError(f"dense scale must be a positive finite number of metres, got {dense_scale}")
        return ((-dense_scale, dense_scale),) * 3
    if kind not in RANGES:
        raise ValueError(f"no coordinate range for primitive kind {kind!r}; known: {sorted(RANGES)}")
    return RANGES[kind]


def _exact(x: float, what: str) -> Fraction:
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{what} must be finite, got {x}")
    # repr is the shortest decimal that reads back as x: the number as written (see module doc).
    return Fraction(repr(x))


def quantise(value: float, low: float, high: float) -> int:
    """Token index in [0, 1000]: floor(1000·(value − low)/(high − low) + 1/2), computed exactly, clipped."""
    lo, hi = _exact(low, "low"), _exact(high, "high")
    if not hi > lo:
        raise ValueError(f"range needs low < high, got [{low}, {high}]")
    scaled = (_exact(value, "value") - lo) * STEPS / (hi - lo)
    return min(max(math.floor(scaled + Fraction(1, 2)), 0), STEPS)


def dequantise(token, low: float, high: float):
    """low + token·(high − low)/1000: a float for an int token, a float64 array for an array of tokens."""
    if not high > low:
        raise ValueError(f"range needs low < high, got [{low}, {high}]")
    k = np.asarray(token)
    if k.dtype.kind not in "iu" or k.size and (k.min() < 0 or k.max() > STEPS):
        raise ValueError(f"tokens must be integers in [0, {STEPS}], got {token!r}")
    out = low + k.astype(np.float64) * ((high - low) / STEPS)
    return float(out) if out.ndim == 0 else out


def coordinates(primitive: Primitive, dense_scale: float = DENSE_SCALE) -> np.ndarray:
    """float64 [P, D] coordinates of one atom: metres / radians, or fractions of the image.

    point → [1, 2] (x, y); box → [2, 2] (its corners (x1, y1), (x2, y2)); `<objects>None` → [0, 2];
    robot 2D → [P, 2] (u, v); robot 3D → [P, 3] (x, y, z) m; drive → [P, 3] (x m, y m, heading rad);
    dense → [F, 3] m relative to the first query point. A dual-arm answer is two atoms: the caller
    passes each (seed 004: left arm, then right arm).
    """
    kind = primitive.kind
    if kind == "objects_none":
        return np.zeros((0, 2), np.float64)
    axes = ranges(kind, dense_scale)
    if kind == "box":
        axes = axes[:2]  # each corner is an (x, y) pair on the image axes
    d = len(axes)
    values = np.asarray(primitive.values, np.int64)
    if values.size == 0 or values.size % d:
        raise ValueError(f"<{kind}> has {values.size} numbers, not a whole number of {d}-D waypoints")
    values = values.reshape(-1, d)
    return np.stack([dequantise(values[:, a], lo, hi) for a, (lo, hi) in enumerate(axes)], axis=1)


def _snippet(text: str) -> str:
    return repr(text if len(text) <= 24 else text[:21] + "...")


def _positive_int(offset: int, key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PrimitiveError(
            offset, f"atomic_decoding {key} must be an integer >= 1, got {json.dumps(value)}"
        )
    return value


@dataclass(frozen=True)
class _CallDraft:
    start: int
    end: int
    block_size: int
    count: int | None


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.primitives: list[Primitive] = []
        self.items: list[Primitive | _CallDraft] = []

    # -- pass 1: tokens into atoms and calls ---------------------------------------------------------

    def next_token(self, pos: int) -> re.Match[str] | None:
        """The next number token or grammar tag from `pos`; other `<name>` tags are plain text."""
        while (m := _TOKEN.search(self.text, pos)) is not None:
            if m["number"] is not None:
                return m
            if m["name"] in (_CLOSE_NAMES if m["close"] else _OPEN_NAMES):
                return m
            pos = m.end()
        return None

    def scan(self) -> None:
        pos = 0
        while (m := self.next_token(pos)) is not None:
            pos = self.top_level(m)

    def top_level(self, m: re.Match[str]) -> int:
        name = m["name"]
        if m["number"] is not None:
            raise PrimitiveError(m.start(), f"number token {m[0]} outside a primitive")
        if m["close"]:
            raise PrimitiveError(m.start(), f"{m[0]} closes nothing{self.closer_hint(m)}")
        if name == "point" or name in TRAJECTORY_CLOSERS:
            return self.atom(m, name)
        if name == "box":
            raise PrimitiveError(m.start(), "<box> outside <objects>…</objects>")
        if name == "objects":
            raise PrimitiveError(m.start(), "<objects> must follow a <ref>label</ref>")
        if name == "ref":
            return self.ref(m)
        if name == "action":
            return self.action(m)
        return self.tool_call(m)

    @staticmethod
    def closer_hint(m: re.Match[str]) -> str:
        return "; robot atoms close with </robot>" if m["name"] in ROBOT_KINDS else ""

    def number(self, m: re.Match[str]) -> int:
        digits = m["number"]
        if not _NUMBER.fullmatch(digits) or int(digits) > vocabulary.NUMBER_MAX:
            raise PrimitiveError(
                m.start(),
                f"{m[0]} is not a number token: numbers are <0> … <{vocabulary.NUMBER_MAX}> "
                "without sign, leading zeros or decimals",
            )
        return int(digits)

    def atom(self, m: re.Match[str], kind: str, label: str | None = None) -> int:
        closer = TRAJECTORY_CLOSERS.get(kind, kind)
        values: list[int] = []
        pos = m.end()
        while True:
            t = self.next_token(pos)
            if t is None:
                raise PrimitiveError(m.start(), f"<{kind}> is not closed by </{closer}>")
            if t.start() != pos:
                raise PrimitiveError(
                    pos,
                    f"text {_snippet(self.text[pos : t.start()])} inside <{kind}>; only number tokens may stand there",
                )
            pos = t.end()
            if t["number"] is not None:
                values.append(self.number(t))
            elif t["close"] and t["name"] == closer:
                break
            else:
                raise PrimitiveError(
                    t.start(),
                    f"{t[0]} inside <{kind}> opened at char {m.start()}; expected a number token or "
                    f"</{closer}>{self.closer_hint(t) if t['close'] else ''}",
                )
        self.check_shape(m.start(), kind, values)
        primitive = Primitive(kind, m.start(), pos, tuple(values), label)
        self.primitives.append(primitive)
        self.items.append(primitive)
        return pos

    @staticmethod
    def check_shape(offset: int, kind: str, values: list[int]) -> None:
        n = len(values)
        if kind == "point" and n != 2:
            raise PrimitiveError(offset, f"<point> needs 2 numbers (x, y), got {n}")
        if kind == "box":
            if n != 4:
                raise PrimitiveError(offset, f"<box> needs 4 numbers (x1, y1, x2, y2), got {n}")
            x1, y1, x2, y2 = values
            # Seed 004 table: boxes satisfy x1 < x2 and y1 < y2.
            if not (x1 < x2 and y1 < y2):
                raise PrimitiveError(offset, f"<box> needs x1 < x2 and y1 < y2, got {values}")
        if kind in DIMENSIONS:
            dim = DIMENSIONS[kind]
            if n < dim or n % dim:
                what = "(u, v) pairs" if dim == 2 else "triples"
                raise PrimitiveError(offset, f"<{kind}> needs one or more {what}, got {n} numbers")

    def ref(self, m: re.Match[str]) -> int:
        t = self.next_token(m.end())
        if t is None or not (t["close"] and t["name"] == "ref"):
            raise PrimitiveError(m.start(), "<ref> must hold a plain-text label closed by </ref>")
        label = self.text[m.end() : t.start()]
        if not label.strip():
            raise PrimitiveError(m.start(), "<ref></ref> has an empty label")
        o = self.next_token(t.end())
        if o is None or o["close"] or o["name"] != "objects" or self.text[t.end() : o.start()].strip():
            raise PrimitiveError(t.end(), "<ref>label</ref> must be followed by <objects>…</objects>")
        return self.objects(o, label)

    def objects(self, o: re.Match[str], label: str) -> int:
        pos = o.end()
        if self.text.startswith(_OBJECTS_NONE, pos):
            # Seed 004: an absent category; no coordinates, so no atom_loss_masks string either.
            end = pos + len(_OBJECTS_NONE)
            none = Primitive("objects_none", o.start(), end, (), label)
            self.primitives.append(none)
            self.items.append(none)
            return end
        boxes = 0
        while True:
            t = self.next_token(pos)
            if t is None:
                raise PrimitiveError(o.start(), "<objects> is not closed by </objects>")
            if t.start() != pos:
                raise PrimitiveError(
                    pos,
                    f"text {_snippet(self.text[pos : t.start()])} inside <objects>; only <box> atoms, "
                    "or the word None alone, may stand there",
                )
            if not t["close"] and t["name"] == "box":
                pos = self.atom(t, "box", label)
                boxes += 1
            elif t["close"] and t["name"] == "objects":
                if not boxes:
                    raise PrimitiveError(
                        o.start(), "<objects> holds no box; an absent category is <objects>None</objects>"
                    )
                return t.end()
            else:
                raise PrimitiveError(t.start(), f"{t[0]} inside <objects>; expected <box> or </objects>")

    def action(self, m: re.Match[str]) -> int:
        t = self.next_token(m.end())
        if t is None:
            raise PrimitiveError(m.start(), "<action> is not closed by </action>")
        if not (t["close"] and t["name"] == "action"):
            raise PrimitiveError(
                t.start(), f"{t[0]} inside <action> opened at char {m.start()}; <action> holds plain text"
            )
        return t.end()

    def tool_call(self, m: re.Match[str]) -> int:
        end = self.text.find(_TOOL_CALL_END, m.end())
        if end < 0:
            raise PrimitiveError(m.start(), f"<tool_call> is not closed by {_TOOL_CALL_END}")
        stop = end + len(_TOOL_CALL_END)
        try:
            call = json.loads(self.text[m.end() : end])
        except ValueError as err:
            raise PrimitiveError(m.end(), f"<tool_call> body is not valid JSON: {err}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise PrimitiveError(m.end(), '<tool_call> body must be a JSON object with a string "name"')
        announcement = parse_announcement(call, m.start())
        if announcement is None:
            return stop  # another tool: the seed gives it no meaning here, so it stays text
        self.items.append(_CallDraft(m.start(), stop, announcement.block_size, announcement.count))
        return stop

    # -- pass 2: calls to the trajectories they cover ----------------------------------------------

    def adjacent(self, a: Primitive | _CallDraft, b: Primitive | _CallDraft) -> bool:
        return not self.text[a.end : b.start].strip()

    def link(self) -> list[AtomicCall]:
        calls: list[AtomicCall] = []
        index = {id(p): i for i, p in enumerate(self.primitives)}
        items = self.items
        i = 0
        while i < len(items):
            item = items[i]
            if isinstance(item, _CallDraft):
                atoms = self.covered(item, items[i + 1 :])
                calls.append(
                    AtomicCall(
                        item.start, item.end, item.block_size, item.count, tuple(index[id(a)] for a in atoms)
                    )
                )
                i += 1 + len(atoms)
                continue
            if item.kind in TRAJECTORY_CLOSERS:
                if item.kind.startswith("robot_right"):
                    raise PrimitiveError(item.start, f"<{item.kind}> without a left-arm atom right before it")
                # Seed 004: robot, driving and dense trajectories are preceded by an atomic_decoding call.
                raise PrimitiveError(item.start, f"<{item.kind}> is not preceded by an atomic_decoding call")
            i += 1
        return calls

    def covered(self, call: _CallDraft, following: list[Primitive | _CallDraft]) -> list[Primitive]:
        first = following[0] if following else None
        if (
            not isinstance(first, Primitive)
            or first.kind not in TRAJECTORY_CLOSERS
            or not self.adjacent(call, first)
        ):
            raise PrimitiveError(
                call.start,
                "atomic_decoding call must be followed by a robot, driving or dense trajectory (only whitespace between)",
            )
        kind, p = first.kind, first.waypoints
        if kind.startswith("robot_right"):
            raise PrimitiveError(first.start, f"<{kind}> without a left-arm atom right before it")
        if kind.startswith("robot_left"):
            atoms = [first, self.right_arm(first, following[1:])]
            layout = f"dual-arm {DIMENSIONS[kind]}D layout with P={p} waypoints per arm"
        elif kind == "dense":
            atoms = self.dense_group(call, following)
            layout = f"dense trajectory with F={p} future frames"
        else:
            atoms = [first]
            layout = f"<{kind}> with P={p} waypoints"
        if kind != "dense" and call.count is not None and call.count != p:
            raise PrimitiveError(call.start, f"atomic_decoding count={call.count} but the {layout} follows")
        # For dense motion block_size is per trajectory (seed 004 table: 3F + 2 per trajectory).
        expected = expected_block_size(atoms[:1] if kind == "dense" else atoms)
        if call.block_size != expected:
            raise PrimitiveError(
                call.start,
                f"atomic_decoding block_size={call.block_size} but the {layout} needs block_size={expected}",
            )
        return atoms

    def right_arm(self, left: Primitive, following: list[Primitive | _CallDraft]) -> Primitive:
        # Seed 004: dual-arm robots write a left-arm atom and then a right-arm atom.
        want = left.kind.replace("left", "right")
        right = following[0] if following else None
        if not isinstance(right, Primitive) or not self.adjacent(left, right) or right.kind != want:
            raise PrimitiveError(left.end, f"<{left.kind}> must be followed directly by a <{want}> atom")
        if right.waypoints != left.waypoints:
            raise PrimitiveError(
                right.start, f"<{want}> has {right.waypoints} waypoints but the left arm has {left.waypoints}"
            )
        return right

    def dense_group(self, call: _CallDraft, following: list[Primitive | _CallDraft]) -> list[Primitive]:
        count = call.count or 1
        atoms = [following[0]]
        for nxt in following[1:count]:
            if not isinstance(nxt, Primitive) or nxt.kind != "dense" or not self.adjacent(atoms[-1], nxt):
                break
            if len(nxt.values) != len(atoms[0].values):
                raise PrimitiveError(
                    nxt.start,
                    f"<dense> has {nxt.waypoints} future frames but the first one of its call has {atoms[0].waypoints}",
                )
            atoms.append(nxt)
        if len(atoms) != count:
            raise PrimitiveError(
                call.start,
                f"atomic_decoding count={count} but {len(atoms)} consecutive <dense> trajectories follow",
            )
        return atoms
