"""The Example contract (data_pipeline/examples.py): each kind round-trips through it, it refuses what
it does not declare, and no module outside it spells an Example meta key as a string."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import examples
from data_pipeline.examples import ARRAYS, META, ExampleError
from data_pipeline.shards import Example
from tests.train_runs import ROOT

_SAMPLE_ARRAY = {"int32": np.arange(3, dtype=np.int32), "float32": np.ones(3, np.float32),
                 "bool": np.array([True, False]), "uint8": np.zeros(2, np.uint8)}
_SAMPLE_META = {str: "x", int: 3, list: [], dict: {}, object: "y"}


def _full(kind: str) -> tuple[dict, dict]:
    """Every declared field of `kind`, with a value of its declared type, and one media item."""
    arrays = {f.name: _SAMPLE_ARRAY[f.dtype] for f in ARRAYS[kind]}
    arrays["media_0"] = np.frombuffer(b"\x89PNG", np.uint8)
    meta = {f.name: _SAMPLE_META[f.type if isinstance(f.type, type) else f.type[0]] for f in META[kind]}
    meta["media"] = [{"sha256": "0" * 64, "kind": "image", "path": "a.png", "frame_index": None, "resize": None}]
    return arrays, meta


@pytest.mark.parametrize("kind", examples.KINDS)
def test_each_kind_round_trips_through_the_contract(kind):
    arrays, meta = _full(kind)
    example = Example.from_bytes(examples.build(kind, arrays, **meta).to_bytes())
    assert examples.kind_of(example) == kind
    assert sorted(example.arrays) == sorted(arrays)
    for name, array in arrays.items():
        assert example.arrays[name].dtype == array.dtype and np.array_equal(example.arrays[name], array)
    view = examples.meta_of(example)
    assert {f.name: getattr(view, f.name) for f in META[kind]} == meta
    assert examples.media_headers(example) == meta["media"]
    assert examples.media_bytes(example, 0) == b"\x89PNG"
    assert examples.where(example) == "x:3"
    examples.check(kind, example.arrays, example.meta)  # what was read is what the contract declares


@pytest.mark.parametrize("kind", examples.KINDS)
def test_the_contract_refuses_what_it_does_not_declare(kind):
    arrays, meta = _full(kind)
    with pytest.raises(ExampleError, match="x:3: meta 'colour' is not a field"):
        examples.build(kind, arrays, **meta, colour="red")
    with pytest.raises(ExampleError, match="x:3: array 'extra' is not a field"):
        examples.build(kind, {**arrays, "extra": np.zeros(1, np.int32)}, **meta)
    first = ARRAYS[kind][0]
    with pytest.raises(ExampleError, match=f"array '{first.name}' is int64, the contract says {first.dtype}"):
        examples.build(kind, {**arrays, first.name: np.zeros(2, np.int64)}, **meta)
    with pytest.raises(ExampleError, match=f"{kind} Example without {first.name}"):
        examples.build(kind, {k: v for k, v in arrays.items() if k != first.name}, **meta)
    with pytest.raises(ExampleError, match=r"1 media headers for media arrays \[\]"):
        examples.build(kind, {k: v for k, v in arrays.items() if k != "media_0"}, **meta)
    with pytest.raises(AttributeError, match="'colour' is not a meta field of any Example kind"):
        _ = examples.meta_of(examples.build(kind, arrays, **meta)).colour


def test_an_optional_field_given_as_none_is_left_out_unless_nullable():
    arrays = {"input_ids": np.arange(2, dtype=np.int32), "target_weights": np.ones(2, np.float32)}
    example = examples.build(examples.TOKENS, arrays, format="vflash", source="a", line=1, entry="e",
                             dense_scale=None, scenario=None)
    assert "dense_scale" not in example.meta and example.meta["scenario"] is None
    assert examples.meta_of(example).dense_scale is None


def test_the_smoke_renderers_write_what_the_contract_declares(tmp_path):
    from data_pipeline.conversion import convert
    from data_pipeline.shards import read_shard

    for fmt, path in (("valen", "data/smoke/valen/train.jsonl"), ("recipe", "data/smoke/vflash/recipe.json")):
        manifest = convert(fmt, ROOT / path, tmp_path / fmt, ROOT / "data/tokenizer", progress=False)
        for shard in manifest.shard_paths:
            for example in read_shard(tmp_path / fmt / shard):
                examples.check(examples.kind_of(example), example.arrays, example.meta)


def _meta_key_literals(path: Path, keys: frozenset[str]) -> list[str]:
    """`X.meta["key"]`, `meta["key"]`, `X.meta.get("key")`, `meta.get("key")` and `meta = {"key": ...}`
    (also `meta=` keyword dicts) where "key" is a declared Example meta field."""
    found = []

    def is_meta(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "meta") or (
            isinstance(node, ast.Attribute) and node.attr == "meta")

    def literal(node) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    def dict_keys(node) -> list[str]:
        return [k for k in map(literal, node.keys) if k is not None] if isinstance(node, ast.Dict) else []

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        spelled: list[str] = []
        if isinstance(node, ast.Subscript) and is_meta(node.value):
            spelled = [literal(node.slice)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")
              and is_meta(node.func.value) and node.args):
            spelled = [literal(node.args[0])]
        elif isinstance(node, ast.Assign) and any(is_meta(t) for t in node.targets):
            spelled = dict_keys(node.value)
        elif isinstance(node, ast.keyword) and node.arg == "meta":
            spelled = dict_keys(node.value)
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {key!r}" for key in spelled if key in keys]
    return found


def test_no_module_but_the_contract_spells_a_meta_key():
    # Record meta (a Valen record's own `meta` object) and checkpoint meta share the attribute name;
    # only keys the Example contract declares count, so those stay readable as they are.
    keys = frozenset(f.name for fields in META.values() for f in fields)
    contract = ROOT / "data_pipeline/examples.py"
    sources = sorted(p for package in ("data_pipeline", "valen_jax") for p in (ROOT / package).rglob("*.py")
                     if p != contract)
    assert sources
    found = [hit for path in sources for hit in _meta_key_literals(path, keys)]
    assert found == [], "read and write Example meta through data_pipeline.examples:\n" + "\n".join(found)
