"""Training metrics to `metrics.jsonl` and TensorBoard event files in the workdir."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
from tensorboardX import SummaryWriter


class MetricsLog:
    def __init__(self, workdir: str | Path):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        workdir = Path(workdir)
        self.jsonl = open(workdir / "metrics.jsonl", "a", encoding="utf-8")
        self.tensorboard = SummaryWriter(str(workdir / "tensorboard"))

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in values.items()}
        self.jsonl.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        self.jsonl.flush()
        for name, value in clean.items():
            if math.isfinite(value):
                self.tensorboard.add_scalar(name, value, step)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tensorboard.close()
