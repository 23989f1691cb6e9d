"""Image reliance (issue 25): the swap rule on hand-made prompts, the counts across processes, the
warning line, and reports of tiny trained workdirs (VFlash, chat, Valen) through the real readers,
processor, model and decoder; a checkpoint whose vision merger outputs zeros is the blind model."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from tests.smoke_workdirs import smoke_workdir
from tests.test_evaluate_units import FakeHosts
from tests.train_runs import ROOT
from valen_jax import evaluate
from valen_jax.evaluation import chat, image_reliance, registry, valen, vflash
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.evaluation.image_reliance import SwapPlan, layout_of, plan_swaps, swap_prompts
from valen_jax.run import ModelRun, restore_model
from valen_jax.training import checkpoint

VFLASH = ROOT / "data/smoke/vflash"
KEYS = {"compared", "unswappable", "changed_fraction", "differing", "reliance", "metric", "with_images",
        "swapped_images", "drop", "lower_is_better", "baseline", "margin", "verdict"}
NEW_TOKENS = 4


def _vision(grid: int, image: int, media: bool = True, patches: int = 4) -> dict:
    """Vision arrays as `assemble.vision_arrays` lays them out: `grid` picks the patch positions,
    `image` the patch values; without `media`, every segment is 0 (padding)."""
    positions = np.zeros((patches, 3), np.int32)
    positions[:, 1 + grid % 2] = np.arange(patches)  # one row of patches, or one column
    return {"patches": np.full((patches, 6), float(image), np.float32),
            "patch_positions": positions if media else np.zeros_like(positions),
            "patch_segments": np.full(patches, 1 if media else 0, np.int32)}


def _plan(visions: list[dict]) -> SwapPlan:
    return plan_swaps([layout_of(v) for v in visions])


def test_prompts_of_one_layout_take_the_next_ones_patches_cyclically():
    # Layout 0 at prompts 0, 2, 3; layout 1 at 1, 4; every image different.
    plan = _plan([_vision(0, 10), _vision(1, 11), _vision(0, 12), _vision(0, 13), _vision(1, 14)])
    assert plan.donors == {0: 2, 1: 4, 2: 3, 3: 0, 4: 1}
    assert plan.unswappable == ()


def test_a_prompt_alone_in_its_layout_or_given_its_own_image_is_unswappable():
    # Layout 0: the same image at 0 and 1 (each would get its own image back); layout 1: prompt 2
    # alone; layout 2 (segments of two media items): 3 and 4 one image, 5 another.
    two_items = {**_vision(0, 7), "patch_segments": np.asarray([1, 1, 2, 2], np.int32)}
    other = {**two_items, "patches": np.full((4, 6), 8.0, np.float32)}
    plan = _plan([_vision(0, 5), _vision(0, 5), _vision(1, 6), two_items, dict(two_items), other])
    assert plan.unswappable == (0, 1, 2, 3)
    assert plan.donors == {4: 5, 5: 3}


def test_prompts_without_media_are_neither_compared_nor_counted():
    empty = {"patches": np.zeros((0, 6), np.float32), "patch_positions": np.zeros((0, 3), np.int32),
             "patch_segments": np.zeros(0, np.int32)}  # a model without a vision tower: no patch at all
    plan = _plan([_vision(0, 1, media=False), _vision(0, 2), empty, _vision(0, 2, media=False), _vision(0, 3)])
    assert plan.donors == {1: 4, 4: 1} and plan.unswappable == ()
    assert layout_of(empty).key is None and layout_of(_vision(0, 1, media=False)).key is None


def test_the_layout_is_the_positions_and_segments_not_the_patches():
    row, column = _vision(0, 1), _vision(1, 1)
    assert layout_of(row).key != layout_of(column).key and layout_of(row).patches == layout_of(column).patches
    assert layout_of(_vision(0, 1)).key == layout_of(_vision(0, 2)).key
    with_segments = {**row, "patch_segments": np.asarray([1, 1, 2, 2], np.int32)}
    assert layout_of(with_segments).key != layout_of(row).key


def test_a_swapped_prompt_keeps_its_text_and_takes_only_the_donors_patches():
    prompts = [{"ids": np.arange(5) + k, "positions": np.arange(15).reshape(5, 3) + k, "vision": _vision(0, k)}
               for k in range(3)]
    swapped = swap_prompts(prompts, _plan([p["vision"] for p in prompts]))
    assert len(swapped) == 3
    for k, prompt in enumerate(swapped):
        donor = prompts[(k + 1) % 3]["vision"]
        assert prompt["ids"] is prompts[k]["ids"] and prompt["positions"] is prompts[k]["positions"]
        assert prompt["vision"]["patches"] is donor["patches"]
        for key in ("patch_positions", "patch_segments"):
            assert prompt["vision"][key] is prompts[k]["vision"][key]
    assert prompts[0]["vision"]["patches"][0, 0] == 0.0  # the originals are untouched


def test_counts_add_across_processes_and_the_drop_says_whether_the_images_helped():
    hosts = FakeHosts(2)
    local = [dict(changed=1, compared=3, unswappable=1, differing=2, differing_changed=1),
             dict(changed=2, compared=5, unswappable=0, differing=2, differing_changed=2)]
    parts = hosts.run(lambda i: image_reliance.reliance(**local[i], metric="point_accuracy", with_images=0.75,
                                                        swapped_images=0.25, gather=hosts.gather))
    assert parts[0] == parts[1] == {"compared": 8, "unswappable": 1, "changed_fraction": 3 / 8,
                                    "differing": 4, "reliance": 3 / 4,
                                    "metric": "point_accuracy", "with_images": 0.75, "swapped_images": 0.25,
                                    "drop": 0.5, "lower_is_better": False, "baseline": None,
                                    "margin": pytest.approx(2 * np.sqrt(2 * 0.75 * 0.25 / 4) * 4 / 8),
                                    "verdict": "looks"}
    ade = image_reliance.reliance(changed=2, compared=2, unswappable=0, differing=0, differing_changed=0,
                                  metric="trajectory_ade", with_images=0.1, swapped_images=0.4, lower_is_better=True)
    assert ade["drop"] == pytest.approx(0.3)  # lower is better: swapped − with images
    assert (ade["differing"], ade["reliance"]) == (0, None)  # no reference differs: nothing to rely on
    none = image_reliance.reliance(changed=0, compared=0, unswappable=4, differing=0, differing_changed=0,
                                   metric="point_accuracy", with_images=None, swapped_images=None)
    assert none == {"compared": 0, "unswappable": 4, "changed_fraction": None, "differing": 0, "reliance": None,
                    "metric": "point_accuracy", "with_images": None, "swapped_images": None, "drop": None,
                    "lower_is_better": False, "baseline": None, "margin": None, "verdict": None}


def _part(changed: int, compared: int, differing_changed: int = 0, differing: int = 0) -> dict:
    return {"compared": compared, "unswappable": 0, "changed_fraction": changed / compared if compared else None,
            "differing": differing, "reliance": differing_changed / differing if differing else None,
            "metric": "point_accuracy", "with_images": 0.6, "swapped_images": 0.6, "drop": 0.0,
            "lower_is_better": False, "baseline": None}


# The two-class task of issue 25: every answer is one of two points, so a record and the next one (its
# donor) have different right answers for some pairs only.
LEFT, RIGHT = "<point><250><500></point>", "<point><750><500></point>"


def _two_class(count: int) -> tuple[list[str], list[str]]:
    """(references, donor references) of `count` records in one layout, each swapped with the next (cyclic)."""
    references = [LEFT if k % 4 < 2 else RIGHT for k in range(count)]  # L L R R L L R R ...: half the pairs differ
    return references, references[1:] + references[:1]


def test_a_model_that_looks_relies_fully_where_a_blind_one_does_not():
    references, donors = _two_class(8)
    perfect_real, perfect_swapped = references, donors  # answers what each image shows
    differing, changed = image_reliance.differing_changes(references, donors, perfect_real, perfect_swapped)
    part = image_reliance.reliance(changed=sum(a != b for a, b in zip(perfect_real, perfect_swapped, strict=True)),
                                   compared=8, unswappable=0, differing=differing, differing_changed=changed,
                                   metric="point_accuracy", with_images=1.0, swapped_images=0.5)
    # Only half the swaps change the right answer: the changed fraction cannot pass 0.5, the reliance is 1.
    assert (part["differing"], part["changed_fraction"], part["reliance"]) == (4, 0.5, 1.0)
    blind = [LEFT] * 8  # the majority (here: first) class whatever the image
    differing, changed = image_reliance.differing_changes(references, donors, blind, blind)
    assert (differing, changed) == (4, 0)
    part = image_reliance.reliance(changed=0, compared=8, unswappable=0, differing=differing, differing_changed=changed,
                                   metric="point_accuracy", with_images=0.5, swapped_images=0.5)
    assert (part["changed_fraction"], part["reliance"]) == (0.0, 0.0)


def test_only_known_unequal_references_differ():
    # None: a reference the record or its donor lacks (older shards, no message or question at that index,
    # a soft label); equal references are not differing however the answers move.
    assert image_reliance.differing_changes(["a", "a", None, "a", ["call"]], ["a", "b", "b", None, ["other"]],
                                            ["x", "x", "x", "x", "x"], ["y", "x", "y", "y", "y"]) == (2, 1)
    assert image_reliance.differing_changes([], [], [], []) == (0, 0)


def test_the_warning_is_one_line_below_the_floor_only(caplog):
    with caplog.at_level(logging.WARNING, logger="valen_jax.evaluation.image_reliance"):
        image_reliance.warn_if_blind({"image_reliance": _part(0, 100)})
    assert [r.getMessage() for r in caplog.records] == [
        "image reliance: 0 of 100 answers change when each record's images are swapped for another record's "
        "(point_accuracy 0.6000 → 0.6000): the model answers from the text, not the image"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="valen_jax.evaluation.image_reliance"):
        for report in ({"image_reliance": _part(5, 100)}, {"image_reliance": _part(0, 0)}, {}):
            image_reliance.warn_if_blind(report)  # 0.05 is the floor itself; nothing compared; no images
    assert caplog.records == []
    assert image_reliance.answers_from_text(_part(4, 100)) and not image_reliance.answers_from_text(_part(5, 100))


def test_the_warning_fires_too_when_the_differing_answers_do_not_change(caplog):
    # 30 of 100 answers move, but only 1 of the 40 whose reference flips with the image: answers that shift
    # where the right answer stays pass the changed-fraction floor, the reliance floor catches them.
    with caplog.at_level(logging.WARNING, logger="valen_jax.evaluation.image_reliance"):
        image_reliance.warn_if_blind({"image_reliance": _part(30, 100, differing_changed=1, differing=40)})
    assert [r.getMessage() for r in caplog.records] == [
        "image reliance: 1 of the 40 answers whose reference differs with another record's images change when "
        "they are swapped in (point_accuracy 0.6000 → 0.6000): the model answers from the text, not the image"]
    # Below the floor but under 20 differing answers (too few to tell from chance), at the floor, a report
    # written before `reliance` was recorded: no warning.
    older = {key: value for key, value in _part(30, 100).items() if key not in ("differing", "reliance")}
    for part in (_part(30, 100, 0, 19), _part(30, 100, 2, 40), older):
        assert not image_reliance.answers_from_text(part)
    assert image_reliance.answers_from_text(_part(30, 100, 0, 20))
    # Both fire: one line, the changed-fraction one.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="valen_jax.evaluation.image_reliance"):
        image_reliance.warn_if_blind({"image_reliance": _part(0, 100, 0, 40)})
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith("image reliance: 0 of 100 answers")


def test_summary_lines_carry_the_figures_when_present():
    base = {"loss": 1.0, "accuracy": 0.5, "generation": {"primitive_parse_rate": 0.25}}
    assert vflash.summary(base) == "loss 1.0000, accuracy 0.5000, primitive parse rate 0.250"
    assert vflash.summary({**base, "image_reliance": _part(3, 16)}).endswith(
        ", image reliance: 3 of 16 answers change with swapped images (point_accuracy 0.6000 → 0.6000); "
        "verdict: looks")  # no reference differs: the drop cannot tell
    assert vflash.summary({**base, "image_reliance": _part(8, 16, 8, 8)}).endswith(
        ", image reliance: 8 of 16 answers change with swapped images, 8 of 8 whose reference differs "
        "(reliance 1.0000) (point_accuracy 0.6000 → 0.6000); verdict: looks")  # too few differ to judge the drop
    line = chat.summary({"loss": 1.5, "accuracy": None, "tool_call_exact_match": 0.25,
                         "image_reliance": {**_part(0, 0), "unswappable": 2}})
    assert line == "loss 1.5000, accuracy n/a, tool-call exact match 0.2500, image reliance: no answer compared (2 unswappable)"


# --- tiny trained workdirs (slow-marked like every test on one; each call takes a few seconds) ------


@pytest.fixture(scope="module")
def vflash_restored(tmp_path_factory):
    return restore_model(smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny"))


def blind(restored: ModelRun) -> ModelRun:
    """The same model with its vision merger's output projection zeroed: every image becomes the same
    all-zero vision tokens, so no answer can depend on which image a record holds."""
    def zero(path, x):
        return jnp.zeros_like(x) if "merge_out" in jax.tree_util.keystr(path) else x

    assert any("merge_out" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(restored.params))
    return dataclasses.replace(restored, params=jax.tree_util.tree_map_with_path(zero, restored.params))


def _check_shape(part: dict) -> None:
    assert set(part) == KEYS
    assert isinstance(part["compared"], int) and isinstance(part["unswappable"], int)
    assert isinstance(part["metric"], str)
    assert isinstance(part["differing"], int) and 0 <= part["differing"] <= part["compared"]
    assert (part["reliance"] is None) == (part["differing"] == 0)
    if part["differing"]:
        assert 0.0 <= part["reliance"] <= 1.0
    if part["compared"]:
        assert 0.0 <= part["changed_fraction"] <= 1.0
        if part["with_images"] is not None and part["swapped_images"] is not None:
            sign = -1.0 if part["lower_is_better"] else 1.0
            assert part["lower_is_better"] == (part["metric"] == "trajectory_ade")
            assert part["drop"] == pytest.approx(sign * (part["with_images"] - part["swapped_images"]))
        assert part["verdict"] == image_reliance.verdict(part)


@pytest.mark.slow
def test_vflash_report_compares_every_smoke_record_and_warns_for_a_blind_model(vflash_restored, caplog):
    with jax.set_mesh(vflash_restored.mesh), caplog.at_level(logging.WARNING):
        report = evaluate.run(vflash_restored, VFLASH / "eval.jsonl", "vflash", {}, max_new_tokens=NEW_TOKENS)
        caplog.clear()
        blind_report = evaluate.run(blind(vflash_restored), VFLASH / "eval.jsonl", "vflash", {},
                                    max_new_tokens=NEW_TOKENS)
    part = report["image_reliance"]
    _check_shape(part)
    # The 16 smoke eval records: one 128×128 image each, all different, so one layout and all compared.
    assert report["examples"] == 16 and (part["compared"], part["unswappable"]) == (16, 0)
    assert part["metric"] == "point_accuracy"  # the smoke set holds point questions
    assert part["differing"] == 16  # every smoke eval reference differs from the next record's
    assert part["with_images"] == report["metrics"]["overall"]["point"]["accuracy"]  # all compared: the same
    assert "image reliance: " in evaluate.summary(report)

    dark = blind_report["image_reliance"]
    _check_shape(dark)
    assert (dark["compared"], dark["changed_fraction"], dark["drop"]) == (16, 0.0, 0.0)
    assert (dark["differing"], dark["reliance"]) == (16, 0.0)
    assert dark["with_images"] == dark["swapped_images"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("image reliance:")]
    assert lines == ["image reliance: 0 of 16 answers change when each record's images are swapped for another "
                     f"record's (point_accuracy {dark['with_images']:.4f} → {dark['swapped_images']:.4f}): "
                     "the model answers from the text, not the image"]


@functools.cache
def _forward(graphdef):
    def forward(params, ids, positions, vision):
        return nnx.merge(graphdef, params)(ids, positions, jnp.ones_like(ids), vision)

    return jax.jit(forward)


def _logits(restored, prompt: dict) -> np.ndarray:
    """The model's logits over one prompt (a batch of one row, no padding)."""
    vision = tuple(jnp.asarray(prompt["vision"][k])[None] for k in ("patches", "patch_positions", "patch_segments"))
    return np.asarray(_forward(restored.graphdef)(restored.params, jnp.asarray(prompt["ids"])[None],
                                                  jnp.asarray(prompt["positions"])[None], vision))


@pytest.mark.slow
def test_the_swapped_patches_reach_the_model_and_the_blind_one_ignores_them(vflash_restored):
    # What makes a zero change fraction mean "blind": the trained model's logits move with the donor's
    # patches, the blind model's are bit-identical.
    with jax.set_mesh(vflash_restored.mesh):
        examples, _, _ = eval_workdir.load_examples(
            "vflash", VFLASH / "eval.jsonl", vflash_restored.workdir,
            checkpoint.tokenizer_dir(vflash_restored.workdir), vflash_restored.fingerprint, {}, 2)
        prompts = vflash.last_answer_prompts(vflash_restored, examples)
        swapped = swap_prompts(prompts, _plan([p["vision"] for p in prompts]))
        dark = blind(vflash_restored)
        assert np.abs(_logits(vflash_restored, prompts[0]) - _logits(vflash_restored, swapped[0])).max() > 1e-4
        assert np.array_equal(_logits(dark, prompts[0]), _logits(dark, swapped[0]))


def _vflash_record(image: str, answer: str = "<point><500><500></point>") -> dict:
    human = "Show me the centre of the red box as a point."
    return {"image": image, "conversations": [{"from": "human", "value": f"<image>\n{human}"},
                                              {"from": "gpt", "value": answer}]}


@pytest.mark.slow
def test_vflash_unswappable_and_text_only_records_through_the_reader(vflash_restored, tmp_path):
    (tmp_path / "images").mkdir()
    for name in ("eval_0001.png", "eval_0002.png", "eval_0003.png"):
        shutil.copy(VFLASH / "images" / name, tmp_path / "images" / name)
    Image.new("RGB", (128, 64), (20, 200, 20)).save(tmp_path / "images/wide.png")  # a grid of its own
    records = [_vflash_record("images/eval_0001.png"), _vflash_record("images/eval_0001.png"),  # one image twice
               _vflash_record("images/eval_0002.png"), _vflash_record("images/eval_0003.png"),
               _vflash_record("images/wide.png"),
               {"conversations": [{"from": "human", "value": "Say a point."},
                                  {"from": "gpt", "value": "<point><10><20></point>"}]}]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    with jax.set_mesh(vflash_restored.mesh):
        examples, _, _ = eval_workdir.load_examples(
            "vflash", data, tmp_path, checkpoint.tokenizer_dir(vflash_restored.workdir), vflash_restored.fingerprint, {})
        part = vflash.evaluate(vflash_restored, examples, registry.Options(batch_size=4, max_new_tokens=2))["image_reliance"]
    _check_shape(part)
    # One layout for 0-3 (the square images): 0 ← 1 would be its own image again; 1 ← 2, 2 ← 3, 3 ← 0
    # compared; 4 is alone in its layout; 5 has no image.
    assert (part["compared"], part["unswappable"]) == (3, 2)


@pytest.mark.slow
def test_text_only_data_has_no_image_reliance(vflash_restored, tmp_path):
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"Say point {k}."},
                                                          {"from": "gpt", "value": "<point><10><20></point>"}]})
                            + "\n" for k in range(3)))
    with jax.set_mesh(vflash_restored.mesh):
        examples, _, _ = eval_workdir.load_examples(
            "vflash", data, tmp_path, checkpoint.tokenizer_dir(vflash_restored.workdir), vflash_restored.fingerprint, {})
        report = vflash.evaluate(vflash_restored, examples, registry.Options(batch_size=4, max_new_tokens=2))
    assert "image_reliance" not in report and "image reliance" not in vflash.summary(report)


def _chat_row(image: str, *, before: bool = False) -> dict:
    """One question about `image`; with `before`, a text exchange comes first (its answer sees no image)."""
    opening = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}] if before else []
    return {"messages": [*opening, {"role": "user", "content": [{"type": "text", "text": "What color is the shape?"},
                                                                {"type": "image", "path": f"images/{image}"}]},
                         {"role": "assistant", "content": "A red circle."}]}


@pytest.fixture(scope="module")
def chat_restored(tmp_path_factory):
    return restore_model(smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4"))


@pytest.mark.slow
def test_chat_messages_that_see_an_image_are_compared(chat_restored, tmp_path):
    restored = chat_restored
    shutil.copytree(ROOT / "data/smoke/chat/images", tmp_path / "images")
    # Three different 64×64 images (the smoke set repeats some: shape_1011 is shape_1003's bytes), the
    # first again after a text exchange, and a text-only row.
    rows = [_chat_row("shape_1003.png"), _chat_row("shape_1007.png"), _chat_row("shape_019.png"),
            _chat_row("shape_1003.png", before=True),
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with jax.set_mesh(restored.mesh):
        examples, _, _ = eval_workdir.load_examples(
            "chat", data, tmp_path, checkpoint.tokenizer_dir(restored.workdir), restored.fingerprint,
            {"assistant_turns": "all"})
        report = chat.evaluate(restored, examples, registry.Options(batch_size=4, max_new_tokens=3))
    part = report["image_reliance"]
    _check_shape(part)
    # One layout, rotated 0 ← 1 ← 2 ← 3 ← 0: row 3's donor holds its own image, so its answer after the
    # image is unswappable; its "Hi." comes before any image and row 4 has none: neither is counted.
    assert (part["compared"], part["unswappable"]) == (3, 1)
    assert part["metric"] == "answer_exact_match"
    # One reference, "A red circle.", for every message that sees an image: row 2's donor (row 3) opens with
    # "Hi.", but messages pair by their place among those that see an image, not by message index.
    assert (part["differing"], part["reliance"]) == (0, None)
    assert "image reliance: " in chat.summary(report)


def _valen_record(k: int, image: str) -> dict:
    record = json.loads((ROOT / "data/smoke/valen/train.jsonl").read_text().splitlines()[2])  # the image record
    record["group_id"] = f"reliance-{k}"
    record["meta"]["record_id"] = f"reliance-{k:03d}"
    record["request"]["state"]["messages"][0]["content"][1]["image_url"]["url"] = image
    record.pop("assets")
    return record


@pytest.fixture(scope="module")
def valen_restored(tmp_path_factory):
    return restore_model(smoke_workdir(tmp_path_factory, "configs/valen.py:tiny"))


@pytest.mark.slow
def test_valen_questions_are_scored_again_with_swapped_images(valen_restored, tmp_path):
    restored = valen_restored
    (tmp_path / "assets").mkdir()
    for k, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
        Image.new("RGB", (128, 128), colour).save(tmp_path / f"assets/{k}.png")
    text = json.loads((ROOT / "data/smoke/valen/train.jsonl").read_text().splitlines()[0])
    records = [_valen_record(0, "assets/0.png"), _valen_record(1, "assets/1.png"), _valen_record(2, "assets/2.png"),
               _valen_record(3, "assets/0.png"), text]
    records[1]["targets"]["ball_color"]["probabilities"] = {"red": 1.0, "green": 0.0, "blue": 0.0}  # others: green
    data = tmp_path / "valen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    with jax.set_mesh(restored.mesh):
        examples, _, _ = eval_workdir.load_examples(
            "valen", data, tmp_path, checkpoint.tokenizer_dir(restored.workdir), restored.fingerprint, {})
        report = valen.evaluate(restored, examples, registry.Options(batch_size=4, max_new_tokens=0))
    part = report["image_reliance"]
    _check_shape(part)
    # Three questions a record: records 0, 1, 2 compared (2 takes record 3's image, 0.png, not its own);
    # record 3 would get 0.png back; the text record has no image.
    assert (part["compared"], part["unswappable"], part["metric"]) == (9, 3, "accuracy")
    # The gold ball colour differs for 0 ← 1 (green, red) and 1 ← 2 (red, green) only; the other questions'
    # labels are the same in every record.
    assert part["differing"] == 2
    assert part["with_images"] is not None and part["swapped_images"] is not None
    assert "image reliance: " in valen.summary(report)
