"""`train.mode=reinforce` (issue 32, seed 003's reinforcement runs): sample completions, reward them
against the assistant message, and improve the model with a group-relative clipped objective.

One loop step is one rollout batch: the data stream's batch is P = config.rl.prompts_per_rollout
prompts (`reinforce.rows`: the conversation before each trained assistant message of chat or vakforge
rows, the message itself the gold answer); the decode engine samples G = config.rl.group_size
completions of each in one batched compiled call, seeded by (run seed, step, row) (`reinforce.rollout`);
the configured rewards (`reinforce.rewards`, and a model grader) score them; advantages are
group-relative (`reinforce.objective.group_advantages`); the old log-probabilities are computed once at
rollout time and kept, and config.rl.inner_steps optimizer updates follow on the clipped objective
(DAPO's token-level normalisation, `reinforce.objective`). The optimizer's schedule runs over
train.steps × inner_steps updates.

The policy starts from config.rl.from_workdir (an SFT workdir's latest checkpoint; its architecture and
tokenizer, WORKDIR/tokenizer, are the run's: config.data.tokenizer left at the config files' default
becomes that, one the user set must equal it, `reinforce.start_tokenizer`), else from config.model (an HF checkpoint in model.init_from, or fresh). With
config.rl.kl_coef > 0 that start is kept frozen as the reference. A resumed run restores its step and
data position (the loop's), hence the same prompts and completions: kill -9 and resume gives the same
parameters as an uninterrupted run.

Seed 003's refusals (`preflight`, before any device is claimed): prepared rows; a chat row with an
image; a row with no assistant message. Single process only for now: the rollout reads the whole
batch on the host.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.data.valen_rows import is_valen
from valen_jax.decoding.sampling import Sampling
from valen_jax.errors import ConfigError
from valen_jax.models import sharding
from valen_jax.models.build import model_config
from valen_jax.models.transformer import PerLayer
from valen_jax.reinforce import refusals, start_tokenizer
from valen_jax.reinforce import rollout as rollouts
from valen_jax.reinforce.objective import group_advantages
from valen_jax.reinforce.rows import PromptAssembly, PromptShape
from valen_jax.reinforce.settings import GRADER, check_run, rollout_metrics, rollout_seed
from valen_jax.reinforce.update import SEQUENCE_KEYS, make_log_probs, make_update
from valen_jax.run import ModelRun, restore_start
from valen_jax.tasks.token_lm import ModelTask
from valen_jax.training import checkpoint
from valen_jax.training.metrics import model_flops_per_step
from valen_jax.training.step import TrainLayout, compile_step
from valen_jax.training.task import Setup

log = logging.getLogger(__name__)

MODE = "reinforce"
SAMPLES_KEPT = 4  # completions of the latest rollout kept for the run's result (the smoke check prints them)


def preflight(config) -> None:
    """Seed 003's refusals of a reinforcement run, before any device is claimed: the config.rl values,
    prepared rows, and every chat row of the train data (an image, no assistant message), naming the row.
    With config.rl.from_workdir, the run's tokenizer becomes the start's (`reinforce.start_tokenizer`)."""
    check_run(config)
    start_tokenizer.resolve(config)  # before the loop loads config.data.tokenizer
    refusals.check_not_prepared(config)
    if config.data.format == "chat":  # vakforge rows hold no images; a row with no agent turn has no answer
        train = Path(str(config.data.train))  # registry references are resolved before the preflight
        for path in sorted(train.glob("*.jsonl")) if train.is_dir() else [train]:
            for _ in refusals.prompts(path):
                pass


def restore_policy(config, fingerprint: dict, mesh) -> ModelRun:
    """The latest checkpoint of config.rl.from_workdir: a run of this tokenizer, laid out on `mesh`."""
    workdir = Path(config.rl.from_workdir).resolve()
    start = restore_start(workdir, f"config.rl.from_workdir={workdir}", fingerprint, mesh,
                          first="train the SFT run there first (train.mode=ar)")
    log.info("policy starts from %s step %d (params identity %s)", workdir, start.step, start.identity)
    return start


def _fresh_copy(params, shardings):
    """New buffers of `params` (the train state is donated by every update; the reference must survive)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s, may_alias=False), params, shardings)


class ReinforceTask(ModelTask):
    """The group-relative clipped policy gradient on sampled completions (module docstring)."""

    mode = MODE

    @classmethod
    def open(cls, setup: Setup, train_set) -> ReinforceTask:
        config = setup.config
        check_run(config)
        if is_valen(train_set):
            raise ConfigError(f"config.train.mode=reinforce reads prompts of chat or vakforge rows; "
                              f"config.data.format={config.data.format!r} holds scored questions")
        start = restore_policy(config, setup.fingerprint, setup.mesh) if config.rl.from_workdir else None
        model_cfg = start.model_cfg if start is not None else model_config(config, setup.tokenizer)
        return cls(setup, model_cfg, train_set, start)

    def __init__(self, setup: Setup, model_cfg, train_set, start: ModelRun | None):
        super().__init__(setup, model_cfg, train_set)
        self.start, self.rl = start, setup.config.rl
        self.end_of_turn = end_of_turn_id(setup.tokenizer)
        self.samples: list[dict] = []
        if jax.process_count() > 1:
            raise ConfigError("config.train.mode=reinforce runs in one process for now (the rollout reads the "
                              "whole batch on the host)")

    def layout(self) -> TrainLayout:
        # The optimizer takes inner_steps updates per rollout: its warmup and decay are stretched to match.
        train = self.config.train.copy_and_resolve_references()
        k = int(self.rl.inner_steps)
        train.steps, train.warmup_steps = int(train.steps) * k, int(train.warmup_steps) * k
        return TrainLayout.from_config(self.model_cfg, train, self.setup.mesh)

    def assembly(self, spec):
        return PromptAssembly(PromptShape.from_config(self.config), self.end_of_turn)

    def meta(self) -> dict:
        start = None if self.start is None else {"workdir": str(self.start.workdir), "step": self.start.step,
                                                 "params_identity": self.start.identity}
        return {"reinforce": {"start": start}}

    def check_resume(self, step: int, saved: dict) -> None:
        recorded = saved.get("reinforce", {}).get("start")
        mine = self.meta()["reinforce"]["start"]
        if (recorded or {}).get("params_identity") != (mine or {}).get("params_identity"):
            raise checkpoint.CheckpointError(
                f"{self.setup.workdir}: checkpoint {step} started from {recorded}; this run starts from {mine} "
                "(config.rl.from_workdir): use another --workdir")

    def initial_params(self, layout):
        if self.start is None:
            return super().initial_params(layout)
        return _fresh_copy(self.start.params, layout.param_shardings)

    def _reference(self, layout):
        """The frozen reference of the KL term: the starting checkpoint (None when kl_coef is 0)."""
        if float(self.rl.kl_coef) == 0.0:
            return None
        return self.initial_params(layout)

    def rollout_shapes(self) -> dict:
        rows = int(self.rl.prompts_per_rollout) * int(self.rl.group_size)
        length, window = int(self.config.data.seq_len), int(self.rl.max_new_tokens)
        s = jax.ShapeDtypeStruct
        # Whole rows [N, T], the completion window [N, K] and its start [N] (`rollout.training_rows`).
        shape = {"completion_start": (rows,), "targets": (rows, window), "mask": (rows, window)}
        shapes = {key: s(shape.get(key, (rows, length)), jnp.float32 if key == "mask" else jnp.int32)
                  for key in SEQUENCE_KEYS}
        shapes.update(old_logp=s((rows, window), jnp.float32), advantages=s((rows,), jnp.float32))
        if float(self.rl.kl_coef) > 0:
            shapes["ref_logp"] = s((rows, window), jnp.float32)
        return shapes

    def sampling(self) -> Sampling:
        """How a rollout draws its completions (config.rl.temperature, top_p)."""
        return Sampling(temperature=float(self.rl.temperature), top_p=float(self.rl.top_p))

    def _update_of(self, layout):
        return make_update(layout.graphdef, layout.tx, layout.schedule, layout.frozen, float(self.rl.clip_epsilon),
                           float(self.rl.kl_coef), int(self.rl.inner_steps), float(self.rl.temperature),
                           len(self.setup.tokenizer))

    def compile(self, layout, batch_shapes: dict):
        """The update step on rollout-time old log-probabilities, compiled for the rollout batch's shapes
        (batch_shapes are the prompts'); a rollout's first update, which makes them, is `compile_first_update`
        (the same program but for that input and output). With rl.inner_steps=1 (a smoke check's) no update
        reads old log-probabilities: the first update is then the only program, compiled here once."""
        self._layout = layout
        if int(self.rl.inner_steps) == 1:
            log.info("rl.inner_steps=1: every update is a rollout's first; one update program compiled")
            return self.compile_first_update(layout)
        return compile_step(self._update_of(layout), layout, self.rollout_shapes())

    def compile_first_update(self, layout):
        """A rollout's first update: no `old_logp` in, its own forward's out (`reinforce.update`), laid out
        as the batch the later updates read it in."""
        shapes = {k: v for k, v in self.rollout_shapes().items() if k != "old_logp"}
        return compile_step(self._update_of(layout), layout, shapes, per_row_metrics=("old_logp",))

    def step_function(self, compiled):
        layout, rl, config, mesh = self._layout, self.rl, self.config, self.setup.mesh
        tokenizer, graphdef = self.setup.tokenizer, layout.graphdef
        first_update = compiled if int(rl.inner_steps) == 1 else self.compile_first_update(layout)
        # The KL reference's log-probabilities, as the sampler draws (ids < len(tokenizer), rl.temperature).
        log_probs = make_log_probs(graphdef, float(rl.temperature), len(tokenizer))
        reference = self._reference(layout)
        grader = self._grader() if GRADER in rl.rewards else None
        sampling = self.sampling()
        group, inner = int(rl.group_size), int(rl.inner_steps)
        weights = dict(rl.rewards)
        # Rollouts decode from a per-layer copy of a scanned policy (`transformer.PerLayer`: stacked weights
        # are sliced out again at every decode step, 2.1x slower on an H200); the copy lives for the rollout.
        split = PerLayer(self.model_cfg, mesh) if self.model_cfg.scan_layers else None
        if split is not None:
            log.info("rollouts decode the policy's %d scanned layers laid out per layer", split.cfg.num_layers)

        def policy(params):
            return (params, graphdef) if split is None else (split(params), split.graphdef)

        def train_step(state, batch):
            step = int(state["step"])
            host = jax.device_get(batch)  # one process: the whole batch (ReinforceTask refuses more)
            with jax.set_mesh(mesh):
                drawn = rollouts.sample(*policy(state["params"]), host, group_size=group,
                                        max_new_tokens=int(rl.max_new_tokens), sampling=sampling,
                                        seed=rollout_seed(int(config.train.seed), step), tokenizer=tokenizer,
                                        end_of_turn=self.end_of_turn, mesh=mesh)
            totals, each = rollouts.score(drawn, weights, group, tokenizer=tokenizer, grader=grader,
                                          grader_instructions=str(rl.grader_instructions))
            advantages = np.asarray(group_advantages(jnp.asarray(totals, jnp.float32), group,
                                                     bool(rl.scale_by_std)))
            rows = rollouts.training_rows(drawn, group, int(config.data.seq_len), int(rl.max_new_tokens))
            with jax.set_mesh(mesh):
                on_device = sharding.global_batch({**rows, "advantages": advantages.astype(np.float32)}, mesh)
                if reference is not None:
                    on_device["ref_logp"] = log_probs(reference, on_device)
                # The first update's forward gives the rollout-time log-probabilities the others clip against.
                state, metrics = first_update(state, on_device)
                # (laid out as the batch already: `compile_first_update`'s per-row metric).
                on_device["old_logp"] = metrics.pop("old_logp")
                updates = [metrics]
                for _ in range(inner - 1):
                    state, metrics = compiled(state, on_device)
                    updates.append(metrics)
            self.samples = [{"gold": drawn.golds[i // group].get("content"), "completion": drawn.texts[i],
                             "reward": float(totals[i])} for i in range(min(SAMPLES_KEPT, len(drawn.texts)))]
            out = {key: jnp.mean(jnp.stack([m[key] for m in updates])) for key in updates[0]}
            out["loss_first_update"] = updates[0]["loss"]
            unparsed = each.pop("grader_unparsed", None)
            out.update(rollout_metrics(each, totals, advantages, rollouts.lengths(drawn), group))
            if unparsed is not None:
                out["grader_unparsed"] = unparsed[0]
            state = dict(state, step=jax.device_put(state["step"] + 1, layout.replicated))
            return state, out

        return train_step

    def _grader(self):
        """The grader model's generate: config.rl.grader_workdir's latest checkpoint (or the policy's start)."""
        from valen_jax.reinforce.grader_model import workdir_grader

        source = self.rl.grader_workdir or (self.start.workdir if self.start is not None else None)
        if source is None:
            raise ConfigError("config.rl.rewards names 'grader': set config.rl.grader_workdir (or rl.from_workdir, "
                              "whose start then grades)")
        return workdir_grader(source, int(self.rl.grader_max_new_tokens), self.setup.mesh)

    def flops_per_step(self) -> float:
        rows = int(self.rl.prompts_per_rollout) * int(self.rl.group_size)
        passes = int(self.rl.inner_steps) + (float(self.rl.kl_coef) > 0) / 3  # a forward is 1/3 of a step
        return model_flops_per_step(self.model_cfg, rows, int(self.config.data.seq_len),
                                    head_seq=int(self.rl.max_new_tokens)) * passes

    def result(self) -> dict:
        return {"rollout_samples": self.samples}
