"""The Task seam: what a training mode is, as the training loop sees it.

The loop (`valen_jax.training.loop`) knows no mode; this protocol is what it asks of one (the modes
themselves live above it, in `valen_jax.tasks` and `valen_jax.vflash`, and the command hands the loop
their opener). The loop builds what every run shares (tokenizer, mesh, shards, `media_kwargs`, the row
spec, the data stream, the checkpoint manager and the resume checks every run needs) and asks the run's
Task for everything else, always in this order:

    task = open_task(setup, train_set)     # a mode's opener, looked up by config.train.mode
    task.model_cfg                         # the architecture the rows are built for
    task.check_trainable()                 # refuse data that gives this mode nothing to learn
    task.check_media(media_kwargs)         # e.g. a drafter's images processed as its target saw them
    layout = task.layout()                 # the train state's shapes and shardings, optimizer included
    spec = task.row_spec(spec)             # the rows this mode trains on
    assembly = task.assembly(spec)         # how shard records become batches (build_dataset's assembly)
    task.check_resume(step, saved_meta)    # refuse a checkpoint of another setup of this mode
    task.resumed_state(layout, state, step, saved_meta)  # a resume: the train state from what was saved
    task.initial_params(layout)            # or a fresh start's parameters
    task.meta()                            # what the checkpoint meta records beyond the shared keys
    task.compile(layout, batch_shapes)     # the train step, compiled for the layout's mesh
    task.step_function(compiled)           # (state, batch) -> (state, metrics); metrics hold "loss"
    task.flops_per_step()                  # model FLOPs of one step, for MFU
    task.evaluation(layout, spec)          # Evaluation: every config.eval.every steps, and at the end
    task.result()                          # extra keys of the run's result

A new mode is one module with a Task subclass and an opener registered under its `config.train.mode`
(`valen_jax.tasks.modes.register`), plus its config; nothing in the loop changes. `compile` is the
one way a train step is compiled: benchmarks and the ahead-of-time compile call it too.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from pathlib import Path

from valen_jax.data.sources import mixture_of
from valen_jax.errors import NothingToTrain
from valen_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every task is opened with: the validated config and what the loop built from it first."""

    config: object  # ml_collections.ConfigDict, validated
    workdir: Path
    tokenizer: object
    fingerprint: dict
    mesh: object  # jax.sharding.Mesh


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A mode's evaluation during training: `periodic(params)` -> {"eval_<metric>": value} (built at
    start-up, its data read once), `at_end(params, step)` -> the report's path; None where there is none."""

    periodic: Callable[[object], dict] | None = None
    at_end: Callable[[object, int], Path] | None = None


class Task(abc.ABC):
    """One training mode (see the module docstring for the order the loop calls these in)."""

    #: The `config.train.mode` this task trains.
    mode: str = ""

    def __init__(self, setup: Setup, model_cfg: ModelConfig, train_set):
        self.setup, self.config, self.model_cfg, self.train_set = setup, setup.config, model_cfg, train_set

    def check_trainable(self) -> None:
        """Refuse (NothingToTrain, naming the counts found) training data without a token this mode learns
        from. By default: the shards' supervised tokens (a loss weight > 0), counted by the converter."""
        counts = [shard_set.manifest.data["counts"] for shard_set, _ in mixture_of(self.train_set)]
        if sum(int(c["supervised_tokens"]) for c in counts) == 0:
            raise NothingToTrain(
                f"config.data.train={str(self.config.data.train)!r}: nothing to train (train.mode="
                f"{self.config.train.mode}): {sum(int(c['records']) for c in counts)} records, "
                f"{sum(int(c['tokens']) for c in counts)} tokens, 0 supervised tokens (no token has a loss weight)")

    def check_media(self, media_kwargs: dict) -> None:
        """Refuse `media_kwargs` this mode cannot train with (ConfigError); most accept any."""
        return None

    @abc.abstractmethod
    def layout(self):
        """The TrainLayout (valen_jax.training.step) of this mode's train state on the setup's mesh."""

    def row_spec(self, spec):
        """The RowSpec this mode's training rows are built with (evaluation keeps `spec`)."""
        return spec

    @abc.abstractmethod
    def assembly(self, spec):
        """The assembly `build_dataset` turns shard records into batches with (it also gives batch shapes)."""

    def meta(self) -> dict:
        """Checkpoint meta keys of this mode, added to the ones every run records."""
        return {}

    def check_resume(self, step: int, saved: dict) -> None:
        """Refuse (CheckpointError) checkpoint `step`, whose meta is `saved`, when this run cannot continue it."""
        return None

    def resumed_state(self, layout, state, step: int, saved: dict):
        """The train state to continue from checkpoint `step` (meta `saved`), which held `state` =
        `layout.saved(...)` of it: the same by default (a LoRA run's puts its base back)."""
        return state

    @abc.abstractmethod
    def initial_params(self, layout):
        """A fresh start's parameters, laid out with `layout.param_shardings`."""

    @abc.abstractmethod
    def compile(self, layout, batch_shapes: dict):
        """The train step compiled for `layout`'s mesh and these batch shapes (abstract inputs only, so
        the same call compiles ahead of time for devices this host does not have)."""

    def step_function(self, compiled):
        """(state, batch) -> (state, metrics) from `compiled`: binds any input that is not train state."""
        return compiled

    @abc.abstractmethod
    def flops_per_step(self) -> float:
        """Model FLOPs of one train step (MFU's numerator)."""

    def evaluation(self, layout, spec) -> Evaluation:
        """What this mode evaluates during training (none by default)."""
        return Evaluation()

    def result(self) -> dict:
        """Keys this mode adds to the run's result (and the command prints)."""
        return {}
