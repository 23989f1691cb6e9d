"""Issue 55: the image-reliance verdict names a model whose answers move with the image without improving.

A high changed fraction says the picture moves the answer, not that it moves it towards what the question
asks for: issue 55's target answered most test images with one wrong point, with reliance 0.78, an
accuracy drop of 0.0 and point accuracy 0.03, the text-only baseline, and no warning fired. The verdict
(`image_reliance.verdict`) is checked here on report figures; `test_image_reliance_blindness.py` trains
such a model.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

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


def test_without_a_baseline_the_drop_alone_decides():
    assert _part(0.6, 0.6)["verdict"] == "moves_without_improving"  # chat, Valen: no text-only baseline
    assert _part(0.9, 0.4)["verdict"] == "looks"


def test_the_margin_is_two_standard_errors_where_few_answers_are_compared():
    # 20 answers at accuracy 0.5: 0.3 better with their own image is within chance (2·sqrt(2·0.25/20) = 0.316).
    small = _part(0.8, 0.5, compared=20, differing=20, changed=15, differing_changed=15)
    assert small["margin"] == pytest.approx(2 * np.sqrt(2 * 0.25 / 20))
    assert small["verdict"] == "moves_without_improving"
    assert _part(0.8, 0.5, compared=400, differing=400, changed=300, differing_changed=300)["verdict"] == "looks"


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
