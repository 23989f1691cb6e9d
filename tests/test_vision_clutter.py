"""Issue 55: `configs/vflash.py` trained from scratch finds a small ball in a cluttered scene, and a fine-tuned
imported Qwen2.5-VL (random weights, a plain patch embedding) is checked on the same scenes.

The task is the family's hardest (`data/make_vision_tasks.py --task=clutter`): a red ball of radius 3 px in a
64 × 64 image whose background colour changes from image to image, with pixel noise, and a fainter disc of
another colour beside it; 1600 training scenes, 100 held out; the answer the ball's centre as a point. Before
the fix (a plain patch embedding, the tower at a tenth of the learning rate) the trained model answered about
the same point for every image: point accuracy 0.03, the text-only baseline, with answers that moved with the
image (reliance 0.78) but not towards the ball. `benchmarks/vision_learning.py` runs the whole family."""

from __future__ import annotations

import pytest

from tests.test_vision_learning import (  # noqa: F401  (vl_checkpoint: the session fixture)
    SCRATCH_ROWS,
    make_vision_tasks,
    point_accuracy,
    train_and_report,
    vl_checkpoint,
)

# Issue 55's budget. Not fewer: the 1500-step schedule is at point accuracy 1.00 by its step 750, but a 750-step
# schedule (its rate decaying twice as fast) ends at 0.22 on these scenes.
STEPS = 1500


@pytest.fixture(scope="module")
def clutter(tmp_path_factory):
    return make_vision_tasks.make_family_task("clutter", tmp_path_factory.mktemp("clutter"), eval_count=100,
                                              seed=0)["train"].parent


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the hang guard above the run's own limit
def test_configs_vflash_finds_a_small_ball_among_clutter_from_scratch(clutter, tmp_path):
    # ~7 min on a quiet 2-core host; the limit allows for a loaded CI machine.
    report, result = train_and_report("configs/vflash.py", tmp_path / "run", clutter, STEPS, SCRATCH_ROWS,
                                      timeout=3000)
    assert report["examples"] == 100
    assert point_accuracy(report) >= 0.9
    reliance = report["image_reliance"]
    assert reliance["reliance"] >= 0.9 and reliance["drop"] >= 0.8
    assert reliance["verdict"] == "looks" and "image reliance:" not in result.stderr


@pytest.mark.heavy
@pytest.mark.timeout(3600)
def test_an_imported_qwen2_5_vl_tower_is_named_blind_on_the_clutter_scenes(clutter, vl_checkpoint, tmp_path):  # noqa: F811
    # Our tower or our training? The same loop, the same scenes, a tiny random Qwen2.5-VL checkpoint fine-tuned
    # whole (its tower a plain patch embedding, as ours was before issue 55; its processor keeps the 64-px
    # scenes at 64 px): its answers move with the image without finding the ball (point accuracy 0.02, reliance
    # 0.97, drop 0.01 at the default tower rate; 0.01 / 0.93 / -0.01 with the tower at the full rate), where our
    # tower with standardised pixels reaches 1.00. The input representation is what fails, not the training;
    # and the report names it (a pretrained Qwen tower, trained on natural images, is another matter we cannot
    # load here).
    base, _ = vl_checkpoint("qwen2_5_vl")
    report, result = train_and_report("configs/vflash.py:hf", tmp_path / "qwen", clutter, STEPS,
                                      f"--config.model.init_from={base}", f"--config.data.tokenizer={base}",
                                      "--config.model.dtype=float32", "--config.model.remat=none",
                                      "--config.train.learning_rate=3e-3", "--config.train.warmup_steps=20",
                                      "--config.data.seq_len=96", timeout=3000)
    assert point_accuracy(report) <= 0.1
    part = report["image_reliance"]
    assert part["changed_fraction"] >= 0.5 and part["verdict"] == "moves_without_improving"
    assert "the model does not see what the question asks for" in result.stderr
