"""Training the model itself (`train.mode=ar`) on token data: the token-LM task, and what the tasks
that train the model (token LM, Valen scoring) share.

Token data (vflash, recipe, chat, vakforge, prepared) trains next-token cross-entropy on the
assistant tokens its renderer weights, rows packed by `config.data.packing`; the model starts from
`config.model.init_from` or fresh, and is evaluated on `config.data.eval` every `config.eval.every`
steps and at the end (`config.eval.at_end`) through the same code as `python -m valen_jax.evaluate`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from valen_jax.data.packing import PackingSpec
from valen_jax.data.pipeline import TokenAssembly, component_seed
from valen_jax.data.sources import mixture_of, sampling_indices
from valen_jax.evaluation.periodic import PeriodicEval
from valen_jax.evaluation.report import evaluate_params, write_report
from valen_jax.models.build import initial_params, lora_base
from valen_jax.run import ModelRun
from valen_jax.training import adapter_checkpoint
from valen_jax.training.checkpoint import CheckpointError
from valen_jax.training.metrics import model_flops_per_step
from valen_jax.training.step import StepOptions, TrainLayout, compile_step, make_train_step
from valen_jax.training.task import Evaluation, Task


def token_assembly(config, train_set) -> TokenAssembly:
    """Packed token rows; `records` lets overlong=skip stop once every record the stream holds was seen."""
    return TokenAssembly(dataclasses.replace(PackingSpec.from_config(config),
                                             records=distinct_records(train_set, int(config.train.seed))))


def distinct_records(train_set, seed: int) -> int:
    """Records the training stream can hold, all components together: what overlong=skip counts to stop."""
    return sum(len(np.unique(sampling_indices(shard_set.manifest, component_seed(seed, k))))
               for k, (shard_set, _) in enumerate(mixture_of(train_set)))


class ModelTask(Task):
    """A task that trains the model itself: its state is the model's params and optimizer state."""

    mode = "ar"
    base: dict | None = None  # a LoRA run's meta.lora_base: the frozen base its params hold

    def layout(self) -> TrainLayout:
        return TrainLayout.from_config(self.model_cfg, self.config.train, self.setup.mesh)

    def initial_params(self, layout):
        params = initial_params(self.config, self.model_cfg, self.setup.tokenizer, layout.param_shardings)
        if layout.saved_paths is not None:
            self.base = adapter_checkpoint.base_record(params, layout.saved_paths, self.config.model.init_from,
                                                       int(self.config.train.seed))
        return params

    def check_resume(self, step: int, saved: dict) -> None:
        if self.model_cfg.lora is not None and adapter_checkpoint.BASE_KEY not in saved:
            raise CheckpointError(
                f"{self.setup.workdir}: checkpoint {step} is a LoRA checkpoint from before adapter-only "
                "checkpoints (meta schema 2: its state holds the base too), which training does not continue; "
                "evaluate, predict, generate and export still read it. To train on, export its adapters "
                "(python -m valen_jax.export --adapter) and start a new workdir from them "
                "(--config.model.lora.init_adapter=FOLDER)")

    def resumed_state(self, layout, state, step: int, saved: dict):
        if layout.saved_paths is None:
            return state
        record = saved[adapter_checkpoint.BASE_KEY]
        base = lora_base(self.config, self.model_cfg, self.setup.tokenizer, layout.param_shardings, record["seed"])
        adapter_checkpoint.check_base(record, base, f"{self.setup.workdir}: checkpoint {step}")
        self.base = record
        return {**state, "params": adapter_checkpoint.with_trained(base, state["params"])}

    def meta(self) -> dict:
        return {adapter_checkpoint.BASE_KEY: self.base} if self.base is not None else {}

    def compile(self, layout, batch_shapes: dict):
        options = StepOptions.from_config(self.config, layout.frozen, self.setup.tokenizer)
        return compile_step(make_train_step(layout.graphdef, layout.tx, layout.schedule, options), layout,
                            batch_shapes)

    def flops_per_step(self) -> float:
        return model_flops_per_step(self.model_cfg, self.config.data.global_batch, self.config.data.seq_len)

    def evaluation(self, layout, spec) -> Evaluation:
        """Evaluation on config.data.eval through `evaluate`'s code, with the run in the shape a workdir
        restores to (each evaluation fills in the params of the moment)."""
        s, config = self.setup, self.config
        own = ModelRun(s.workdir, None, config, self.model_cfg, s.tokenizer, s.fingerprint, spec, s.mesh,
                       layout.graphdef, None)

        def at_end(params, step: int) -> Path:
            path = s.workdir / "eval" / f"report-{step}.json"
            with jax.set_mesh(s.mesh):
                report = evaluate_params(dataclasses.replace(own, step=step, params=params), config.data.eval)
            write_report(report, path)
            return path

        every = int(config.eval.every)
        return Evaluation(periodic=PeriodicEval(own) if 0 < every <= int(config.train.steps) else None,
                          at_end=at_end if config.eval.at_end else None)


class TokenLMTask(ModelTask):
    """Next-token cross-entropy on token data."""

    def assembly(self, spec):
        return token_assembly(self.config, self.train_set)
