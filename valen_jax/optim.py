"""AdamW with linear warmup and cosine decay, clipped by global norm."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    peak = float(train_cfg.learning_rate)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=int(train_cfg.warmup_steps),
        decay_steps=max(int(train_cfg.steps), int(train_cfg.warmup_steps) + 1),
        end_value=peak * float(train_cfg.end_learning_rate_fraction))


def _decay_mask(params):
    # Norm scales and biases are not decayed: shrinking them towards zero only hurts.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def build_optimizer(train_cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(train_cfg)
    tx = optax.chain(
        optax.clip_by_global_norm(float(train_cfg.grad_clip_norm)),
        optax.adamw(schedule, b1=float(train_cfg.adam_b1), b2=float(train_cfg.adam_b2),
                    weight_decay=float(train_cfg.weight_decay), mask=_decay_mask),
    )
    return tx, schedule
