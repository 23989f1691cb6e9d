"""The whole path: smoke JSONL → shards → sharded training → Orbax checkpoint → evaluation."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests import waiting
from tests.train_runs import ROOT, env_with_devices, final_params, metrics, run_train, train_command

pytestmark = pytest.mark.heavy
TINY = "configs/vflash.py:tiny"
NO_EVAL = "--config.eval.at_end=False"


def test_default_config_on_8_devices_checkpoints_meta_and_evaluates(tmp_path):
    workdir = tmp_path / "run"
    result = run_train("configs/vflash.py", workdir, "--config.train.steps=4", "--config.train.checkpoint_every=2",
                       "--config.train.log_every=1", "--config.eval.max_examples=8",
                       "--config.eval.max_new_tokens=8", "--config.mesh.data=2", "--config.mesh.fsdp=4",
                       devices=8)
    assert f"checkpoint: {workdir / 'checkpoints' / '4'}" in result.stdout
    assert "evaluation report:" in result.stdout
    report = json.loads((workdir / "eval" / "report-4.json").read_text())
    assert report["examples"] == 8 and report["target_tokens"] > 0
    assert 0.0 <= report["generation"]["primitive_parse_rate"] <= 1.0
    assert [m["step"] for m in metrics(workdir)] == [1, 2, 3, 4]

    # A fresh process restores the checkpoint with nothing but the workdir.
    check = subprocess.run(
        [sys.executable, "-c", (
            "import json, sys\n"
            "from valen_jax.training import checkpoint\n"
            "from valen_jax.evaluate import evaluate_workdir\n"
            f"mgr = checkpoint.manager({str(workdir)!r}, read_only=True)\n"
            "meta = checkpoint.restore_meta(mgr, mgr.latest_step())\n"
            "tok = checkpoint.load_tokenizer(" + repr(str(workdir)) + ", meta['tokenizer']['fingerprint'])\n"
            f"report = evaluate_workdir({str(workdir)!r}, {str(ROOT / 'data/smoke/scenes/eval_recipe.json')!r})\n"
            "print(json.dumps({'step': mgr.latest_step(), 'media_kwargs': meta['media_kwargs'],\n"
            "  'fingerprint': meta['tokenizer']['fingerprint'], 'report_step': report['step'],\n"
            "  'manifest_records': meta['shards']['train']['counts']['records'],\n"
            "  'config_steps': meta['config']['train']['steps']}))\n")],
        cwd=ROOT, env=env_with_devices(1), capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-4000:]
    restored = json.loads(check.stdout.strip().splitlines()[-1])
    assert restored["step"] == 4 and restored["report_step"] == 4
    assert restored["media_kwargs"] == {"min_pixels": 1024, "max_pixels": 4096, "fps": 2.0, "max_frames": 8,
                                        "min_frames": 1, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                                        "video_min_pixels": 1024, "video_max_pixels": 4096, "video_pixels_per": "frame"}
    assert restored["config_steps"] == 4 and restored["manifest_records"] == 496  # the smoke recipe's 96 and 400 scenes

    from transformers import AutoTokenizer

    from data_pipeline.tokenizer import fingerprint, load_tokenizer
    assert restored["fingerprint"] == fingerprint(load_tokenizer(ROOT / "data/tokenizer")).to_json()
    assert fingerprint(AutoTokenizer.from_pretrained(workdir / "tokenizer")).to_json() == restored["fingerprint"]


def test_one_and_eight_devices_give_the_same_losses(tmp_path):
    common = ("--config.train.steps=4", "--config.train.log_every=1", NO_EVAL, "--config.train.checkpoint_every=4")
    run_train(TINY, tmp_path / "one", *common, devices=1)
    run_train(TINY, tmp_path / "eight", *common, "--config.mesh.data=2", "--config.mesh.fsdp=2",
              "--config.mesh.tensor=2", devices=8)
    one, eight = metrics(tmp_path / "one"), metrics(tmp_path / "eight")
    assert [m["step"] for m in one] == [m["step"] for m in eight] == [1, 2, 3, 4]
    np.testing.assert_allclose([m["loss"] for m in one], [m["loss"] for m in eight], rtol=2e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in one], [m["grad_norm"] for m in eight], rtol=1e-4)


@pytest.mark.parametrize("stop, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "Ctrl-C"])
def test_rerunning_the_command_resumes_at_the_same_step_and_data_position(tmp_path, stop, code):
    steps = ("--config.train.steps=8", "--config.train.log_every=1", NO_EVAL, "--config.train.checkpoint_every=8")
    run_train(TINY, tmp_path / "straight", *steps)

    # Stop the second run (preemption, or Ctrl-C) once it has trained a few steps, then rerun the same command.
    workdir = tmp_path / "resumed"
    process = subprocess.Popen(train_command(TINY, workdir, *steps), cwd=ROOT, env=env_with_devices(1),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if waiting.until(lambda: (workdir / "metrics.jsonl").exists() and len(metrics(workdir)) >= 3, process):
        process.send_signal(stop)
    out, err = process.communicate()
    # A checkpoint of the step in flight, then 128 + the signal: a scheduler must not read the stop as success.
    assert process.returncode == code, err[-4000:]
    assert "Traceback" not in err and f"stopped by {stop.name} at step" in err.splitlines()[-1], err[-2000:]
    stopped_at = metrics(workdir)[-1]["step"]
    assert 3 <= stopped_at < 8, "the run ended before it could be preempted"
    assert (workdir / "checkpoints" / str(stopped_at)).is_dir()

    result = run_train(TINY, workdir, *steps)
    assert "resumed from step" in result.stderr
    resumed = metrics(workdir)
    assert [m["step"] for m in resumed] == list(range(1, stopped_at + 1)) + list(range(stopped_at + 1, 9))
    straight = metrics(tmp_path / "straight")
    # Same data in the same order after the restart: identical losses step for step.
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight]
    step_a, params_a = final_params(tmp_path / "straight")
    step_b, params_b = final_params(workdir)
    assert step_a == step_b == 8
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)
