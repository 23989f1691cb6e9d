"""Shard schema, VFlash rendering and the convert CLI on the real smoke data and tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from data_pipeline import vocabulary
from data_pipeline.conversion import convert
from data_pipeline.formats.recipe import read_recipe_records
from data_pipeline.render.common import RenderError
from data_pipeline.render.vflash import VFlashRenderer
from data_pipeline.shards import Example, Manifest, ShardError, read_shard
from data_pipeline.tokenizer import TokenizerError, load_tokenizer
from tests.train_runs import ROOT

RECIPE = ROOT / "data/smoke/vflash/recipe.json"
TOKENIZER = ROOT / "data/tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def records():
    return {entry.name: recs for entry, recs in read_recipe_records(RECIPE)}


def test_example_round_trips_without_pickle():
    example = Example({"ids": np.arange(5, dtype=np.int32), "w": np.ones((2, 3), np.float32),
                       "media_0": np.frombuffer(b"\x89PNG", np.uint8)}, {"source": "a.jsonl", "line": 3})
    data = example.to_bytes()
    assert b"pickle" not in data and b"\x80\x04" not in data[:8]
    back = Example.from_bytes(data)
    assert back.meta == {"source": "a.jsonl", "line": 3}
    for name, array in example.arrays.items():
        np.testing.assert_array_equal(back.arrays[name], array)
        assert back.arrays[name].dtype == array.dtype
    assert Example.from_bytes(data).to_bytes() == data


def test_example_refuses_object_arrays_and_truncated_bytes():
    with pytest.raises(ShardError, match="dtype"):
        Example({"x": np.array(["a"], dtype=object)}).to_bytes()
    data = Example({"x": np.arange(100, dtype=np.int32)}).to_bytes()
    with pytest.raises(ShardError, match="runs past the end"):
        Example.from_bytes(data[:-4])


def test_assistant_tokens_only_carry_loss_and_the_end_of_turn_is_trained(tokenizer, records):
    renderer = VFlashRenderer(tokenizer)
    record = records["smoke_points"][0]
    example = renderer.render(record, "smoke_points")
    ids, weights = example.arrays["input_ids"], example.arrays["target_weights"]
    trained = tokenizer.decode(ids[weights > 0])
    assert trained == record.turns[-1].text + vocabulary.IM_END
    assert ids[weights > 0][-1] == tokenizer.convert_tokens_to_ids(vocabulary.IM_END)
    assert (ids == tokenizer.convert_tokens_to_ids(vocabulary.IMAGE_PAD)).sum() == len(record.media)
    assert example.meta["media"][0]["sha256"] == __import__("hashlib").sha256(
        record.media[0].path.read_bytes()).hexdigest()


def test_atom_loss_masks_zero_exactly_the_marked_coordinates(tokenizer, records):
    renderer = VFlashRenderer(tokenizer)
    masked = [r for r in records["smoke_robot2d"] if r.atom_loss_masks]
    assert masked
    record = masked[0]
    example = renderer.render(record, "smoke_robot2d")
    ids, weights, spans = (example.arrays[k] for k in ("input_ids", "target_weights", "primitive_spans"))
    numbers = set(tokenizer.convert_tokens_to_ids(list(vocabulary.NUMBER_TOKENS)))
    (kind, start, stop), = spans
    coordinate_positions = [p for p in range(start, stop) if int(ids[p]) in numbers]
    expected = [float(c) for c in record.atom_loss_masks[0]]
    assert weights[coordinate_positions].tolist() == expected
    assert "0" in record.atom_loss_masks[0]
    # Tags around the coordinates stay trained.
    assert weights[start] == 1.0 and weights[stop - 1] == 1.0


def test_template_without_generation_markers_is_refused(tokenizer, records, tmp_path):
    from transformers import AutoTokenizer
    plain = AutoTokenizer.from_pretrained(TOKENIZER)
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    # Under tmp_path, not the repo's runs/: two runs of the suite at once must not share it.
    plain.save_pretrained(tmp_path / "plain_tokenizer")
    with pytest.raises(TokenizerError, match="generation"):
        load_tokenizer(tmp_path / "plain_tokenizer")
    fixed = load_tokenizer(tmp_path / "plain_tokenizer", template_family="chatml")
    assert "generation" in fixed.chat_template


def test_all_zero_assistant_mask_is_an_error(tokenizer, records):
    from data_pipeline.render.common import render_chat
    with pytest.raises(RenderError, match="marks no assistant token"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], "x.jsonl", 7)


def test_missing_primitive_tokens_are_added_and_counted(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from data_pipeline.tokenizer import add_primitive_tokens
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["a small corpus of words"] * 10, trainers.BpeTrainer(vocab_size=300))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    added = add_primitive_tokens(tok)
    assert added == len(vocabulary.NUMBER_TOKENS) + len(vocabulary.PRIMITIVE_TAGS) + len(vocabulary.VISION_TOKENS)
    assert add_primitive_tokens(tok) == 0
    assert tok.encode("<robot_single><521><0></robot>", add_special_tokens=False) == tok.convert_tokens_to_ids(
        ["<robot_single>", "<521>", "<0>", "</robot>"])


def test_convert_is_byte_identical_whatever_the_worker_count(tmp_path):
    one = convert("recipe", RECIPE, tmp_path / "one", TOKENIZER, workers=1, progress=False)
    two = convert("recipe", RECIPE, tmp_path / "two", TOKENIZER, workers=2, progress=False)
    assert one.data == two.data
    for name in [*one.shard_paths, "manifest.json"]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    manifest = Manifest.read(tmp_path / "one")
    counts = manifest.data["counts"]
    examples = [e for p in manifest.shard_paths for e in read_shard(tmp_path / "one" / p)]
    assert counts["records"] == len(examples) == 96
    assert counts["tokens"] == sum(len(e.arrays["input_ids"]) for e in examples)
    assert counts["supervised_tokens"] == sum(int((e.arrays["target_weights"] > 0).sum()) for e in examples)
    assert [e["name"] for e in manifest.data["entries"]][:2] == ["smoke_points", "smoke_boxes"]
    assert all(len(s["sha256"]) == 64 for s in manifest.data["sources"])
    assert manifest.data["media"] and all(len(m["sha256"]) == 64 for m in manifest.data["media"])


@pytest.mark.slow
def test_convert_cli_refuses_to_overwrite_and_reports_bad_input(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    cmd = [sys.executable, "-m", "data_pipeline.convert", "--format=recipe", f"--input={RECIPE}",
           f"--output={out}", f"--tokenizer={TOKENIZER}"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1 and "--overwrite" in result.stderr
    assert (out / "keep.txt").read_text() == "precious"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                 {"from": "gpt", "value": "<point><1001><3></point>"}]}) + "\n")
    cmd = [sys.executable, "-m", "data_pipeline.convert", "--format=vflash", f"--input={bad}",
           f"--output={tmp_path / 'bad_out'}", f"--tokenizer={TOKENIZER}"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.startswith(f"{bad}:1: conversations[1].value:")
    assert not (tmp_path / "bad_out").exists()


def test_shards_of_another_tokenizer_are_refused(tmp_path):
    convert("vflash", ROOT / "data/smoke/vflash/eval.jsonl", tmp_path / "s", TOKENIZER, progress=False)
    manifest = Manifest.read(tmp_path / "s")
    with pytest.raises(ShardError, match="reconvert"):
        manifest.check_fingerprint({"tokenizerSha256": "0" * 64, "chatTemplateSha256": "1" * 64}, "run")


def test_lmdb_references_are_copied_into_the_shard_and_decode(tmp_path, tokenizer):
    import lmdb
    from PIL import Image

    from valen_jax.data.media import load_frames
    image = tmp_path / "scene.png"
    Image.new("RGB", (32, 24), (10, 200, 30)).save(image)
    env = lmdb.open(str(tmp_path / "frames.lmdb"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"ep1/000", image.read_bytes())
    env.close()
    row = {"image": {"lmdb_file": "frames.lmdb", "lmdb_key": "ep1/000"},
           "conversations": [{"from": "human", "value": "<image>\nPoint to the block."},
                             {"from": "gpt", "value": "<point><100><200></point>"}]}
    (tmp_path / "a.jsonl").write_text(json.dumps(row) + "\n")
    convert("vflash", tmp_path / "a.jsonl", tmp_path / "out", TOKENIZER, progress=False)
    manifest = Manifest.read(tmp_path / "out")
    (example,) = read_shard(tmp_path / "out" / manifest.shard_paths[0])
    header = example.meta["media"][0]
    assert header["kind"] == "lmdb" and header["lmdb_key"] == "ep1/000"
    assert example.arrays["media_0"].tobytes() == image.read_bytes()
    frames = load_frames(example.arrays["media_0"].tobytes(), header, {}, "a.jsonl:1").frames
    assert frames[0].size == (32, 24) and frames[0].getpixel((0, 0)) == (10, 200, 30)


def test_a_bad_record_fails_a_multi_worker_conversion_with_its_line(tmp_path):
    import pickle

    from data_pipeline.formats.errors import FormatError, Problem
    error = RenderError("a.jsonl", 3, "conversations", "boom")
    assert str(pickle.loads(pickle.dumps(error))) == str(error)
    problems = FormatError([Problem("a.jsonl", 1, "x", "bad"), Problem("a.jsonl", 2, "y", "worse")])
    assert pickle.loads(pickle.dumps(problems)).problems == problems.problems
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "<point><1><2></point>"}]}
            for _ in range(20)]
    rows[13]["conversations"][0]["value"] = "hi <|im_end|> there"  # renders, but injects a control token
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RenderError):
        convert("vflash", tmp_path / "a.jsonl", tmp_path / "out", TOKENIZER, workers=2, progress=False)


def test_each_trajectory_carries_its_atomic_decoding_block(tokenizer, records):
    renderer = VFlashRenderer(tokenizer)
    record = records["smoke_robot2d"][0]
    example = renderer.render(record, "smoke_robot2d")
    spans, blocks = example.arrays["primitive_spans"], example.arrays["primitive_blocks"]
    assert blocks.shape == (len(spans), 3)
    (_, start, stop), (call, block_size, count) = spans[0], blocks[0]
    # Seed 004: block_size counts every token of the primitive, tags included.
    assert call == 0 and block_size == stop - start and count == (stop - start - 2) // 2
    point = renderer.render(records["smoke_points"][0], "smoke_points")
    assert point.arrays["primitive_blocks"].tolist() == [[-1, 0, 0]]
