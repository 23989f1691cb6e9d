"""Issue 54 (5): a command on a host without TPU chips prints no libtpu start-up errors, the ahead-of-time
compile included, while a host with chips, or a user who names the TPU platform, keeps JAX's TPU backend.
Needs `libtpu` (the `tpu` extra)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("libtpu")

import jax  # noqa: E402
from jax._src import hardware_utils, xla_bridge  # noqa: E402

from valen_jax.cli import tpu_runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# What libtpu's start-up wrote on a host without chips (jax 0.10.2 + libtpu 0.0.42, jax 0.11.2 + libtpu
# 0.0.48): absl/glog lines (E0000 …, "Logging before InitGoogle()") and its TPU metadata warnings.
LIBTPU_NOISE = re.compile(r"libtpu|TPU|InitGoogle|^[EWF]\d{4} ", re.MULTILINE)
ONE_HOST = ("TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS")
no_chips_here = pytest.mark.skipif(hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0,
                                   reason="this host has TPU chips: JAX is meant to start its TPU runtime here")


def _run(*args: str) -> subprocess.CompletedProcess:
    # The suite runs with JAX_PLATFORMS=cpu (tests/conftest.py); a user's shell has none.
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", *ONE_HOST)}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@no_chips_here
@pytest.mark.slow  # a command's start-up: ~10 s on a quiet host
def test_command_on_a_host_without_tpu_prints_no_libtpu_errors(tmp_path):
    # The refusal comes after the command has asked JAX for its devices, so libtpu would have spoken.
    done = _run("valen_jax.evaluate", f"--workdir={tmp_path}", "--data=data/smoke/vflash",
                f"--output={tmp_path / 'report.json'}")
    assert done.returncode == 1 and done.stderr.strip().startswith("CheckpointError:"), done.stderr
    assert not LIBTPU_NOISE.search(done.stderr), done.stderr


@no_chips_here
@pytest.mark.slow  # loads libtpu and builds a v5e:2x2 of compile-only devices: ~15 s on a quiet host
def test_compile_on_a_host_without_tpu_prints_no_libtpu_errors():
    # Refused after the compile-only devices exist (the mesh is checked against them), before compiling.
    done = _run("valen_jax.compile", "--config=configs/vflash.py:tiny", "--topology=v5e:2x2",
                "--config.mesh.data=3")
    assert done.returncode != 0 and "needs 3 devices, 4 present" in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ShardingError:"), done.stderr


@pytest.fixture
def host(monkeypatch):
    """JAX's backend registry as a copy this test may change, no platform list set, and the one-host
    variables restored afterwards; returns (registry, set the TPU chip count JAX's lookup finds)."""
    copy = dict(xla_bridge._backend_factories)
    monkeypatch.setattr(xla_bridge, "_backend_factories", copy)
    for name in ("JAX_PLATFORMS", "JAX_FORCE_TPU_INIT", *ONE_HOST):
        monkeypatch.setenv(name, "")  # recorded, so whatever the code under test sets is undone
        monkeypatch.delenv(name)
    platforms = jax.config.jax_platforms
    jax.config.update("jax_platforms", None)

    def chips(count: int) -> None:
        monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (count, None))

    yield copy, chips
    jax.config.update("jax_platforms", platforms)


def test_tpu_backend_dropped_only_without_chips(host):
    factories, chips = host
    assert "tpu" in factories
    chips(4)
    tpu_runtime.quiet_without_chips()
    assert "tpu" in factories and not any(name in os.environ for name in ONE_HOST)
    chips(0)
    tpu_runtime.quiet_without_chips()
    assert "tpu" not in factories
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost" and os.environ["TPU_HOST_BOUNDS"] == "1,1,1"


@pytest.mark.parametrize("ask", ["env JAX_PLATFORMS", "config jax_platforms", "env JAX_FORCE_TPU_INIT"])
def test_tpu_backend_kept_when_the_user_asks_for_it(host, monkeypatch, ask):
    factories, chips = host
    chips(0)
    if ask == "config jax_platforms":
        jax.config.update("jax_platforms", "tpu,cpu")
    else:
        monkeypatch.setenv(ask.split()[1], "tpu,cpu" if ask == "env JAX_PLATFORMS" else "1")
    tpu_runtime.quiet_without_chips()
    assert "tpu" in factories and not any(name in os.environ for name in ONE_HOST)


def test_compile_only_libtpu_told_one_host_under_a_cpu_platform_list(host, monkeypatch):
    # `compile` sets JAX_PLATFORMS=cpu itself, then loads libtpu for its compile-only devices.
    factories, chips = host
    chips(0)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    tpu_runtime.quiet_without_chips()
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost" and os.environ["TPU_HOST_BOUNDS"] == "1,1,1"
