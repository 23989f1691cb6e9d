"""The import contract (DESIGN.md "The flow" and "Layout", issue 26 item 5), read from the source with `ast`.

Every module of `valen_jax` and `data_pipeline` is parsed, and every import counts as an edge: at module
level, inside a function (a "lazy" import still loads that module whenever it runs), under
`if TYPE_CHECKING:` (the module's code still refers to that layer), and `importlib.import_module("...")`
with a literal name. Importing `a.b.c` also runs the package `a.b`'s `__init__`, so that package is an
edge too (unless the importer lives inside it). The contract fails on

  (i)   any import circle among these modules;
  (ii)  `data_pipeline` importing `valen_jax` (the shard schema is `data_pipeline`'s; never the reverse);
  (iii) an edge against the layer order of `LAYERS`, or into a sealed layer (nothing imports a command),
        or a module that no layer of `LAYERS` names (a new module is placed in the order on purpose).

`LAYERS` maps the subpackages onto DESIGN's order (the top of `valen_jax/` holds only the commands and
`errors.py`). An edge against the order that is not fixed yet is listed in
`KNOWN_BACK_EDGES` with why; the test fails when a listed edge no longer exists, so the list only shrinks.
"""

from __future__ import annotations

import ast
import fnmatch
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("valen_jax", "data_pipeline")

# DESIGN's order, lowest first: a module may import its own layer and the layers before it, never a later
# one. `x.*` names the module or package x and everything under it; a plain name is that module only; the
# longest matching pattern wins.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("data_pipeline", ("data_pipeline.*",)),
    # The user-error taxonomy, a leaf; and the package itself (an empty __init__).
    ("errors", ("valen_jax", "valen_jax.errors")),
    # Models and data (the mesh and logical axis rules live with the models that name their axes), and
    # the config schema both read (it reads only leaves: errors, data.media_defaults, the attention and
    # remat names).
    ("models/data", ("valen_jax.models.*", "valen_jax.data.*", "valen_jax.config.*")),
    # The training loop and the Task protocol it drives, the step builders, losses, optimizer, metrics,
    # progress, checkpoints and the workdir's lock (`training/`), and the decoder.
    ("training/decoding", ("valen_jax.training.*", "valen_jax.decoding.*")),
    # The run handle (`run/`: one restore() of a model run or a drafter run with its target). DESIGN puts it
    # above tasks and evaluation; it sits below them because they take its handles as their input (an
    # evaluator reads a ModelRun, the drafter's task restores its target as one), and it needs nothing of
    # theirs: checkpoints, models and the row layout.
    ("run", ("valen_jax.run.*",)),
    # One module per training mode (`tasks/`), the VFlash feature (`vflash/`), evaluation, and the parts of
    # reinforcement runs (`reinforce/`: rewards read with evaluation's metric definitions).
    ("tasks/evaluation", ("valen_jax.tasks.*", "valen_jax.vflash.*", "valen_jax.evaluation.*",
                          "valen_jax.reinforce.*")),
    # What only the commands use: their logging set-up, the multi-process start, the one error boundary.
    ("cli support", ("valen_jax.cli.*",)),
    # The HTTP server `serve` runs (`serving/`: the slot engine, schemas, routes): above evaluation, whose
    # tool-call parser it answers with, and below the one command that starts it.
    ("serving", ("valen_jax.serving.*",)),
    # The commands users run (DESIGN: `valen_jax/{train,evaluate,predict,generate,regenerate,export,compile,serve}.py`).
    ("commands", ("valen_jax.train", "valen_jax.evaluate", "valen_jax.predict", "valen_jax.generate",
                  "valen_jax.regenerate", "valen_jax.export", "valen_jax.compile", "valen_jax.serve")),
)
# Layers nothing may import, not even a module of the same layer (DESIGN: "Nothing imports `train`").
SEALED = frozenset({"commands"})

# Edges against the order that the code still has, each with why it is not fixed here. The test fails
# when one of them is gone (remove it from this table then), so the table only shrinks.
KNOWN_BACK_EDGES: Mapping[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module
    target: str  # the imported module (or a package whose __init__ the import runs)
    path: str  # the importer's file, relative to the root
    line: int
    kind: str  # "module level", "in a function", "type checking", "import_module", "package __init__"

    def where(self) -> str:
        return f"{self.path}:{self.line} ({self.kind})"


def modules_of(root: Path, packages: Sequence[str] = PACKAGES) -> dict[str, Path]:
    """Module name → file for every .py file of `packages` under `root` (a package is its __init__)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(module: str, is_package: bool, tree: ast.AST) -> Iterable[tuple[str, int, str]]:
    """(a dotted name the module imports, line, kind) for every import statement and literal import_module."""

    def visit(node: ast.AST, kind: str):
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                child_kind = "in a function" if kind == "module level" else kind
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for grandchild in child.body:
                    yield from visit(ast.Module(body=[grandchild], type_ignores=[]), "type checking")
                for grandchild in child.orelse:
                    yield from visit(ast.Module(body=[grandchild], type_ignores=[]), kind)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child.lineno, kind
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: from the module's package, one level up per extra dot
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - (child.level - 1)]
                    origin = ".".join(base + ([child.module] if child.module else []))
                else:
                    origin = child.module
                for alias in child.names:  # `from module import name` or `from package import module`
                    yield origin if alias.name == "*" else f"{origin}.{alias.name}", child.lineno, kind
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute | ast.Name)
                  and (child.func.attr if isinstance(child.func, ast.Attribute) else child.func.id) == "import_module"
                  and child.args and isinstance(child.args[0], ast.Constant) and isinstance(child.args[0].value, str)):
                yield child.args[0].value, child.lineno, "import_module"
            yield from visit(child, child_kind)

    yield from visit(tree, "module level")


def import_edges(root: Path, packages: Sequence[str] = PACKAGES) -> tuple[dict[str, Path], list[Edge]]:
    """The modules of `packages` under `root` and every import edge between them (see the module docstring)."""
    modules = modules_of(root, packages)
    edges: dict[tuple[str, str, int], Edge] = {}
    for module, path in modules.items():
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for name, line, kind in _imported_names(module, path.name == "__init__.py", tree):
            if name.split(".")[0] not in packages:
                continue
            parts = name.split(".")
            # The module: the longest prefix of the name that is one (the rest is an attribute of it).
            while parts and ".".join(parts) not in modules:
                parts.pop()
            targets = []
            if parts:
                targets.append((".".join(parts), kind))
                # The packages whose __init__ the import runs.
                targets += [(".".join(parts[:i]), "package __init__") for i in range(1, len(parts))
                            if ".".join(parts[:i]) in modules]
            elif name.split(".")[0] != module.split(".")[0]:
                targets.append((name, kind))  # another package's module this tree lacks: still an edge
            for target, target_kind in targets:
                # The importer itself and the packages it lives in are already being imported: no edge.
                if not (module == target or module.startswith(target + ".")):
                    edges.setdefault((module, target, line), Edge(module, target, rel, line, target_kind))
    return modules, sorted(edges.values(), key=lambda e: (e.source, e.target, e.line))


def layer_of(module: str, layers=LAYERS) -> str | None:
    """The layer whose longest pattern matches `module` (`x.*` matches x and everything under it)."""
    best, best_length = None, -1
    for layer, patterns in layers:
        for pattern in patterns:
            matched = (fnmatch.fnmatchcase(module, pattern) or module == pattern.removesuffix(".*")) \
                if pattern.endswith(".*") else module == pattern
            if matched and len(pattern) > best_length:
                best, best_length = layer, len(pattern)
    return best


def circles(modules: Iterable[str], edges: Sequence[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    graph: dict[str, list[str]] = {m: [] for m in modules}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge.target)
        graph.setdefault(edge.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(graph[successor])))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def import_problems(root: Path, layers=LAYERS, sealed=SEALED,
                    known_back_edges: Mapping[tuple[str, str], str] = KNOWN_BACK_EDGES,
                    packages: Sequence[str] = PACKAGES) -> list[str]:
    """Every breach of the contract in the tree under `root`, one line each (empty: the contract holds)."""
    modules, edges = import_edges(root, packages)
    problems = []
    for component in circles(modules, edges):
        inside = [f"{e.source} -> {e.target} at {e.where()}" for e in edges
                  if e.source in component and e.target in component]
        problems.append(f"import circle among {', '.join(component)}: {'; '.join(inside)}")
    rank = {layer: i for i, (layer, _) in enumerate(layers)}
    for module in modules:
        if layer_of(module, layers) is None:
            problems.append(f"{module} ({modules[module].relative_to(root)}) is in no layer of LAYERS: place it")
    against: dict[tuple[str, str], list[Edge]] = {}
    for edge in edges:
        if edge.source.split(".")[0] == "data_pipeline":
            # One line per import (the package __init__ it also runs is the same breach).
            if edge.target.split(".")[0] == "valen_jax" and edge.kind != "package __init__":
                problems.append(f"data_pipeline imports valen_jax: {edge.source} -> {edge.target} at {edge.where()}")
            continue
        source, target = layer_of(edge.source, layers), layer_of(edge.target, layers)
        if source is None or target is None:
            continue  # reported above as unplaced
        if rank[target] > rank[source] or target in sealed:
            against.setdefault((edge.source, edge.target), []).append(edge)
    for (source, target), found in sorted(against.items()):
        if (source, target) in known_back_edges:
            continue
        why = (f"nothing imports the {layer_of(target, layers)} layer" if layer_of(target, layers) in sealed else
               f"{layer_of(source, layers)} may not import the later {layer_of(target, layers)} layer")
        problems.append(f"{source} -> {target} goes against the layer order ({why}) at "
                        f"{', '.join(e.where() for e in found)}")
    for source, target in sorted(set(known_back_edges) - set(against)):
        problems.append(f"KNOWN_BACK_EDGES lists {source} -> {target}, which is no longer an edge against the "
                        "order: remove it from the list")
    return problems


def test_the_tree_keeps_the_import_contract():
    problems = import_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_the_top_of_valen_jax_holds_the_commands_and_the_error_taxonomy_only():
    """DESIGN "Layout": everything a command calls lives in a subpackage with one job."""
    commands = {pattern.removeprefix("valen_jax.") for _, patterns in LAYERS for pattern in patterns
                if dict(LAYERS)["commands"] == patterns}
    top = {path.stem for path in (ROOT / "valen_jax").glob("*.py")} - {"__init__", "errors"}
    assert top <= commands, sorted(top - commands)


def test_every_layer_pattern_names_something_or_a_planned_package():
    """A pattern that matches no module must be one of DESIGN's packages still to come (or a command to
    come): a typo in the table would otherwise leave a module unplaced without anyone noticing."""
    planned = {"valen_jax.serve"}
    modules = modules_of(ROOT)
    unused = [pattern for _, patterns in LAYERS for pattern in patterns
              if pattern not in planned and not any(layer_of(m, ((pattern, (pattern,)),)) for m in modules)]
    assert not unused, unused


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


TOY_LAYERS = (
    ("data_pipeline", ("data_pipeline.*",)),
    ("errors", ("valen_jax", "valen_jax.errors")),
    ("models", ("valen_jax.models.*",)),
    ("training", ("valen_jax.training.losses",)),
    ("commands", ("valen_jax.train", "valen_jax.evaluate")),
)


def test_the_checker_reports_a_back_edge_a_circle_and_the_rest(tmp_path):
    """A toy tree with one breach of each kind, and edges that are fine: each breach reported, nothing else."""
    _write(tmp_path, {
        "data_pipeline/__init__.py": "",
        "data_pipeline/formats.py": "import json\n",
        # (ii), from inside a function.
        "data_pipeline/render.py": "def render():\n    from valen_jax.models import net\n    return net\n",
        "valen_jax/__init__.py": "",
        "valen_jax/errors.py": "class UserError(Exception):\n    pass\n",
        "valen_jax/models/__init__.py": "",
        # (iii): models -> training, a back edge; models -> errors and data_pipeline are fine.
        "valen_jax/models/net.py": "from data_pipeline import formats\nfrom valen_jax.errors import UserError\n"
                                   "from valen_jax.training import losses\n",
        # (i): a circle, one way at module level, back under TYPE_CHECKING.
        "valen_jax/models/a.py": "from valen_jax.models.b import B\n",
        "valen_jax/models/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from valen_jax.models.a import A\nB = 1\n",
        "valen_jax/training/losses.py": "import valen_jax.errors\n",
        # A command importing another (sealed), and one importing the library (fine).
        "valen_jax/evaluate.py": "from valen_jax.training import losses\n",
        "valen_jax/train.py": "import importlib\nfrom valen_jax.models import net\n"
                              "def report():\n    return importlib.import_module('valen_jax.evaluate')\n",
        # A module in no layer.
        "valen_jax/helpers.py": "",
    })
    problems = import_problems(tmp_path, TOY_LAYERS, frozenset({"commands"}), {})
    assert len(problems) == 5, "\n".join(problems)
    circle, unplaced, back, sealed, data_pipeline = sorted(problems, key=lambda p: (
        "circle" not in p, "no layer" not in p, "later" not in p, "nothing imports" not in p))
    assert circle.startswith("import circle among valen_jax.models.a, valen_jax.models.b: ")
    assert "valen_jax/models/a.py:1 (module level)" in circle and "valen_jax/models/b.py:3 (type checking)" in circle
    assert unplaced.startswith("valen_jax.helpers (valen_jax/helpers.py) is in no layer")
    assert back == ("valen_jax.models.net -> valen_jax.training.losses goes against the layer order (models may not import "
                    "the later training layer) at valen_jax/models/net.py:3 (module level)")
    assert sealed == ("valen_jax.train -> valen_jax.evaluate goes against the layer order (nothing imports the "
                      "commands layer) at valen_jax/train.py:4 (import_module)")
    assert data_pipeline == ("data_pipeline imports valen_jax: data_pipeline.render -> valen_jax.models.net at "
                             "data_pipeline/render.py:2 (in a function)")

    # A listed back edge is tolerated while it exists, and reported once it is gone.
    known = {("valen_jax.models.net", "valen_jax.training.losses"): "toy"}
    assert not any("net -> valen_jax.training.losses" in p for p in import_problems(tmp_path, TOY_LAYERS, frozenset(), known))
    (tmp_path / "valen_jax/models/net.py").write_text("from valen_jax.errors import UserError\n")
    assert [p for p in import_problems(tmp_path, TOY_LAYERS, frozenset(), known) if "KNOWN" in p] == [
        "KNOWN_BACK_EDGES lists valen_jax.models.net -> valen_jax.training.losses, which is no longer an edge against the "
        "order: remove it from the list"]


def test_the_checker_follows_relative_imports_and_package_inits(tmp_path):
    _write(tmp_path, {
        "data_pipeline/__init__.py": "",
        "valen_jax/__init__.py": "",
        "valen_jax/errors.py": "",
        "valen_jax/models/__init__.py": "from .net import Net\n",  # the package runs net
        "valen_jax/models/net.py": "from ..errors import *\nNet = 1\n",
        "valen_jax/models/util.py": "",
        "valen_jax/training/losses.py": "from valen_jax.models.util import *\n",  # runs models/__init__ too
    })
    _, edges = import_edges(tmp_path)
    assert {(e.source, e.target, e.kind) for e in edges} == {
        ("valen_jax.models", "valen_jax.models.net", "module level"),
        ("valen_jax.models.net", "valen_jax.errors", "module level"),
        ("valen_jax.training.losses", "valen_jax.models.util", "module level"),
        ("valen_jax.training.losses", "valen_jax.models", "package __init__"),
    }
    assert import_problems(tmp_path, TOY_LAYERS, frozenset({"commands"}), {}) == []


def test_a_back_edge_added_to_the_real_tree_is_reported(tmp_path):
    """The real table on a copy of the tree with one deliberate back edge (models importing a command)
    and one circle (the errors leaf importing the schema, which imports it)."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert import_problems(tmp_path) == []
    config = tmp_path / "valen_jax/models/config.py"
    config.write_text(config.read_text() + "\n\ndef _late():\n    from valen_jax import train  # noqa\n")
    errors = tmp_path / "valen_jax/errors.py"
    errors.write_text(errors.read_text() + "\nfrom valen_jax.config import schema  # noqa\n")
    problems = import_problems(tmp_path)
    assert any(p.startswith("valen_jax.models.config -> valen_jax.train goes against the layer order") for p in problems)
    assert any(p.startswith("valen_jax.errors -> valen_jax.config.schema goes against") for p in problems)
    assert any(p.startswith("import circle among ") and "valen_jax.errors" in p and "valen_jax.config.schema" in p
               for p in problems)
