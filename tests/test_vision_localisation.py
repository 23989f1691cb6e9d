"""Issue 25: `configs/vflash.py` trained from scratch localises a small disc anywhere in its image.

The task comes from the committed generator (`data/make_vision_tasks.py --task=locate`): a 64 × 64 grey
image with one red disc of radius 6 anywhere, the same question for every record, the answer its centre
as `<point><x><y></point>`. A correct point is within 5% of the image's side of the true centre
(`valen_jax.evaluation.metrics.vflash`). `benchmarks/vision_learning.py` measures the same run's learning
curve (0.9 reached at step 1500 of 2500); this test trains one 2000-step schedule and checks the end:
accuracy >= 0.9 and answers that follow the image. Its own file, so the test workers balance it against
the left/right tests (`--dist loadfile`)."""

from __future__ import annotations

import pytest

from tests.test_vision_learning import SCRATCH_ROWS, make_vision_tasks, point_accuracy, train_and_report

pytestmark = pytest.mark.heavy

STEPS = 2000


@pytest.mark.timeout(3600)  # the hang guard above the run's own limit
def test_configs_vflash_locates_a_small_disc_anywhere_from_scratch(tmp_path):
    data = make_vision_tasks.make("locate", tmp_path / "data", 2000, 100, seed=0)["train"].parent
    # ~8 min on a quiet 2-core host; the limit allows for a loaded CI machine.
    report, _ = train_and_report("configs/vflash.py", tmp_path / "run", data, STEPS, SCRATCH_ROWS, timeout=3000)
    assert report["examples"] == 100
    assert point_accuracy(report) >= 0.9
    reliance = report["image_reliance"]
    assert reliance["compared"] == 100 and reliance["reliance"] >= 0.9
