"""Issue 54 (5): a command on a host without TPU chips prints no libtpu start-up errors, while a host with
chips, or a user who names the platforms, keeps JAX's TPU backend. Needs `libtpu` (the `tpu` extra)."""

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
# What libtpu's start-up writes on a host without chips (jax 0.10.2 + libtpu 0.0.42, jax 0.11.2 + libtpu
# 0.0.48): absl/glog lines (E0000 …, "Logging before InitGoogle()") and its TPU metadata warnings.
LIBTPU_NOISE = re.compile(r"libtpu|TPU|InitGoogle|^[EWF]\d{4} ", re.MULTILINE)


@pytest.mark.skipif(hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0,
                    reason="this host has TPU chips: JAX is meant to start its TPU runtime here")
def test_command_on_a_host_without_tpu_prints_no_libtpu_errors(tmp_path):
    # The suite runs with JAX_PLATFORMS=cpu (tests/conftest.py); a user's shell has none. The refusal comes
    # after the command has asked JAX for its devices (the workdir's mesh), so libtpu would have spoken.
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-m", "valen_jax.evaluate", f"--workdir={tmp_path}",
                           "--data=data/smoke/vflash", f"--output={tmp_path / 'report.json'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "CheckpointError" in done.stderr, done.stderr
    assert not LIBTPU_NOISE.search(done.stderr), done.stderr


@pytest.fixture
def factories(monkeypatch):
    """JAX's backend registry, as a copy this test may change, with no platform list set."""
    copy = dict(xla_bridge._backend_factories)
    monkeypatch.setattr(xla_bridge, "_backend_factories", copy)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JAX_FORCE_TPU_INIT", raising=False)
    platforms = jax.config.jax_platforms
    jax.config.update("jax_platforms", None)
    yield copy
    jax.config.update("jax_platforms", platforms)


def test_tpu_backend_dropped_only_without_chips(factories, monkeypatch):
    assert "tpu" in factories
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, None))
    tpu_runtime.skip_without_chips()
    assert "tpu" in factories
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
    tpu_runtime.skip_without_chips()
    assert "tpu" not in factories


@pytest.mark.parametrize("ask", ["env JAX_PLATFORMS", "config jax_platforms", "env JAX_FORCE_TPU_INIT"])
def test_tpu_backend_kept_when_the_user_asks(factories, monkeypatch, ask):
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
    if ask == "config jax_platforms":
        jax.config.update("jax_platforms", "tpu,cpu")
    else:
        monkeypatch.setenv(ask.split()[1], "tpu,cpu" if ask == "env JAX_PLATFORMS" else "1")
    tpu_runtime.skip_without_chips()
    assert "tpu" in factories
