"""Valen trains end to end in both modes, and the branch loss falls on the smoke set."""

from __future__ import annotations

import pytest

from tests.train_runs import metrics, run_train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("mode", "reduction"), [("question", "state_mean"), ("shared_state", "question_mean")])
def test_valen_trains_and_the_branch_loss_falls(tmp_path, mode, reduction):
    workdir = tmp_path / mode
    run_train("configs/valen.py:tiny", workdir, f"--config.data.valen_mode={mode}",
              f"--config.loss.loss_reduction={reduction}", "--config.train.steps=24", "--config.train.log_every=4",
              "--config.train.checkpoint_every=24", "--config.train.learning_rate=3e-3")
    logged = metrics(workdir)
    assert all("loss_branches" in m and "loss_tokens" not in m for m in logged)
    first, last = logged[0]["loss_branches"], logged[-1]["loss_branches"]
    assert last < 0.7 * first, (first, last)
    assert logged[-1]["labeled_questions"] > 0

    from valen_jax import checkpoint
    meta = checkpoint.restore_meta(checkpoint.manager(workdir, read_only=True), 24)
    assert meta["model"]["score_head"] and meta["config"]["data"]["valen_mode"] == mode
