"""The VFlash report's text-only baseline (issue 25): the prompt key on hand-made Examples (media-slot runs
collapsed, the text before the last answer), the predictor (same-prompt lookup, the overall fallback, ties
to the first met), unreadable training data; on the suite's tiny VFlash workdir: the report's shapes,
shard and expanded prompts of different image sizes, training prompts found again, moved training data."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import jax
import ml_collections
import numpy as np
import pytest
from PIL import Image

from data_pipeline.shards import Example
from data_pipeline.tokenizer import end_of_turn_id
from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT
from valen_jax import evaluate
from valen_jax.data.shard_cache import ensure_shards
from valen_jax.evaluation import registry, text_only, tokens, vflash
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.evaluation.prompts import prompt_of
from valen_jax.evaluation.text_only import (
    TextOnlyPredictor,
    TrainingDataUnavailable,
    collapse_media,
    prompt_key,
)
from valen_jax.run import restore_model
from valen_jax.training import checkpoint

VFLASH = ROOT / "data/smoke/vflash"
PAD, VIDEO, EOT = 900, 901, 2
SLOTS = (PAD, VIDEO)
BASELINE_KEYS = {"metric", "value", "same_prompt", "records", "training_records"}


def _example(prompt: list[int], *answers: list[int], references: list[str] | None = ("x",), line: int = 1
             ) -> Example:
    """A shard Example: untrained `prompt` ids, then each of `answers` (ending with EOT) trained."""
    ids, weights = list(prompt), [0.0] * len(prompt)
    for answer in answers:
        ids += answer
        weights += [1.0] * len(answer)
    meta = {"source": "train.jsonl", "line": line, **({"answers": list(references)} if references is not None else {})}
    return Example(arrays={"input_ids": np.asarray(ids, np.int32),
                                     "target_weights": np.asarray(weights, np.float32)}, meta=meta)


def test_runs_of_media_slots_collapse_to_one_token():
    ids = np.asarray([1, PAD, PAD, PAD, 2, PAD, 3, VIDEO, VIDEO, PAD, 4, PAD], np.int32)
    assert collapse_media(ids, SLOTS).tolist() == [1, PAD, 2, PAD, 3, VIDEO, 4, PAD]
    assert collapse_media(np.asarray([5, 6], np.int32), SLOTS).tolist() == [5, 6]
    assert collapse_media(np.zeros(0, np.int32), SLOTS).tolist() == []


def test_the_prompt_is_the_text_before_the_last_answer_whatever_the_image_size():
    small = _example([1, 2, PAD, 3], [7, 8, EOT])
    large = _example([1, 2, PAD, PAD, PAD, PAD, 3], [9, EOT])  # a bigger image, another answer
    other_text = _example([1, 2, PAD, 4], [7, 8, EOT])
    no_image = _example([1, 2, 3], [7, 8, EOT])
    # Two answers: the prompt of the last one holds the first one too.
    second_turn = _example([1, 2, PAD, 3], [7, 8, EOT], [5, 6, EOT])
    key = prompt_key(small, SLOTS, EOT)
    assert key == prompt_key(large, SLOTS, EOT)
    assert len({key, prompt_key(other_text, SLOTS, EOT), prompt_key(no_image, SLOTS, EOT),
                prompt_key(second_turn, SLOTS, EOT)}) == 4
    assert prompt_key(_example([1, 2, PAD, 3]), SLOTS, EOT) is None  # no trained answer


def test_a_prompt_gets_its_training_records_most_common_answer_ties_to_the_first_met():
    pairs = [(b"k1", "a"), (b"k1", "b"), (b"k1", "b"), (b"k2", "d"), (b"k2", "c"), (b"k3", "a")]
    predictor = TextOnlyPredictor.fit(pairs)
    # k2: "d" and "c" once each, "d" met first; overall "a" and "b" twice each, "a" met first.
    assert predictor.by_prompt == {b"k1": "b", b"k2": "d", b"k3": "a"}
    assert (predictor.overall, predictor.records) == ("a", 6)
    assert predictor.answer(b"k1") == ("b", True)
    assert predictor.answer(b"unseen") == ("a", False)  # no training record with this prompt: the overall answer
    # The order of the data decides a tie, nothing else: reversed, the other answers win.
    reversed_fit = TextOnlyPredictor.fit(pairs[::-1])
    assert (reversed_fit.by_prompt[b"k2"], reversed_fit.overall) == ("c", "a")
    assert TextOnlyPredictor.fit([(b"k", "b"), (b"j", "a")]).overall == "b"


def test_training_records_the_baseline_cannot_read_make_it_unavailable():
    with pytest.raises(TrainingDataUnavailable, match="no training records"):
        TextOnlyPredictor.fit([])
    good = _example([1, PAD], [7, EOT], references=["<point><1><2></point>"])
    pairs = list(text_only.training_pairs([good, _example([1, PAD, PAD], [8, EOT], references=["b"])], SLOTS, EOT))
    assert pairs == [(prompt_key(good, SLOTS, EOT), "<point><1><2></point>"), (prompt_key(good, SLOTS, EOT), "b")]
    with pytest.raises(TrainingDataUnavailable, match=r"train.jsonl:4: training shards without reference answers"):
        list(text_only.training_pairs([good, _example([1], [7, EOT], references=None, line=4)], SLOTS, EOT))
    with pytest.raises(TrainingDataUnavailable, match=r"train.jsonl:5: a training record without a trained answer"):
        list(text_only.training_pairs([_example([1, 7, EOT], line=5)], SLOTS, EOT))


def test_the_summary_names_the_baseline_or_its_absence():
    base = {"loss": 1.0, "accuracy": 0.5, "generation": {"primitive_parse_rate": 0.25}}
    part = {"metric": "point_accuracy", "value": 0.5, "same_prompt": 3, "records": 16, "training_records": 96}
    assert vflash.summary({**base, "text_only_baseline": part}) == (
        "loss 1.0000, accuracy 0.5000, primitive parse rate 0.250, text-only baseline point_accuracy 0.5000 "
        "(3 of 16 by a training prompt)")
    gone = {"metric": "point_accuracy", "value": None, "unavailable": "the training data /x is not there"}
    assert vflash.summary({**base, "text_only_baseline": gone}).endswith(", text-only baseline unavailable")


# --- the suite's tiny VFlash workdir (slow-marked like every test on one) --------------------------


@pytest.fixture(scope="module")
def vflash_restored(tmp_path_factory):
    return restore_model(smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny"))


def _training_shards(restored):
    """The workdir's training shards, opened as training opened them."""
    data = restored.config.data
    return ensure_shards(data.format, data.train, restored.workdir / "shards", checkpoint.tokenizer_dir(restored.workdir),
                         restored.fingerprint, data.train_options.to_dict())


@pytest.mark.slow
def test_vflash_report_holds_the_text_only_baseline_and_image_reliance(vflash_restored):
    with jax.set_mesh(vflash_restored.mesh):
        report = evaluate.run(vflash_restored, VFLASH / "eval.jsonl", "vflash", {}, max_new_tokens=4)
    part = report["text_only_baseline"]
    assert set(part) == BASELINE_KEYS
    assert isinstance(part["metric"], str) and isinstance(part["value"], float) and 0.0 <= part["value"] <= 1.0
    assert all(isinstance(part[k], int) for k in ("same_prompt", "records", "training_records"))
    assert part["records"] == report["examples"] == 16 and 0 <= part["same_prompt"] <= 16
    # The smoke recipe's training records, all read (fewer than TRAINING_RECORDS), in WORKDIR/shards.
    assert part["training_records"] == len(_training_shards(vflash_restored)) < text_only.TRAINING_RECORDS
    # One headline chain: the baseline is scored as the real and the swapped answers are.
    reliance = report["image_reliance"]
    assert part["metric"] == reliance["metric"] == "point_accuracy"
    assert reliance["baseline"] == part["value"]  # what the verdict compares with (issue 55)
    assert {"differing", "reliance"} <= set(reliance) and isinstance(reliance["differing"], int)
    assert "text-only baseline point_accuracy" in evaluate.summary(report)


@pytest.mark.slow
def test_every_training_prompt_is_found_again(vflash_restored):
    # Training records evaluated as data: each has a training record with its prompt (itself), read through
    # the shards and answered through the same key.
    source = _training_shards(vflash_restored).source()
    training = [Example.from_bytes(source[i]) for i in range(12)]
    overall = vflash.answer_stats(vflash_restored.tokenizer, training, ["" for _ in training]).report()["overall"]
    part = vflash.text_only_baseline(vflash_restored, training, overall)
    assert (part["same_prompt"], part["records"]) == (12, 12)


@pytest.mark.slow
def test_a_larger_image_is_the_same_prompt_in_shards_and_expanded(vflash_restored, tmp_path):
    (tmp_path / "images").mkdir()
    shutil.copy(VFLASH / "images/eval_0001.png", tmp_path / "images/square.png")
    Image.new("RGB", (256, 192), (20, 200, 20)).save(tmp_path / "images/large.png")
    human = "<image>\nShow me the centre of the red box as a point."
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"image": f"images/{name}", "conversations": [
        {"from": "human", "value": human}, {"from": "gpt", "value": answer}]}) + "\n"
        for name, answer in (("square.png", "<point><1><2></point>"), ("large.png", "<point><3><4></point>"))))
    restored = vflash_restored
    examples, _, _ = eval_workdir.load_examples(
        "vflash", data, tmp_path, checkpoint.tokenizer_dir(restored.workdir), restored.fingerprint, {})
    slots, eot = tokens.media_slot_ids(restored.spec), end_of_turn_id(restored.tokenizer)
    assert prompt_key(examples[0], slots, eot) == prompt_key(examples[1], slots, eot)
    expanded = [prompt_of(e, restored.spec, eot)["ids"] for e in examples]
    assert len(expanded[0]) != len(expanded[1])  # more vision tokens for the larger image
    assert np.array_equal(collapse_media(expanded[0], slots), collapse_media(expanded[1], slots))


@pytest.mark.slow
def test_moved_training_data_is_reported_unavailable_not_a_crash(vflash_restored, tmp_path, caplog):
    config = ml_collections.ConfigDict(vflash_restored.config.to_dict())
    moved = tmp_path / "moved/recipe.json"
    config.data.train = str(moved)
    restored = dataclasses.replace(vflash_restored, config=config)
    with jax.set_mesh(restored.mesh):
        examples, _, _ = eval_workdir.load_examples(
            "vflash", VFLASH / "eval.jsonl", restored.workdir, checkpoint.tokenizer_dir(restored.workdir),
            restored.fingerprint, {}, 4)
        with caplog.at_level(logging.WARNING, logger="valen_jax.evaluation.vflash"):
            report = vflash.evaluate(restored, examples, registry.Options(batch_size=4, max_new_tokens=1,
                                                                          image_reliance=False))
    part = report["text_only_baseline"]
    assert part == {"metric": "point_accuracy", "value": None,
                    "unavailable": f"the training data {moved} (config.data.train) is not there: moved or deleted "
                                   "since training"}
    assert [r.getMessage() for r in caplog.records] == [f"text-only baseline unavailable: {part['unavailable']}"]
    assert vflash.summary(report).endswith(", text-only baseline unavailable")
