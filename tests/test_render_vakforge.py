"""Vakforge conversations → chat Examples (seed 002, "Adapters", "turns[].overlap", "Splits").

Real manifests: the committed smoke dataset in data/smoke/vakforge, and small synthetic datasets
(manifest + splits.json) written under tmp_path and read with the full validator.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.conversion import convert
from data_pipeline.formats.vakforge import manifest_hash
from data_pipeline.formats.vakforge_items import read_vakforge_items
from data_pipeline.render.common import RenderError, mask_runs
from data_pipeline.render.vakforge import VakforgeRenderer
from data_pipeline.shards import Manifest, read_shard
from data_pipeline.tokenizer import load_tokenizer
from tests.train_runs import ROOT

TOKENIZER = ROOT / "data/tokenizer"
SMOKE = ROOT / "data/smoke/vakforge/vakforge.jsonl"
LOOKUP = {"name": "lookup", "description": "Look up an order",
          "parameters": {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "string"}},
                         "required": ["b", "a"]}}


def spoken(speaker, start, end, text, **extra):
    return {"speaker": speaker, "start": start, "end": end, "text": text, "lang": "en-US", **extra}


def conversation(cid="c1", **overrides) -> dict:
    turns = [
        spoken("user", 0.0, 2.0, "Hello, order NW-1.",
               entities=[{"type": "order_id", "text": "NW-1", "start_char": 13, "end_char": 17}]),
        spoken("user", 1.5, 3.0, "Are you there?", overlap=True),
        spoken("agent", 3.1, 4.0, "Yes."),
        spoken("agent", 4.1, 5.0, "Checking order NW-1.",
               entities=[{"type": "order_id", "text": "NW-1", "start_char": 15, "end_char": 19}]),
        {"speaker": "agent", "start": 5.0, "end": 5.0,
         "tool_call": {"id": "k1", "name": "lookup", "arguments": {"b": "x", "a": "y"}}},
        {"speaker": "agent", "start": 5.0, "end": 5.0,
         "tool_call": {"id": "k2", "name": "lookup", "arguments": {"b": "z", "a": "w"}}},
        {"speaker": "tool", "start": 5.0, "end": 5.0, "tool_result": {"id": "k1", "content": {"status": "ok", "eta": 3}}},
        {"speaker": "tool", "start": 5.0, "end": 5.0, "tool_result": {"id": "k2", "content": "late"}},
        spoken("agent", 5.2, 6.0, "One is ok."),
    ]
    return {"id": cid, "schema_version": "0.1", "locale": "en-US", "language": {"primary": "en-US"},
            "system_prompt": "You are Ava.", "tools": [LOOKUP], "turns": turns,
            "meta": {"source": "synthetic", "consent": "synthetic", "pii_redacted": False}, **overrides}


def dataset(tmp_path: Path, *convs: dict, splits: dict | None = None) -> Path:
    manifest = tmp_path / "data" / "vakforge.jsonl"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs), encoding="utf-8")
    splits = splits or {"train": [c["id"] for c in convs]}
    (manifest.parent / "splits.json").write_text(json.dumps({"seed": 7, "splits": splits}), encoding="utf-8")
    return manifest


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


def render_one(tokenizer, manifest, **options):
    (item,) = read_vakforge_items(manifest)
    return VakforgeRenderer(tokenizer, **options).render(item, "e")


def text_of(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def test_a_conversation_becomes_a_chat_row(tokenizer, tmp_path):
    example = render_one(tokenizer, dataset(tmp_path, conversation()))
    ids, weights = example.arrays["input_ids"], example.arrays["target_weights"]
    text = text_of(tokenizer, ids)
    assert text.startswith("<|im_start|>system\nYou are Ava.\n\n# Tools\n")
    assert '{"type": "function", "function": {"name": "lookup", "description": "Look up an order"' in text
    assert "<|im_start|>user\nHello, order NW-1. Are you there?<|im_end|>\n" in text  # merged, same speaker
    assert "<|im_start|>assistant\nYes. Checking order NW-1.<|im_end|>\n" in text
    # Parallel calls: one assistant message; arguments keep their order (b before a).
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "lookup", "arguments": {"b": "x", "a": "y"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"b": "z", "a": "w"}}\n</tool_call><|im_end|>') in text
    assert ('<|im_start|>user\n<tool_response>\n{"status": "ok", "eta": 3}\n</tool_response>\n'
            "<tool_response>\nlate\n</tool_response><|im_end|>") in text
    runs = mask_runs(weights > 0)
    assert len(runs) == 3 and text_of(tokenizer, ids[runs[-1][0]:runs[-1][1]]) == "One is ok.<|im_end|>"
    meta = example.meta
    assert meta["format"] == "vakforge" and meta["id"] == "c1" and meta["turns"] == 7
    assert meta["tool_calls"] == [[], [{"name": "lookup", "arguments": '{"b": "x", "a": "y"}'},
                                       {"name": "lookup", "arguments": '{"b": "z", "a": "w"}'}], []]
    assert meta["overlaps"] == {"turns": 1, "merged": 2, "dropped": 0} and meta["skipped"] == {}


def test_entities_point_into_their_merged_message(tokenizer, tmp_path):
    meta = render_one(tokenizer, dataset(tmp_path, conversation())).meta
    texts = {1: "Hello, order NW-1. Are you there?", 2: "Yes. Checking order NW-1."}
    assert [(e["turn"], e["message"], e["speaker"]) for e in meta["entities"]] == [(0, 1, "user"), (3, 2, "agent")]
    for entity in meta["entities"]:
        assert texts[entity["message"]][entity["start_char"]:entity["end_char"]] == entity["text"] == "NW-1"
    assert (meta["locale"], meta["language"], meta["data_source"], meta["split"]) == ("en-US", "en-US", "synthetic",
                                                                                      "train")


def test_overlap_drop_drops_the_interjection_and_joins_nothing(tokenizer, tmp_path):
    example = render_one(tokenizer, dataset(tmp_path, conversation()), overlap="drop")
    text = text_of(tokenizer, example.arrays["input_ids"])
    assert "Are you there?" not in text
    assert "<|im_start|>user\nHello, order NW-1.<|im_end|>\n<|im_start|>assistant\nYes.<|im_end|>\n" in text
    assert example.meta["overlaps"] == {"turns": 1, "merged": 0, "dropped": 1}
    assert example.meta["skipped"] == {"overlapping_turns": 1}
    assert example.meta["trained_turns"] == 4
    with pytest.raises(ValueError, match="overlap='keep'"):
        VakforgeRenderer(tokenizer, overlap="keep")


def test_an_interjection_of_the_other_speaker_is_kept_in_time_order(tokenizer):
    items = {item.conversation.id: item for item in read_vakforge_items(SMOKE)}
    merged = VakforgeRenderer(tokenizer).render(items["conv_hi_0002"], "e")
    text = text_of(tokenizer, merged.arrays["input_ids"])
    assert "customer ID SC-4471.<|im_end|>\n<|im_start|>assistant\nEk minute, check karti hoon.<|im_end|>" in text
    dropped = VakforgeRenderer(tokenizer, overlap="drop").render(items["conv_hi_0002"], "e")
    assert "Ek minute" not in text_of(tokenizer, dropped.arrays["input_ids"])


def test_a_final_unanswered_call_is_the_last_trained_turn(tokenizer):
    # Seed 002: "A call in the final turn may go unanswered"; it is what the agent should do next.
    (item,) = [i for i in read_vakforge_items(SMOKE) if i.conversation.id == "conv_hi_0002"]
    example = VakforgeRenderer(tokenizer, assistant_turns="last").render(item, "e")
    ids, weights = example.arrays["input_ids"], example.arrays["target_weights"]
    assert text_of(tokenizer, ids[weights > 0]) == (
        '<tool_call>\n{"name": "book_appointment", "arguments": {"customer_id": "SC-4471", "date": "2026-09-17", '
        '"slot": "morning"}}\n</tool_call><|im_end|>')
    assert example.meta["trained_turns"] == 1


def test_assistant_turns_last(tokenizer, tmp_path):
    example = render_one(tokenizer, dataset(tmp_path, conversation()), assistant_turns="last")
    ids, weights = example.arrays["input_ids"], example.arrays["target_weights"]
    assert text_of(tokenizer, ids[weights > 0]) == "One is ok.<|im_end|>"


@pytest.mark.parametrize(("where", "field"), [
    (("turns", 2, "text"), "turns[2].text"),
    (("turns", 6, "tool_result"), "turns[6].tool_result.content"),
    (("system_prompt",), "system_prompt"),
])
def test_control_tokens_are_refused_with_the_turn(tokenizer, tmp_path, where, field):
    conv = conversation()
    if where[0] == "turns" and where[2] == "text":
        conv["turns"][where[1]]["text"] = "Yes.<|im_end|>"
    elif where[0] == "turns":
        conv["turns"][where[1]]["tool_result"]["content"] = {"note": "<|image_pad|>"}
    else:
        conv["system_prompt"] = "<|im_start|>system"
    manifest = dataset(tmp_path, conv)
    with pytest.raises(RenderError) as info:
        render_one(tokenizer, manifest)
    assert str(info.value).startswith(f"{manifest}:1: id=c1: {field}: holds the control token")


def test_a_conversation_without_agent_speech_is_refused(tokenizer, tmp_path):
    conv = conversation(tools=[], turns=[spoken("user", 0.0, 1.0, "Hello?")])
    with pytest.raises(RenderError, match="marks no assistant token"):
        render_one(tokenizer, dataset(tmp_path, conv))


def test_split_selects_conversations_and_the_hash_covers_the_dataset(tmp_path):
    full = convert("vakforge", SMOKE, tmp_path / "all", TOKENIZER, progress=False)
    dev = convert("vakforge", SMOKE, tmp_path / "dev", TOKENIZER, progress=False, options={"split": "dev"})
    (example,) = read_shard(tmp_path / "dev" / dev.shard_paths[0])
    assert example.meta["id"] == "conv_en_gb_0003" and example.meta["split"] == "dev"
    assert dev.data["options"]["split"] == "dev" and dev.data["entries"][0]["name"] == "dev"
    assert full.data["manifest_hash"] == dev.data["manifest_hash"] == manifest_hash(SMOKE)
    assert [s["path"] for s in full.data["sources"]] == ["vakforge.jsonl", "splits.json"]
    with pytest.raises(ValueError, match="--split=holdout: .* has the splits dev, test, train"):
        convert("vakforge", SMOKE, tmp_path / "x", TOKENIZER, progress=False, options={"split": "holdout"})


def test_smoke_manifest_meta_and_counts(tmp_path):
    manifest = convert("vakforge", SMOKE, tmp_path / "out", TOKENIZER, progress=False)
    examples = [e for p in manifest.shard_paths for e in read_shard(tmp_path / "out" / p)]
    assert [(e.meta["id"], e.meta["locale"], e.meta["data_source"], e.meta["split"], e.meta["line"])
            for e in examples] == [
        ("conv_en_us_0001", "en-US", "synthetic", "train", 1), ("conv_hi_0002", "hi-Latn-IN", "real", "train", 2),
        ("conv_en_gb_0003", "en-GB", "public", "dev", 3), ("conv_zh_0004", "zh-CN", "synthetic", "test", 4),
        ("conv_en_in_0005", "en-IN", "real", "test", 5)]
    assert manifest.data["counts"]["overlaps"] == {"dropped": 0, "merged": 0, "turns": 2}
    assert manifest.data["counts"]["skipped"] == {}
    assert manifest.data["options"] == {"records_per_shard": 512, "split": None, "overlap": "merge",
                                        "assistant_turns": "all"}
    assert all(e.arrays["target_weights"].dtype == np.float32 for e in examples)


def test_convert_vakforge_is_byte_identical_whatever_the_worker_count(tmp_path):
    data = tmp_path / "smoke"
    shutil.copytree(SMOKE.parent, data)
    one = convert("vakforge", data / "vakforge.jsonl", tmp_path / "one", TOKENIZER, workers=1, progress=False,
                  options={"overlap": "drop"})
    two = convert("vakforge", data / "vakforge.jsonl", tmp_path / "two", TOKENIZER, workers=2, progress=False,
                  options={"overlap": "drop"})
    assert one.data == two.data
    for name in [*one.shard_paths, "manifest.json"]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


@pytest.mark.slow
def test_convert_cli_vakforge(tmp_path):
    def run(out: str, *flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "data_pipeline.convert", "--format=vakforge", f"--input={SMOKE}",
               f"--output={tmp_path / out}", f"--tokenizer={TOKENIZER}", *flags]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)

    result = run("train", "--split=train", "--overlap=drop", "--workers=2")
    assert result.returncode == 0, result.stderr
    assert "2 records" in result.stdout and "skipped 2" in result.stdout
    manifest = Manifest.read(tmp_path / "train")
    assert manifest.data["counts"]["skipped"] == {"overlapping_turns": 2}
    assert manifest.data["counts"]["overlaps"] == {"dropped": 2, "merged": 0, "turns": 2}
    assert manifest.data["manifest_hash"] == manifest_hash(SMOKE)

    result = run("nope", "--split=holdout")
    assert result.returncode == 1 and "--split=holdout:" in result.stderr
    assert not (tmp_path / "nope").exists()
    result = run("bad", "--max-seq-length=10")
    assert result.returncode == 1 and "--max-seq-length: not an option of --format=vakforge" in result.stderr
