"""Logging for the command lines (train, evaluate, predict, generate, export): INFO from this project,
WARNING and above from the libraries whose INFO lines would drown ours."""

from __future__ import annotations

import logging

_NOISY = ("absl", "orbax", "jax._src", "grain")


def configure(timestamps: bool = False, force: bool = False) -> None:
    """`timestamps` for long runs (train); `force` replaces a root handler an import already set up."""
    prefix = "%(asctime)s " if timestamps else ""
    logging.basicConfig(level=logging.INFO, format=prefix + "%(levelname)s %(name)s: %(message)s", force=force)
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.WARNING)
