"""What every command sets up first (train, evaluate, predict, generate, regenerate, export, compile,
serve): logging, INFO from this project and WARNING and above from the libraries whose INFO lines would
drown ours; and, on a host without TPU chips, no TPU runtime started and libtpu loaded quietly for
compile-only devices (`tpu_runtime`), whose errors came before the command's own first line."""

from __future__ import annotations

import logging

from valen_jax.cli import tpu_runtime

_NOISY = ("absl", "orbax", "jax._src", "grain")


def configure(timestamps: bool = False, force: bool = False) -> None:
    """`timestamps` for long runs (train); `force` replaces a root handler an import already set up."""
    prefix = "%(asctime)s " if timestamps else ""
    logging.basicConfig(level=logging.INFO, format=prefix + "%(levelname)s %(name)s: %(message)s", force=force)
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.WARNING)
    tpu_runtime.quiet_without_chips()
