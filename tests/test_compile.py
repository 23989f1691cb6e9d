"""`python -m valen_jax.compile` (issue 28): the train step compiled ahead of time for a TPU slice
from this CPU host, through compile-only devices. Needs `libtpu` (the `tpu` extra); skipped without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("libtpu")

from valen_jax.errors import ConfigError  # noqa: E402
from valen_jax.tasks import aot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _command(*args: str, prelude: str = "pass") -> subprocess.CompletedProcess:
    # runpy so a prelude can change the process first (hide libtpu); absl parses sys.argv.
    code = (f"import sys, runpy; {prelude}; sys.argv = ['valen_jax.compile', *{list(args)!r}]; "
            "runpy.run_module('valen_jax.compile', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    output = tmp_path_factory.mktemp("aot") / "report.json"
    done = _command("--config=configs/vflash.py:tiny", "--topology=v5e:2x2", "--config.model.attention=auto",
                    f"--output={output}")
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(output.read_text())


def test_tiny_compiles_for_v5e_with_splash(tiny):
    done, report = tiny
    assert report["topology"] == {"name": "v5e:2x2", "topology_name": "v5e:2x2", "slices": 1, "chips": 4,
                                  "device_kind": report["topology"]["device_kind"]}
    assert "v5" in report["topology"]["device_kind"].lower()
    (program,) = report["programs"]
    assert program["program"] == "train_step"
    # attention=auto under a TPU mesh is splash: its Pallas kernel lowers to a Mosaic custom call.
    assert program["pallas_mosaic"] is True
    memory = program["gib_per_chip"]
    assert set(memory) == {"argument", "output", "temp", "alias", "total"}
    assert all(memory[key] > 0 for key in ("argument", "output", "temp", "total"))
    assert program["hbm_gib_per_chip"] == 16 and program["fits"] is True
    assert program["flops"] > 0 and program["compile_seconds"] > 0
    assert set(program["collectives"]) == set(aot.COLLECTIVES)
    assert sum(program["collectives"].values()) > 0  # data parallel: the gradients are reduced
    assert report["batch"]["tokens"] == [8, 192]
    assert "train_step: fits=True" in done.stdout and "pallas_mosaic=True" in done.stdout


@pytest.mark.slow  # a subprocess that compiles for TPU: tens of CPU seconds
def test_oversize_model_is_refused_naming_the_hbm():
    done = _command("--config=configs/vflash.py:tiny", "--topology=v5e:2x2", "--config.model.dim=8192",
                    "--config.model.mlp_dim=32768")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("DoesNotFit: train_step does not fit v5e:2x2") and "16 GiB HBM per chip" in last


@pytest.mark.slow  # a subprocess that compiles for TPU: tens of CPU seconds
def test_without_libtpu_one_line():
    done = _command("--config=configs/vflash.py:tiny", "--topology=v5e:2x2", prelude="sys.modules['libtpu'] = None")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("LibtpuMissing: libtpu is not installed") and "valen-jax[tpu]" in last
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("name", "topology", "bounds", "config"), [
    ("v5e-8", "v5e:2x4", (2, 2, 1), "default"),
    ("v5e:2x2", "v5e:2x2", (2, 2, 1), "default"),
    ("v6e-16", "v6e:4x4", (2, 2, 1), "default"),
    ("v5p-8", "v5p:2x2x1", (2, 2, 1), "megacore"),
    ("v5p-64", "v5p:2x4x4", (2, 2, 1), "megacore"),
    ("v4-8", "v4:2x2x1", (2, 2, 1), "megacore"),
])
def test_slice_names(name, topology, bounds, config):
    target = aot.parse_slice(name)
    assert (target.topology_name, target.chips_per_host_bounds, target.chip_config) == (topology, bounds, config)


@pytest.mark.parametrize("name", ["v9x-8", "v5e-6", "v5e", "v5e:2xq"])
def test_unknown_slice_names_are_refused(name):
    with pytest.raises(ConfigError, match="--topology"):
        aot.parse_slice(name)


@pytest.mark.slow  # a subprocess that compiles for TPU: tens of CPU seconds
def test_valen_branch_trees_compile_with_splash(tmp_path):
    # Branch trees are splash's two passes merged by log-sum-exp, with their own custom VJP.
    output = tmp_path / "valen.json"
    done = _command("--config=configs/valen.py:tiny", "--topology=v5e:2x2", f"--output={output}")
    assert done.returncode == 0, done.stderr[-3000:]
    (program,) = json.loads(output.read_text())["programs"]
    assert program["pallas_mosaic"] is True and program["fits"] is True
