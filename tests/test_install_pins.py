"""Issue 54 (6): a GPU user installs in one step, and the pins admit the JAX/Flax that GPU images ship
(jax 0.11.2 with flax 0.12.12 on Python 3.12+), never pairing jax 0.11 with a flax that fails to import
under it (flax 0.12.8). Reads pyproject.toml, the two locks and the Makefile's plan (`make -n`)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PYTHONS = ("3.11", "3.12", "3.13", "3.14")


def _environment(python: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "extra": ""}


def _admitted(name: str, version: str, python: str) -> bool:
    """Whether pyproject's runtime dependencies admit NAME==VERSION on that Python."""
    specs = [req for req in map(Requirement, PROJECT["dependencies"])
             if req.name == name and (req.marker is None or req.marker.evaluate(_environment(python)))]
    assert specs, f"pyproject.toml: no {name} requirement applies on Python {python}"
    return all(req.specifier.contains(version, prereleases=False) for req in specs)


def _lock_pins(lock: str, python: str) -> dict[str, Version]:
    """NAME -> pinned version of a universal lock's lines that apply on that Python."""
    pins = {}
    for line in (ROOT / lock).read_text().splitlines():
        if not re.match(r"[A-Za-z0-9]", line):
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(_environment(python)):
            assert req.name not in pins, f"{lock}: two pins of {req.name} on Python {python}"
            pins[req.name] = Version(str(req.specifier).removeprefix("=="))
    return pins


@pytest.mark.parametrize("python", ["3.12", "3.13", "3.14"])
def test_pyproject_admits_what_gpu_images_ship(python):
    assert _admitted("jax", "0.11.2", python) and _admitted("flax", "0.12.12", python)
    # flax 0.12.8 declares jax>=0.10 but fails to import under jax 0.11: never the pair a resolver may pick.
    assert not (_admitted("jax", "0.11.2", python) and _admitted("flax", "0.12.8", python))


def test_pyproject_keeps_python_3_11_on_its_jax():
    # jax 0.11 and flax 0.12.9+ need Python 3.12; 3.11 keeps the line it had.
    assert _admitted("jax", "0.10.2", "3.11") and _admitted("flax", "0.12.8", "3.11")


@pytest.mark.parametrize("python", PYTHONS)
def test_locks_pin_a_jax_and_flax_that_import_together(python):
    runtime, test = _lock_pins("requirements.lock", python), _lock_pins("requirements-test.lock", python)
    for name in ("jax", "jaxlib", "flax"):
        assert runtime[name] == test[name], f"{name}: the two locks differ on Python {python}"
    assert _admitted("jax", str(runtime["jax"]), python) and _admitted("flax", str(runtime["flax"]), python)
    assert runtime["jaxlib"] == runtime["jax"]
    new_line = Version(python) >= Version("3.12")
    assert (runtime["jax"] >= Version("0.11")) == new_line
    assert (runtime["flax"] >= Version("0.12.9")) == new_line  # the first flax that declares jax>=0.11.1
    # libtpu for the compile-only devices: the one jax[tpu] of the locked jax pins (0.0.42 / 0.0.48).
    assert test["libtpu"].release[:3] == ((0, 0, 48) if new_line else (0, 0, 42))


def test_cuda_extra_is_jaxs_own_for_the_installed_jax():
    (cuda,) = map(Requirement, PROJECT["optional-dependencies"]["cuda"])
    # No version of its own: jax[cuda12] pins the plugin and PJRT to the jax that valen-jax's range picked.
    assert cuda.name == "jax" and cuda.extras == {"cuda12"} and not cuda.specifier


def _plan(*args: str) -> str:
    return subprocess.run(["make", "-n", "VENV=/nonexistent/venv", *args], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60).stdout


def test_make_setup_cuda_installs_the_plugin_of_the_locked_jaxlib():
    install = 'pip install --quiet -c requirements.lock "jax[cuda12]"'
    assert install in _plan("setup-cuda")
    # `make setup` picks it on a GPU host (nvidia-smi runs there): CUDA=1 is what that detection sets.
    assert install in _plan("setup", "CUDA=1") and install not in _plan("setup", "CUDA=0")
