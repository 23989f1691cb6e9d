"""Run `python -m valen_jax.train` / `evaluate` in subprocesses with a chosen simulated device count.

`run_module` (and `run_train`) fork each command from a warm parent per environment (tests/warm_cli.py): a
process of its own, as a user's `python -m` is, without paying the imports again for every command.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.warm_cli import WarmCLI

ROOT = Path(__file__).resolve().parent.parent
_WARM: dict[tuple, WarmCLI] = {}


def env_with_devices(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    # Must be set before jax is imported, hence a fresh process per device count.
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def train_command(config: str, workdir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "valen_jax.train", f"--config={config}", f"--workdir={workdir}", *overrides]


def warm_runner(devices: int = 1, **env: str) -> WarmCLI:
    """This test process's warm parent for commands seeing `devices` simulated devices and `env` on top."""
    key = (devices, *sorted(env.items()))
    if key not in _WARM:
        workspace = Path(tempfile.mkdtemp(prefix="warm-cli-"))
        _WARM[key] = WarmCLI({**env_with_devices(devices), **env}, workspace)
        atexit.register(shutil.rmtree, workspace, True)
        atexit.register(_WARM[key].close)
    return _WARM[key]


def run_module(module: str, *args: str, devices: int = 1, timeout: int = 300, check: bool = True,
               **env: str) -> subprocess.CompletedProcess:
    """`python -m module *args` from the repository root in a process of its own (see the module docstring);
    `check`: assert it exits 0, showing its output's tail otherwise."""
    result = warm_runner(devices, **env).run(module, list(args), cwd=ROOT, timeout=timeout)
    assert not check or result.returncode == 0, (
        f"{module} {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def run_train(config: str, workdir: Path, *overrides: str, devices: int = 1, timeout: int = 300,
              check: bool = True, **env: str) -> subprocess.CompletedProcess:
    return run_module("valen_jax.train", *train_command(config, workdir, *overrides)[3:], devices=devices,
                      timeout=timeout, check=check, **env)


def metrics(workdir: Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def final_params(workdir: Path):
    """(step, params as numpy leaves) of the latest checkpoint in `workdir` (a model's or a drafter's),
    restored onto one device by the library's run handle (digests verified; the runs may have used several)."""
    import jax
    import numpy as np

    from valen_jax.run import restore
    run = restore(workdir, devices=jax.devices()[:1])
    return run.step, [np.asarray(x) for x in jax.tree.leaves(run.params)]
