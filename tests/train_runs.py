"""Run `python -m valen_jax.train` / `evaluate` in subprocesses with a chosen simulated device count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def env_with_devices(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    # Must be set before jax is imported, hence a fresh process per device count.
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def train_command(config: str, workdir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "valen_jax.train", f"--config={config}", f"--workdir={workdir}", *overrides]


def run_train(config: str, workdir: Path, *overrides: str, devices: int = 1, timeout: int = 300):
    result = subprocess.run(train_command(config, workdir, *overrides), cwd=ROOT, env=env_with_devices(devices),
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"train failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def metrics(workdir: Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def final_params(workdir: Path):
    """(step, params as numpy leaves) of the latest checkpoint in `workdir`, read onto one device."""
    import jax
    import numpy as np

    from valen_jax.training import checkpoint
    mgr = checkpoint.manager(workdir, read_only=True)
    step = checkpoint.select_step(mgr, workdir)
    # The saved shapes and dtypes, read back onto one device (the runs may have used several).
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                          mgr.item_metadata(step)["state"])
    state = checkpoint.restore_state(mgr, step, target)
    mgr.close()
    return step, [np.asarray(x) for x in jax.tree.leaves(state["params"])]
