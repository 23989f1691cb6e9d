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


def _i32(*values) -> np.ndarray:
    return np.asarray(values, np.int32)


_SAMPLES = {
    # A VFlash-like row: one point primitive announced by no atomic_decoding call.
    examples.TOKENS: ({"input_ids": _i32(1, 2, 3), "target_weights": np.asarray([0, 1, 1], np.float32),
                       "primitive_spans": _i32(0, 1, 3).reshape(1, 3), "primitive_blocks": _i32(-1, 0, 0).reshape(1, 3)},
                      {"answers": ["<point>…</point>"], "dense_scale": 2.0, "turns": 2, "trained_turns": 1,
                       "tool_calls": [[]], "id": "c1", "record_id": 7, "locale": "en-US", "language": "en", "data_source": "synthetic",
                       "domain": "d", "scenario": None, "split": "train", "entities": [], "skipped": {},
                       "overlaps": {"turns": 0, "merged": 0, "dropped": 0}}),
    # One labeled choice question with two candidates.
    examples.VALEN: ({"state_ids": _i32(1, 2), "suffix_ids": _i32(3), "instruction_ids": _i32(4, 5),
                      "instruction_offsets": _i32(0, 2), "candidate_ids": _i32(6, 7), "candidate_offsets": _i32(0, 1, 2),
                      "candidate_question": _i32(0, 0), "labels": np.asarray([1, 0], np.float32),
                      "labeled": np.asarray([True]), "question_type": _i32(0)},
                     {"group_id": "g", "record_id": None, "domain": "traffic", "modality": "image",
                      "language_bucket": "en", "questions": ["q1"], "question_types": ["choice"],
                      "candidate_keys": [["red", "green"]], "hard_labels": [True]}),
}


def _full(kind: str) -> tuple[dict, dict]:
    """Every declared field of `kind` with a consistent value, and one media item."""
    arrays, meta = _SAMPLES[kind]
    arrays = {**arrays, "media_0": np.frombuffer(b"\x89PNG", np.uint8)}
    meta = {"format": "f", "source": "x", "line": 3, "entry": "e", **meta,
            "media": [{"sha256": "0" * 64, "kind": "image", "path": "a.png", "frame_index": None, "resize": None}]}
    assert sorted(meta) == sorted(f.name for f in META[kind]) and set(arrays) - {"media_0"} == {
        f.name for f in ARRAYS[kind]}
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


def test_the_contract_refuses_fields_that_disagree_with_each_other():
    arrays, meta = _full(examples.VALEN)
    with pytest.raises(ExampleError, match=r"candidate_question and labels must hold one entry per candidate \(2\)"):
        examples.build(examples.VALEN, {**arrays, "labels": np.ones(3, np.float32)}, **meta)
    with pytest.raises(ExampleError, match="instruction_offsets do not split instruction_ids"):
        examples.build(examples.VALEN, {**arrays, "instruction_offsets": _i32(0, 3)}, **meta)
    with pytest.raises(ExampleError, match="question_type codes outside QUESTION_TYPES"):
        examples.build(examples.VALEN, {**arrays, "question_type": _i32(3)}, **meta)
    with pytest.raises(ExampleError, match=r"meta candidate_keys name 3 candidates, arrays 2"):
        examples.build(examples.VALEN, arrays, **{**meta, "candidate_keys": [["a", "b", "c"]]})
    arrays, meta = _full(examples.TOKENS)
    with pytest.raises(ExampleError, match=r"input_ids \(3,\) and target_weights \(2,\) must be \[T\]"):
        examples.build(examples.TOKENS, {**arrays, "target_weights": np.ones(2, np.float32)}, **meta)
    with pytest.raises(ExampleError, match="1 primitive_spans for 0 primitive_blocks"):
        examples.build(examples.TOKENS, {**arrays, "primitive_blocks": np.zeros((0, 3), np.int32)}, **meta)


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
