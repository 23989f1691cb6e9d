"""The optimizer and train layout every step benchmark builds the same way (one place, so they compare alike).

    from step_setup import train_layout
    mesh, tx, schedule, layout = train_layout(cfg, learning_rate=1e-4)
"""

from __future__ import annotations

import ml_collections

from valen_jax import sharding
from valen_jax.models.config import ModelConfig
from valen_jax.optim import build_optimizer
from valen_jax.step import TrainLayout


def train_layout(cfg: ModelConfig, learning_rate: float):
    """(mesh over every device as `data`, AdamW + cosine schedule, TrainLayout) for a benchmark step."""
    train = ml_collections.ConfigDict(dict(learning_rate=learning_rate, warmup_steps=10, steps=1000,
                                           end_learning_rate_fraction=0.1, grad_clip_norm=1.0, adam_b1=0.9,
                                           adam_b2=0.95, weight_decay=0.0, decay="cosine", param_groups=[],
                                           vision_lr_multiplier=1.0))
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    tx, schedule = build_optimizer(train)
    return mesh, tx, schedule, TrainLayout(cfg, tx, mesh)
