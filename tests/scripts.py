"""Import a script of the repository (a benchmark, a data generator, a config) that is not in a package."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """The module of ROOT/`relative`, executed once per call under `name` (default: its stem)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
