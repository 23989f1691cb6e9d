"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

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
