"""Tiny trained workdirs for the evaluation and notebook tests, trained once per pytest session."""

from __future__ import annotations

import re
from pathlib import Path

from tests.once_per_run import build_once
from tests.train_runs import run_train

STEPS = ("--config.train.steps=4", "--config.train.checkpoint_every=4", "--config.eval.at_end=False")


def smoke_workdir(tmp_path_factory, config: str, *overrides: str) -> Path:
    """`config` trained for 4 steps; reused by every test module of the run, on every xdist worker
    (tests/once_per_run.py), so the evaluation and notebook tests train each config once. Read-only for
    tests: copy it before training on or damaging it."""
    name = "-".join((config.replace("configs/", "").replace(".py", "").replace(":", "-"), *overrides))
    name = re.sub(r"[^A-Za-z0-9._=-]+", "_", name)

    def train(workdir: Path) -> None:
        run_train(config, workdir, *STEPS, *overrides)

    return build_once(tmp_path_factory, f"smoke-workdir-{name}", train)[0]
