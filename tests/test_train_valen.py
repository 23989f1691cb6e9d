"""Valen trains end to end in both modes, the branch loss falls on the smoke set, and 8 devices
train as one does."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.train_runs import metrics, run_train

pytestmark = pytest.mark.heavy


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

    from valen_jax.training import checkpoint
    meta = checkpoint.restore_meta(checkpoint.manager(workdir, read_only=True), 24)
    assert meta["model"]["score_head"] and meta["config"]["data"]["valen_mode"] == mode
    # Valen runs write the media log as token runs do (seed 000): the smoke set's image and video records.
    lines = [json.loads(line) for part in workdir.glob("media_log.*.jsonl") for line in part.read_text().splitlines()]
    assert {line["kind"] for line in lines} == {"image", "video"}
    assert all(line["vision_tokens"] > 0 and line["sha256"] for line in lines)
    assert all(len(line["frame_indices"]) == len(line["timestamps"]) > 1 for line in lines if line["kind"] == "video")


def test_one_and_eight_devices_give_the_same_valen_losses(tmp_path):
    common = ("--config.train.steps=3", "--config.train.log_every=1", "--config.train.checkpoint_every=3",
              "--config.eval.at_end=False")
    run_train("configs/valen.py:tiny", tmp_path / "one", *common, devices=1)
    run_train("configs/valen.py:tiny", tmp_path / "eight", *common, "--config.mesh.data=2", "--config.mesh.fsdp=2",
              "--config.mesh.tensor=2", devices=8)
    one, eight = metrics(tmp_path / "one"), metrics(tmp_path / "eight")
    assert [m["step"] for m in one] == [m["step"] for m in eight] == [1, 2, 3]
    np.testing.assert_allclose([m["loss_branches"] for m in one], [m["loss_branches"] for m in eight], rtol=2e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in one], [m["grad_norm"] for m in eight], rtol=1e-4)
