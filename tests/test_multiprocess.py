"""Multi-process training through `launch/local.py`: 2 processes × 2 CPU devices over gloo train like
1 process × 4 devices, and their Orbax checkpoint restores in a single process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.train_runs import ROOT, env_with_devices, metrics, run_train
from valen_jax.cli import distributed

TINY = "configs/vflash.py:tiny"
# Global batch 8 (tiny) splits as 4 rows per process. Teacher-forced eval at step 4: each process
# evaluates its slice of the held-out set and the sums of both are added, as one process's would be.
COMMON = ("--config.train.steps=4", "--config.train.log_every=1", "--config.train.checkpoint_every=4",
          "--config.eval.at_end=False", "--config.eval.every=4", "--config.eval.max_examples=6")

_spec = importlib.util.spec_from_file_location("launch_local", ROOT / "launch" / "local.py")
local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(local)


def test_explicit_job_needs_all_three_variables():
    assert distributed.explicit_job({}) is None
    job = {"VALEN_COORDINATOR": "localhost:1234", "VALEN_NUM_PROCESSES": "2", "VALEN_PROCESS_ID": "1"}
    assert distributed.explicit_job(job) == ("localhost:1234", 2, 1)
    with pytest.raises(distributed.DistributedError, match="VALEN_PROCESS_ID not set"):
        distributed.explicit_job({**job, "VALEN_PROCESS_ID": ""})
    with pytest.raises(distributed.DistributedError, match="outside 0..1"):
        distributed.explicit_job({**job, "VALEN_PROCESS_ID": "2"})


def test_launcher_stops_the_others_when_one_process_fails(capsys):
    # Process 1 fails at once; process 0 would wait a minute (as a peer blocked in a collective would).
    body = "import os, sys, time\nif os.environ['VALEN_PROCESS_ID'] == '1': sys.exit(3)\ntime.sleep(60)"
    assert local.launch(2, 0, [], command=(sys.executable, "-c", body)) == 3
    assert "process 1 exited with 3; stopping the others" in capsys.readouterr().err


@pytest.mark.heavy
def test_two_processes_train_like_one_and_their_checkpoint_restores_in_one(tmp_path):
    run_train(TINY, tmp_path / "one", *COMMON, devices=4)
    # Both processes share the workdir: process 0 converts the smoke data, process 1 waits for it.
    workdir = tmp_path / "two"
    launched = subprocess.run(
        [sys.executable, "launch/local.py", "--processes=2", "--devices-per-process=2", "--",
         f"--config={TINY}", f"--workdir={workdir}", *COMMON],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert launched.returncode == 0, launched.stdout[-6000:] + launched.stderr[-2000:]
    for index in (0, 1):
        assert f"[p{index}] " in launched.stdout
        assert f"process {index} of 2 (VALEN_* environment): 2 local devices, 4 global" in launched.stdout

    one, two = metrics(tmp_path / "one"), metrics(workdir)  # only process 0 writes metrics.jsonl
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2, 3, 4]
    assert [m["examples_seen"] for m in two] == [8, 16, 24, 32]
    np.testing.assert_allclose([m["loss"] for m in two], [m["loss"] for m in one], rtol=2e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in two], [m["grad_norm"] for m in one], rtol=1e-4)
    assert two[-1]["eval_target_tokens"] == one[-1]["eval_target_tokens"] > 0
    np.testing.assert_allclose(two[-1]["eval_loss"], one[-1]["eval_loss"], rtol=2e-5)
    # One Grain iterator state per process, beside the one state both wrote parts of.
    assert sorted(p.name for p in (workdir / "checkpoints/4/data").glob("process_*")) == [
        "process_0-of-2.json", "process_1-of-2.json"]

    # One process, one device: every array read back onto it matches the save-time digest.
    check = subprocess.run([sys.executable, "-c", (
        "import json, sys, jax\n"
        "from valen_jax.training import checkpoint\n"
        f"mgr = checkpoint.manager({str(workdir)!r}, read_only=True)\n"
        "step = mgr.latest_step()\n"
        "meta = checkpoint.restore_meta(mgr, step)\n"
        "one = jax.sharding.SingleDeviceSharding(jax.devices()[0])\n"
        "abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),\n"
        "                        mgr.item_metadata(step).state)\n"
        "state = checkpoint.restore_state(mgr, step, abstract)\n"
        "checkpoint.verify(step, meta, state, None)\n"
        "print(json.dumps({'step': step, 'devices': jax.device_count(), 'state_step': int(state['step']),\n"
        "  'layout': checkpoint.state_layout(state) == meta['state_layout'],\n"
        "  'config_steps': meta['config']['train']['steps']}))\n")],
        cwd=ROOT, env=env_with_devices(1), capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-4000:]
    restored = json.loads(check.stdout.strip().splitlines()[-1])
    assert restored == {"step": 4, "devices": 1, "state_step": 4, "layout": True, "config_steps": 4}
