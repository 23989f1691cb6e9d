"""Issue 55: the image-reliance verdict names a model whose answers move with the image without improving.

A high changed fraction says the picture moves the answer, not that it moves it towards what the question
asks for: issue 55's target answered most test images with one wrong point, with reliance 0.78, an
accuracy drop of 0.0 and point accuracy 0.03, the text-only baseline, and no warning fired. The verdict
(`image_reliance.verdict`) is checked here on report figures; the last test trains such a
model and evaluates it where it is right and where it is not.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from tests.test_vision_learning import make_vision_tasks
from tests.train_runs import run_module, run_train
from valen_jax.evaluation import image_reliance, vflash

LOGGER = "valen_jax.evaluation.image_reliance"


def _part(with_images: float | None, swapped_images: float | None, baseline: float | None = None, *,
          changed: int = 78, compared: int = 100, differing: int = 100, differing_changed: int = 78,
          metric: str = "point_accuracy", lower_is_better: bool = False) -> dict:
    """A report's `image_reliance` as the evaluators build it (one process)."""
    return image_reliance.reliance(changed=changed, compared=compared, unswappable=0, differing=differing,
                                   differing_changed=differing_changed, metric=metric, with_images=with_images,
                                   swapped_images=swapped_images, lower_is_better=lower_is_better,
                                   baseline=baseline)


def _warnings(part: dict, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        image_reliance.warn_if_blind({"image_reliance": part})
    return [r.getMessage() for r in caplog.records]


def test_issue_55s_figures_are_named_as_blindness(caplog):
    part = _part(0.03, 0.03, baseline=0.03)
    assert part["verdict"] == "moves_without_improving"
    assert part["margin"] == image_reliance.MIN_GAIN  # two standard errors at p = 0.03 over 100: 0.048
    assert _warnings(part, caplog) == [
        "image reliance: 78 of 100 answers change when each record's images are swapped for another record's, "
        "but they are no better than with another record's image (point_accuracy 0.0300 → 0.0300, drop 0.0000 "
        "under the margin 0.0500) nor than the text-only baseline (0.0300): the model does not see what the "
        "question asks for"]
    base = {"loss": 1.0, "accuracy": 0.5, "generation": {"primitive_parse_rate": 0.25}}
    assert vflash.summary({**base, "image_reliance": part}).endswith(
        "(point_accuracy 0.0300 → 0.0300); verdict: moves_without_improving")


def test_a_learned_model_looks_and_gets_no_warning(caplog):
    part = _part(0.95, 0.05, baseline=0.03, changed=95, differing_changed=95)
    assert part["verdict"] == "looks" and _warnings(part, caplog) == []
    # Answers barely better with their own image, but far above what the text alone gives: the image is what
    # they come from (the swap left most right answers as they were), so the baseline clears them.
    assert _part(0.60, 0.58, baseline=0.10)["verdict"] == "looks"


def test_without_enough_differing_answers_the_drop_decides_nothing():
    # Another record's image gives every record the same right answer: a model that looks loses nothing by
    # the swap, so a zero drop says nothing about it.
    assert _part(0.6, 0.6, baseline=0.6, differing=0, differing_changed=0)["verdict"] == "looks"
    assert _part(0.6, 0.6, baseline=0.6, differing=19, differing_changed=15)["verdict"] == "looks"
    assert _part(0.6, 0.6, baseline=0.6, differing=20, differing_changed=15)["verdict"] == "moves_without_improving"


def test_the_text_verdicts_come_first_and_keep_their_lines(caplog):
    part = _part(0.03, 0.03, baseline=0.03, changed=0, differing_changed=0)
    assert part["verdict"] == "answers_from_text"
    assert [line.endswith("the model answers from the text, not the image") for line in _warnings(part, caplog)] == [True]


def test_without_a_baseline_the_drop_alone_decides(caplog):
    part = _part(0.6, 0.6)  # chat, Valen: no text-only baseline
    assert part["verdict"] == "moves_without_improving"
    assert _warnings({key: value for key, value in part.items() if key not in ("margin", "verdict")}, caplog) == [
        "image reliance: 78 of 100 answers change when each record's images are swapped for another record's, "
        "but they are no better than with another record's image (point_accuracy 0.6000 → 0.6000, drop 0.0000 "
        "under the margin 0.1386) (no text-only baseline to compare with): the model does not see what the "
        "question asks for"]  # margin and verdict computed from the figures, not read back
    assert _part(0.9, 0.4)["verdict"] == "looks"


def test_the_margin_is_two_standard_errors_where_few_answers_are_compared():
    # 20 answers at accuracy 0.5: 0.3 better with their own image is within chance (2·sqrt(2·0.25/20) = 0.316).
    small = _part(0.8, 0.5, compared=20, differing=20, changed=15, differing_changed=15)
    assert small["margin"] == pytest.approx(2 * np.sqrt(2 * 0.25 / 20))
    assert small["verdict"] == "moves_without_improving"
    assert _part(0.8, 0.5, compared=400, differing=400, changed=300, differing_changed=300)["verdict"] == "looks"


def test_the_margin_is_per_differing_answer_so_few_image_questions_among_many_are_not_drowned():
    # Valen-like: 900 questions, 60 of them with a gold answer another record's image changes. A model right
    # on half of those with its own image and wrong with the donor's gains 30 of 900 (0.033): under a margin
    # of 0.05 for all 900, but 0.5 per differing answer, far above its own (two standard errors over 60:
    # 0.15). The same figures without the gain: named.
    def valen(with_images, swapped_images):
        return _part(with_images, swapped_images, compared=900, differing=60, changed=90, differing_changed=40)

    swapped = 0.80 - 30 / 900
    looks = valen(0.80, swapped)
    assert looks["margin"] == pytest.approx(2 * np.sqrt(2 * swapped * (1 - swapped) / 60) * 60 / 900)
    assert looks["verdict"] == "looks"
    assert valen(0.80, 0.80)["verdict"] == "moves_without_improving"


def test_a_lower_is_better_metric_is_oriented_in_the_drop_and_against_the_baseline():
    def ade(with_images, swapped_images, baseline):
        return _part(with_images, swapped_images, baseline, metric="trajectory_ade", lower_is_better=True)

    chance = ade(0.32, 0.32, 0.32)  # issue 55's trajectories: chance
    assert chance["verdict"] == "moves_without_improving"
    assert chance["margin"] == pytest.approx(image_reliance.RELATIVE_GAIN * 0.32)
    assert ade(0.05, 0.30, 0.32)["verdict"] == "looks"  # the error drops with the own image (drop +0.25)
    assert ade(0.30, 0.10, 0.32)["verdict"] == "moves_without_improving"  # the own image makes it worse
    # No drop, but a third of the text-only baseline's error: not named blind (higher-is-better would be).
    assert ade(0.10, 0.10, 0.30)["verdict"] == "looks"
    assert ade(0.10, 0.10, 0.10)["verdict"] == "moves_without_improving"


def test_nothing_compared_has_no_verdict_and_an_older_report_only_the_text_ones():
    none = image_reliance.reliance(changed=0, compared=0, unswappable=3, differing=0, differing_changed=0,
                                   metric="point_accuracy", with_images=None, swapped_images=None)
    assert none["verdict"] is None and none["margin"] is None
    older = {key: value for key, value in _part(0.03, 0.03, 0.03).items()
             if key not in ("lower_is_better", "baseline", "margin", "verdict")}
    assert image_reliance.verdict(older) == "looks"  # written before the orientation was recorded


# --- a model trained to move its answers with the image without improving them (slow: ~1 min) ---------

# The tiny model with the from-scratch recipe of `configs/vflash.py` (`learns_to_look`) and the tower at the
# decoder's rate: it learns the left/right task in ~220 steps (300: a margin); the default model learns it in
# ~130, each step six times the cost. Rows fit the ~50-token records (tests/test_vision_learning.py).
TINY_LOOKS = ("--config.train.learning_rate=1e-3", "--config.model.tie_embeddings=False",
              "--config.model.coordinate_embeddings=fourier", "--config.loss.coordinate_sigma=25.0",
              "--config.loss.coordinate_sigma_final=3.0", "--config.train.vision_lr_multiplier=1.0",
              "--config.train.warmup_steps=20", "--config.data.seq_len=80")
STEPS = 300
WARNING = "image reliance: "
LEFT, RIGHT = "<point><250><500></point>", "<point><750><500></point>"  # the task's two answers


def _swap_sides(path: Path, output: Path) -> None:
    """`path`'s records, each answering with the point of a record whose disc is on the other side."""
    other = {LEFT: RIGHT, RIGHT: LEFT}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row["conversations"][-1]["value"] = other[row["conversations"][-1]["value"]]
    output.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.slow
def test_a_model_whose_answers_follow_the_image_to_the_wrong_side_is_named_blind(tmp_path):
    # Issue 25's left/right task (a red disc on the left or the right of a 64-px image, the same question
    # for every record), each training image answered with the other side's point: the model learns to look
    # at the disc and answer where it is not. On the real references its answers move with the image
    # (reliance ~1) and are no better for it, worse than another record's image and than the text-only
    # baseline: the old warning saw the high reliance and stayed silent.
    data = make_vision_tasks.make("leftright", tmp_path / "data", 200, 100, seed=0)
    _swap_sides(data["train"], data["train"])
    workdir = tmp_path / "run"
    result = run_train("configs/vflash.py:tiny", workdir, "--config.data.format=vflash",
                       "--config.data.eval_format=vflash", f"--config.data.train={data['train']}",
                       f"--config.data.eval={data['eval']}", f"--config.train.steps={STEPS}",
                       f"--config.train.checkpoint_every={STEPS}", "--config.train.log_every=50",
                       "--config.eval.every=0", "--config.eval.at_end=True", "--config.eval.max_examples=100",
                       "--config.eval.max_new_tokens=8", *TINY_LOOKS, timeout=600)
    part = json.loads((workdir / "eval" / f"report-{STEPS}.json").read_text())["image_reliance"]
    assert part["compared"] == 100 and part["differing"] >= image_reliance.RELIANCE_MIN_DIFFERING
    assert part["reliance"] >= 0.9  # it looks: where the other record's disc is on the other side, it follows
    assert part["drop"] < part["margin"] and part["baseline"] is not None
    assert part["verdict"] == "moves_without_improving"
    lines = [line for line in result.stderr.splitlines() if WARNING in line]
    assert len(lines) == 1 and lines[0].endswith("the model does not see what the question asks for"), lines

    # The same model on references that follow its training (the other side's point): learned, and no warning.
    _swap_sides(data["eval"], tmp_path / "data" / "eval_as_trained.jsonl")
    evaluated = run_module("valen_jax.evaluate", f"--workdir={workdir}",
                           f"--data={tmp_path / 'data' / 'eval_as_trained.jsonl'}",
                           f"--output={tmp_path / 'learned.json'}", timeout=300)
    learned = json.loads((tmp_path / "learned.json").read_text())["image_reliance"]
    assert learned["with_images"] >= 0.9 and learned["drop"] > learned["margin"]
    assert learned["verdict"] == "looks" and WARNING not in evaluated.stderr
    assert evaluated.stdout.strip().endswith("verdict: looks")
