"""The optimizer, train layout and compiled train step every step benchmark builds the same way (one
place, so they compare alike).

    from step_setup import compiled_step, train_layout
    mesh, tx, schedule, layout = train_layout(cfg, learning_rate=1e-4)
    compiled = compiled_step(layout, batch)   # batch: arrays or ShapeDtypeStructs
    seconds = seconds_per_step(compiled, state, device_batch, mesh, steps=3)
    medians = interleaved_seconds({"full": (compiled, state, device_batch, mesh), "lora": (...)}, rounds=7)
"""

from __future__ import annotations

import statistics
import time

import jax
import ml_collections

from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig
from valen_jax.training.step import StepOptions, TrainLayout, compile_step, make_train_step


def train_config(learning_rate: float) -> ml_collections.ConfigDict:
    """config.train for a benchmark step: AdamW + cosine schedule, no param groups."""
    return ml_collections.ConfigDict(dict(learning_rate=learning_rate, warmup_steps=10, steps=1000,
                                          end_learning_rate_fraction=0.1, grad_clip_norm=1.0, adam_b1=0.9,
                                          adam_b2=0.95, weight_decay=0.0, decay="cosine", param_groups=[],
                                          vision_lr_multiplier=1.0))


def train_layout(cfg: ModelConfig, learning_rate: float):
    """(mesh over every device as `data`, AdamW + cosine schedule, TrainLayout) for a benchmark step."""
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    layout = TrainLayout.from_config(cfg, train_config(learning_rate), mesh)
    return mesh, layout.tx, layout.schedule, layout


def compiled_step(layout: TrainLayout, batch: dict):
    """The token train step (`make_train_step`, default StepOptions but the layout's frozen mask: LoRA's base)
    compiled by `valen_jax.training.step.compile_step` (state donated, the layout's shardings) for the shapes
    and dtypes of `batch`."""
    shapes = {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in batch.items()}
    step = make_train_step(layout.graphdef, layout.tx, layout.schedule, StepOptions(frozen=layout.frozen))
    return compile_step(step, layout, shapes)


def seconds_per_step(compiled, state: dict, device_batch: dict, mesh, steps: int) -> float:
    """Wall seconds per step of `compiled` over `steps` steps after one warm-up step (the state is donated
    and carried from step to step, as in training)."""
    with jax.set_mesh(mesh):
        state, metrics = compiled(state, device_batch)
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, device_batch)
        jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps


def interleaved_seconds(runs: dict[str, tuple], rounds: int) -> dict[str, float]:
    """Median wall seconds of one step of each run, the runs taking turns (one step each per round, after a
    warm-up step each): on a shared host the load drifts over minutes, and steps measured one run after the
    other would compare one run's quiet minute with another's busy one. `runs`: name → (compiled, state,
    device batch, mesh), each state donated and carried from step to step as in training."""
    states, times = {}, {name: [] for name in runs}
    for name, (compiled, state, device_batch, mesh) in runs.items():
        with jax.set_mesh(mesh):
            states[name], metrics = compiled(state, device_batch)
            jax.block_until_ready(metrics)
    for _ in range(rounds):
        for name, (compiled, _, device_batch, mesh) in runs.items():
            with jax.set_mesh(mesh):
                start = time.perf_counter()
                states[name], metrics = compiled(states[name], device_batch)
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
