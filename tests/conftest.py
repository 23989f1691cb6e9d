"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# The suite runs on the CPU. With libtpu installed (the `tpu` extra, for the ahead-of-time compile tests)
# JAX would otherwise try to start a TPU runtime in every process and log its failure to stderr;
# compile-only TPU devices (jax.experimental.topologies) need no runtime. Subprocesses inherit it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu's machine-wide lockfile guards real TPU chips; the compile tests' compile-only devices open none,
# and two test workers may load libtpu at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Nothing in the suite downloads: every model and tokenizer is built locally. Offline, a hub name that is not
# cached fails at once; online without a network, huggingface_hub retries each request for ~45 s first.
# huggingface_hub reads it once, at import: hence here, before anything imports it (subprocesses inherit it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from PIL import Image

# The session-wide tiny Qwen-VL checkpoints (tests/vl_checkpoints.py), for every test that asks for them.
pytest_plugins = ["tests.vl_checkpoints"]


@pytest.fixture
def make_png(tmp_path: Path):
    """Write a tiny real PNG under tmp_path and return its path."""

    def make(name: str = "img.png", size: tuple[int, int] = (4, 3)) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (200, 30, 30)).save(path)
        return path

    return make


# Heaviest files first. `make test` runs two xdist workers with whole files to each (`--dist loadfile`,
# `--no-loadscope-reorder` so this order holds): a long file started last keeps one worker busy alone at
# the end, so the files start in decreasing order of their measured seconds (tests/file_seconds.json, made
# by tests/file_seconds.py from a run's junit XML). A file not measured yet starts before all of them, in
# collection order: its cost is unknown, and a new end-to-end file started last ran alone for its whole
# length (the 6-minute localisation test kept CI at 36 minutes); a small one started first costs nothing.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def pytest_collection_modifyitems(config, items):
    import json

    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    order = {}
    for item in items:
        order.setdefault(item.nodeid.split("::")[0], len(order))

    def heaviest_first(item):
        path = item.nodeid.split("::")[0]
        return -seconds.get(path, float("inf")), order[path]

    items.sort(key=heaviest_first)
