"""Tiny trained workdirs for the evaluation and notebook tests, trained once per pytest session."""

from __future__ import annotations

from pathlib import Path

from tests.train_runs import run_train

STEPS = ("--config.train.steps=4", "--config.train.checkpoint_every=4", "--config.eval.at_end=False")


def smoke_workdir(tmp_path_factory, config: str, *overrides: str) -> Path:
    """`config` trained for 4 steps; reused by every test module of the session (the base temp dir
    is the session's), so the evaluation and notebook tests train each config once."""
    name = config.replace("configs/", "").replace(".py", "").replace(":", "-")
    workdir = tmp_path_factory.getbasetemp() / "smoke-workdirs" / name
    if not (workdir / "checkpoints" / "4").is_dir():
        run_train(config, workdir, *STEPS, *overrides)
    return workdir
