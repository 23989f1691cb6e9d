"""Seed 004: the dense-motion scale `s` is per dataset, from the recipe entry into the Example's
meta and into evaluation's metres; dense answers without a stated scale are refused."""

from __future__ import annotations

import json

import pytest

from data_pipeline.formats.recipe import read_recipe_records
from data_pipeline.formats.vflash import read_vflash
from data_pipeline.render.common import RenderError
from data_pipeline.render.vflash import VFlashRenderer
from data_pipeline.shards import Example
from data_pipeline.tokenizer import load_tokenizer
from tests.train_runs import ROOT
from valen_jax.evaluation.metrics.vflash import VFlashStats
from valen_jax.evaluation.vflash import dense_scale

CALL = '<tool_call>{"name":"atomic_decoding","arguments":{"block_size":8}}</tool_call>'
REFERENCE = CALL + "<dense><500><500><500><500><500><500></dense>"
PREDICTED = CALL + "<dense><750><500><500><750><500><500></dense>"  # +250 tokens in x on both frames


@pytest.fixture(scope="module")
def renderer():
    return VFlashRenderer(load_tokenizer(ROOT / "data/tokenizer"))


def _write(folder, answer=REFERENCE):
    row = {"conversations": [{"from": "human", "value": "Track the point."}, {"from": "gpt", "value": answer}]}
    (folder / "dense.jsonl").write_text(json.dumps(row) + "\n")
    return folder / "dense.jsonl"


@pytest.mark.parametrize("scale", [0.5, 4.0])
def test_recipe_scale_reaches_the_example_and_the_metres_of_evaluation(renderer, tmp_path, scale):
    _write(tmp_path)
    (tmp_path / "recipe.json").write_text(json.dumps({"d": {"annotation": "dense.jsonl", "dense_scale": scale}}))
    ((entry, (record,)),) = read_recipe_records(tmp_path / "recipe.json")
    example = Example.from_bytes(renderer.render(record, entry.name).to_bytes())  # through the shard bytes
    assert example.meta["dense_scale"] == scale
    stats = VFlashStats()
    stats.add(example.meta["answers"][-1], PREDICTED, dense_scale=dense_scale(example))
    # 250 tokens of 500 per s metres: the error is s / 2 m, not a fixed 2 m scale's 1 m.
    assert stats.report()["overall"]["dense"]["error"] == pytest.approx(scale / 2)


def test_plain_file_takes_the_scale_as_an_option_and_refuses_dense_without_one(renderer, tmp_path):
    path = _write(tmp_path)
    (record,) = read_vflash(path, dense_scale=3.0)
    assert renderer.render(record, "dense").meta["dense_scale"] == 3.0
    (record,) = read_vflash(path)
    with pytest.raises(RenderError, match="dense_scale"):
        renderer.render(record, "dense")


def test_evaluation_refuses_dense_references_in_shards_without_a_scale(renderer, tmp_path):
    (record,) = read_vflash(_write(tmp_path), dense_scale=2.0)
    example = renderer.render(record, "dense")
    del example.meta["dense_scale"]  # shards made before the scale was recorded
    with pytest.raises(ValueError, match="convert the data again"):
        dense_scale(example)
    (record,) = read_vflash(_write(tmp_path, "<point><1><2></point>"))
    assert "dense_scale" not in renderer.render(record, "p").meta


def test_convert_takes_the_scale_of_a_plain_file_as_a_format_option(tmp_path):
    from data_pipeline.conversion import convert
    from data_pipeline.shards import read_shard

    path = _write(tmp_path)
    manifest = convert("vflash", path, tmp_path / "shards", ROOT / "data/tokenizer", options={"dense_scale": 1.5})
    assert manifest.data["options"]["dense_scale"] == 1.5
    (example,) = [e for shard in sorted((tmp_path / "shards").glob("*.array_record")) for e in read_shard(shard)]
    assert example.meta["dense_scale"] == 1.5
    with pytest.raises(RenderError, match="dense_scale"):
        convert("vflash", path, tmp_path / "none", ROOT / "data/tokenizer")
