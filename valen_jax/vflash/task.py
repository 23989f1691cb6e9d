"""`train.mode=vflash` (seed 004's --training_mode): VFlash's block drafter trained against the frozen
target of an `ar` workdir.

The target is that workdir's latest checkpoint, its params verified against their save-time digests;
the drafter's checkpoint meta records it (`valen_jax.run.target_record`: workdir, step, the identity of
its params, tokenizer) and a resumed run refuses a target with other weights (`run.check_target`). The rows are the target's token rows with the primitive blocks
marked (`draft_block`); the state holds the drafter alone, the target's params are a read-only input of
the step. `metrics.jsonl` gets the drafter's loss, per-position accuracy and expected acceptance length.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from data_pipeline.shards import Example
from valen_jax.data.assemble import draft_block_of
from valen_jax.data.sources import mixture_of
from valen_jax.data.valen_rows import is_valen
from valen_jax.errors import ConfigError, NothingToTrain
from valen_jax.models.drafter import DrafterConfig, drafter_flops_per_step, init_drafter_params
from valen_jax.run import ModelRun, check_target, holds_drafter, restore_start, target_record
from valen_jax.tasks.token_lm import token_assembly
from valen_jax.training import checkpoint
from valen_jax.training.step import TrainLayout, compile_step
from valen_jax.training.task import Setup, Task
from valen_jax.vflash.objective import DrafterOptions, make_drafter_train_step

log = logging.getLogger(__name__)


def restore_target(config, fingerprint: dict, mesh) -> ModelRun:
    """The target of `config.model.target_from`: an ar run of this tokenizer, its latest step, params
    verified, laid out on the drafter run's `mesh`."""
    workdir = Path(config.model.target_from).resolve()
    where = f"config.model.target_from={workdir}"

    def not_a_drafter(workdir: Path) -> None:
        if holds_drafter(workdir):
            raise checkpoint.CheckpointError(f"{where}: its latest checkpoint was trained with train.mode=vflash; "
                                             "a drafter's target must be an ar run")

    target = restore_start(workdir, where, fingerprint, mesh, first="train the ar target there first (train.mode=ar)",
                           vocabulary="; the drafter must share the target's vocabulary", check=not_a_drafter)
    mode = target.config.train.mode
    if mode != "ar":
        raise checkpoint.CheckpointError(f"{where}: checkpoint {target.step} was trained with train.mode={mode}; "
                                         "a drafter's target must be an ar run")
    log.info("target: %s step %d, params identity %s", workdir, target.step, target.identity)
    return target


def trainable_blocks(train_set) -> dict[str, int]:
    """Counts of what a drafter can learn from: records read, primitive blocks an `atomic_decoding` call
    announces in them, and those blocks with a token of loss weight > 0 (`atom_loss_masks` may zero them
    all). Stops at the first weighted block: one is enough to train, and a set of millions of records is
    then not read through; a set without one is read whole, so its refusal states every count."""
    found = {"records": 0, "blocks": 0, "weighted_blocks": 0}
    for shard_set, _ in mixture_of(train_set):
        source = shard_set.source()
        for index in range(len(source)):
            example = Example.from_bytes(source[index])
            found["records"] += 1
            blocks = draft_block_of(example)
            starts = np.flatnonzero(blocks == 1)
            found["blocks"] += len(starts)
            weights = example.arrays["target_weights"]
            ends = [*starts[1:], len(blocks)] if len(starts) else []
            if any(float(np.sum(weights[a:b][blocks[a:b] > 0])) > 0 for a, b in zip(starts, ends, strict=True)):
                found["weighted_blocks"] += 1
                return found
    return found


class DrafterTask(Task):
    """The block drafter's objective (seed 004) against a frozen target; config.model's own dims are not read."""

    mode = "vflash"

    @classmethod
    def open(cls, setup: Setup, train_set) -> DrafterTask:
        target = restore_target(setup.config, setup.fingerprint, setup.mesh)
        log.info("train.mode=vflash: the target's architecture comes from its checkpoint meta; config.model's "
                 "dims, dtype and remat are not read (the drafter's width and heads are the target's)")
        if is_valen(train_set):
            raise ConfigError("config.train.mode=vflash trains on token data with primitive blocks (seed 004); "
                              f"config.data.format={setup.config.data.format!r} has none")
        return cls(setup, target, train_set)

    def __init__(self, setup: Setup, target: ModelRun, train_set):
        super().__init__(setup, target.model_cfg, train_set)
        self.target = target
        try:
            self.drafter_cfg = DrafterConfig.of(self.config.model.drafter, target.model_cfg)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def check_trainable(self) -> None:
        # Seed 004: the drafter learns the blocks of primitives announced by atomic_decoding; points and
        # boxes announce none. Without a block every anchor weighs 0 and the run "trains" at loss 0.0000
        # with a gradient norm of 0 (issue 27).
        found = trainable_blocks(self.train_set)
        if not found["weighted_blocks"]:
            raise NothingToTrain(
                f"config.data.train={str(self.config.data.train)!r}: nothing to train for the drafter "
                f"(train.mode=vflash): {found['records']} records, {found['blocks']} primitive blocks announced "
                f"by atomic_decoding, 0 with a token of loss weight; it learns the blocks of trajectories "
                "(robot, driving, dense motion), which points and boxes do not have")

    def check_media(self, media_kwargs: dict) -> None:
        if json.loads(json.dumps(media_kwargs)) != self.target.media_kwargs:  # as JSON: tuples are lists there
            # The drafter reads the target's features of the images: they must be processed as the target saw them.
            raise ConfigError(f"config.media_kwargs give {media_kwargs}; the target in config.model.target_from was "
                              f"trained with {self.target.media_kwargs}")

    def layout(self) -> TrainLayout:
        return TrainLayout.for_drafter(self.drafter_cfg, self.config.train, self.setup.mesh)

    def row_spec(self, spec):
        return dataclasses.replace(spec, draft_blocks=True)  # the rows also mark the primitive blocks

    def assembly(self, spec):
        return token_assembly(self.config, self.train_set)

    def meta(self) -> dict:
        # `model` is the target's architecture; the state holds the drafter, trained against `target`.
        return {"drafter": {"config": self.drafter_cfg.to_json(), "target": target_record(self.target)}}

    def check_resume(self, step: int, saved: dict) -> None:
        check_target(self.setup.workdir, step, saved["drafter"]["target"], self.target)

    def initial_params(self, layout):
        return init_drafter_params(self.drafter_cfg, int(self.config.train.seed), layout.param_shardings)

    def compile(self, layout, batch_shapes: dict):
        step = make_drafter_train_step(layout.graphdef, self.target.graphdef, layout.tx, layout.schedule,
                                       DrafterOptions.from_config(self.config))
        return compile_step(step, layout, batch_shapes,
                            checkpoint.abstract_with(self.target.params, self.target.shardings))

    def step_function(self, compiled):
        params = self.target.params  # an argument, never donated: its arrays are read, never written

        def train_step(state, batch):
            return compiled(state, batch, params)

        return train_step

    def flops_per_step(self) -> float:
        data = self.config.data
        return drafter_flops_per_step(self.drafter_cfg, self.model_cfg, data.global_batch, data.seq_len,
                                      int(self.config.model.drafter.anchors_per_row))
