"""The train step as a pure function of (train state, batch), and the shardings it runs with."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig
from valen_jax.models.drafter import DrafterConfig, abstract_drafter
from valen_jax.models.heads import branch_log_probs
from valen_jax.models.transformer import abstract_model
from valen_jax.training import adapter_checkpoint
from valen_jax.training.losses import (
    branch_cross_entropy,
    combine,
    head_token_losses,
    reduce_question_losses,
)
from valen_jax.training.optim import build_optimizer, frozen_mask, groups_of


def vision_inputs(batch):
    return batch["patches"], batch["patch_positions"], batch["patch_segments"]


def branch_sums(scores, batch, reduction: str) -> dict:
    """Valen's scored branches: soft-label cross-entropy summed by `loss_reduction` (seed 000)."""
    log_probs = branch_log_probs(scores, batch["score_positions"], batch["branch_mask"])
    losses = branch_cross_entropy(log_probs, batch["labels"], batch["labeled"])
    numerator, _ = reduce_question_losses(losses, batch["labeled"], reduction)
    # Argmax agreement with the label's argmax, over labeled questions (a training signal only;
    # evaluation reports hard-label accuracy separately).
    agree = jnp.argmax(jnp.where(batch["branch_mask"], log_probs, -jnp.inf), -1) == jnp.argmax(batch["labels"], -1)
    labeled = batch["labeled"].astype(jnp.float32)
    return {"branch_loss": numerator, "branch_correct": jnp.sum(agree * labeled), "branch_questions": jnp.sum(labeled)}


@dataclass(frozen=True)
class StepOptions:
    """What shapes the loss and the update beyond the optimizer (config.loss, config.train)."""

    loss_weights: Mapping[str, float] = field(default_factory=lambda: {"tokens": 1.0, "branches": 0.0,
                                                                       "drafter": 0.0})
    z_loss: float = 0.0
    grad_accum_steps: int = 1
    frozen: object = None  # pytree of bools like params (True: no gradient), or None
    loss_reduction: str = "state_mean"
    # Soft coordinate targets (config.loss.coordinate_sigma): the coordinate tokens' ids in value order
    # (empty: one-hot targets everywhere) and the width's schedule over `coordinate_sigma_steps`.
    coordinate_ids: tuple[int, ...] = ()
    coordinate_sigma: float = 0.0
    coordinate_sigma_final: float | None = None
    coordinate_sigma_steps: int = 1
    # config.model.lora.dropout > 0: the seed of its masks, one stream per step (fold_in(seed, step)), so a
    # resumed run draws the masks the uninterrupted one would; None: no dropout.
    lora_dropout_seed: int | None = None

    @classmethod
    def from_config(cls, config, frozen=None, tokenizer=None) -> StepOptions:
        sigma = float(config.loss.get("coordinate_sigma", 0.0))
        ids = ()
        if sigma > 0:
            if tokenizer is None:
                raise ValueError("config.loss.coordinate_sigma > 0 needs the tokenizer's coordinate tokens")
            from data_pipeline.tokenizer import number_token_ids

            ids = tuple(number_token_ids(tokenizer))
        final = config.loss.get("coordinate_sigma_final")
        lora = config.model.get("lora")
        dropout_seed = int(config.train.seed) if lora is not None and float(lora.dropout) > 0 else None
        return cls(lora_dropout_seed=dropout_seed, loss_weights=dict(config.loss.weights), z_loss=float(config.loss.z_loss),
                   grad_accum_steps=int(config.train.grad_accum_steps), frozen=frozen,
                   loss_reduction=str(config.loss.loss_reduction), coordinate_ids=ids, coordinate_sigma=sigma,
                   coordinate_sigma_final=None if final is None else float(final),
                   coordinate_sigma_steps=int(config.train.steps))

    def sigma_at(self, step):
        """The soft coordinate target's width at `step` (f32): geometric from coordinate_sigma to
        coordinate_sigma_final over coordinate_sigma_steps, then held (wide first: every record teaches
        the coarse place to many rows at once; narrow at the end: the exact value is what is decoded)."""
        start = jnp.float32(self.coordinate_sigma)
        if self.coordinate_sigma_final is None:
            return start
        fraction = jnp.clip(jnp.asarray(step, jnp.float32) / max(self.coordinate_sigma_steps, 1), 0.0, 1.0)
        return start * (self.coordinate_sigma_final / self.coordinate_sigma) ** fraction


def micro_batches(batch: dict, count: int) -> dict:
    """[B, ...] → [count, B/count, ...]: micro-batch i takes rows i, i+count, ...

    Strided rather than contiguous rows: each device's contiguous block of the batch-sharded
    rows then stays on that device in every micro-batch, so splitting moves no data.
    """
    def split(x):
        rows = x.shape[0] // count
        x = jnp.swapaxes(x.reshape(rows, count, *x.shape[1:]), 0, 1)
        return sharding.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))

    return {k: split(v) for k, v in batch.items()}


def frozen_partition(frozen) -> tuple[Callable, Callable]:
    """(split, join) for a frozen mask (None: nothing frozen). `split(params)` gives (trainable leaves,
    frozen leaves, treedef): gradients are taken w.r.t. the first alone, so the backward never forms a
    frozen weight's gradient, and a non-float frozen leaf (QLoRA's NF4 codes) never meets jax.grad;
    `join(trained, frozen, treedef)` puts the tree back together."""
    frozen_leaves = None if frozen is None else [bool(f) for f in jax.tree.leaves(frozen)]

    def split(params):
        leaves, treedef = jax.tree.flatten(params)
        if frozen_leaves is None:
            return leaves, [], treedef
        return ([x for x, f in zip(leaves, frozen_leaves, strict=True) if not f],
                [x for x, f in zip(leaves, frozen_leaves, strict=True) if f], treedef)

    def join(trained, frozen, treedef):
        if frozen_leaves is None:
            return jax.tree.unflatten(treedef, trained)
        trained, frozen = iter(trained), iter(frozen)
        return jax.tree.unflatten(treedef, [next(frozen) if f else next(trained) for f in frozen_leaves])

    return split, join


def whole_gradient(grads, frozen, join, treedef):
    """The trainable leaves' gradients as a whole tree: the optimizer sees every leaf; a frozen leaf's
    gradient is a zero it never stores (its label's set_to_zero keeps no state), and `apply_update` puts
    the frozen leaf back unchanged. A non-float leaf (NF4 codes) gets an f32 zero: optax's clipping
    selects between float values."""
    return join(grads, [jnp.zeros(x.shape, x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.float32)
                        for x in frozen], treedef)


def apply_update(tx: optax.GradientTransformation, grads, state, split, join):
    """(params, opt_state) after one optimizer update of `state` with whole-tree `grads`."""
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    trained, frozen, treedef = split(params)
    if frozen:
        # Bit for bit: `p + 0` would turn a -0.0 into +0.0; the frozen leaf itself passes through.
        params = join(trained, split(state["params"])[1], treedef)
    return params, opt_state


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    options: StepOptions | None = None) -> Callable:
    options = options or StepOptions()
    weights = dict(options.loss_weights)
    accum = int(options.grad_accum_steps)

    coordinate_ids = jnp.asarray(options.coordinate_ids, jnp.int32) if options.coordinate_ids else None

    split, join = frozen_partition(options.frozen)

    def sums_of(params, batch, sigma=None, lora_key=None):
        model = nnx.merge(graphdef, params)
        hidden = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"], vision_inputs(batch),
                              batch.get("branch_ids"), lora_key=lora_key)
        sums = {}
        if weights.get("tokens", 0.0) > 0 or "score_positions" not in batch:
            coordinates = None if coordinate_ids is None else (coordinate_ids, sigma)
            sums.update(head_token_losses(hidden, model.head_matrix(), batch["targets"], batch["target_weights"],
                                          coordinates=coordinates))
        if "score_positions" in batch:
            sums.update(branch_sums(model.score_head(hidden), batch, options.loss_reduction))
        return sums

    def total_of(sums, denominators):
        # Every objective is a sum over the whole global batch divided by a count fixed by the
        # batch alone (never by the parameters), so summing micro-batch gradients of
        # `total_of(micro sums)` gives exactly the gradient of one big batch.
        objectives, parts = {}, {}
        if "ce" in sums:
            objectives["tokens"] = sums["ce"] / denominators["tokens"]
            parts["loss_z"] = sums["z"] / denominators["tokens"]
        if "branch_loss" in sums:
            objectives["branches"] = sums["branch_loss"] / denominators["branches"]
        total = combine(objectives, weights) + options.z_loss * parts.get("loss_z", 0.0)
        return total, {**{f"loss_{name}": value for name, value in objectives.items()}, **parts}

    def grads_and_sums(params, batch, sigma=None, lora_key=None):
        # Denominators come from the whole global batch's labels and weights, before any split.
        # An all-zero-weight batch gives loss 0, not NaN.
        denominators = {"tokens": jnp.maximum(jnp.sum(batch["target_weights"]), 1.0)}
        if "score_positions" in batch:
            _, states = reduce_question_losses(jnp.zeros(batch["labeled"].shape), batch["labeled"],
                                               options.loss_reduction)
            denominators["branches"] = jnp.maximum(states, 1.0)

        trained, frozen, treedef = split(params)

        def micro_loss(t, micro, key):
            sums = sums_of(join(t, frozen, treedef), micro, sigma, key)
            return total_of(sums, denominators)[0], sums

        grad_fn = jax.grad(micro_loss, has_aux=True)
        if accum == 1:
            grads, sums = grad_fn(trained, batch, lora_key)
        else:
            def body(carry, micro_and_index):
                micro, index = micro_and_index  # each micro-batch its own dropout masks
                grads, sums = grad_fn(trained, micro, None if lora_key is None else jax.random.fold_in(lora_key, index))
                return jax.tree.map(jnp.add, carry, (grads, sums)), None

            micros = micro_batches(batch, accum)
            sum_shapes = jax.eval_shape(sums_of, params, jax.tree.map(lambda x: x[0], micros), sigma)
            zeros = (jax.tree.map(jnp.zeros_like, trained),
                     jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sum_shapes))
            (grads, sums), _ = jax.lax.scan(body, zeros, (micros, jnp.arange(accum)))
        total, parts = total_of(sums, denominators)
        return whole_gradient(grads, frozen, join, treedef), total, parts, sums, denominators

    def train_step(state, batch):
        sigma = options.sigma_at(state["step"]) if coordinate_ids is not None else None
        lora_key = None if options.lora_dropout_seed is None else \
            jax.random.fold_in(jax.random.key(options.lora_dropout_seed), state["step"])
        grads, loss, parts, sums, denominators = grads_and_sums(state["params"], batch, sigma, lora_key)
        params, opt_state = apply_update(tx, grads, state, split, join)
        metrics = {"loss": loss, **parts, "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(state["step"])}
        if "correct" in sums:
            metrics.update(accuracy=sums["correct"] / denominators["tokens"], target_tokens=sums["weight"])
        if sigma is not None:
            metrics["coordinate_sigma"] = sigma
        if "branch_correct" in sums:
            metrics.update(accuracy=sums["branch_correct"] / jnp.maximum(sums["branch_questions"], 1.0),
                           labeled_questions=sums["branch_questions"])
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return train_step


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _optimizer_shardings(opt_shapes, param_shapes, param_shardings, replicated):
    """Each optimizer-state array takes the sharding of the parameter it mirrors, else replicated.

    A moment sits in the state under its parameter's path (after the optimizer's own fields), so
    the parameter is found by path suffix and shape. optax.tree_map_params cannot do this once
    multi_transform puts masked trees in the state (parameter groups).
    """
    params = {_keys(path): (shape.shape, sharding) for (path, shape), sharding in zip(
        jax.tree_util.tree_flatten_with_path(param_shapes)[0], jax.tree.leaves(param_shardings), strict=True)}

    def one(path, leaf):
        keys = _keys(path)
        for start in range(len(keys)):
            found = params.get(keys[start:])
            if found is not None and found[0] == leaf.shape:
                return found[1]
        return replicated

    return jax.tree_util.tree_map_with_path(one, opt_shapes)


class TrainLayout:
    """Abstract shapes and shardings of the train state and batch for one model on one mesh."""

    def __init__(self, model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh,
                 schedule: optax.Schedule | None = None, frozen=None, abstract=None):
        """`abstract`: the trained module's (graphdef, abstract state) when it is not `model_cfg`'s decoder
        (a drafter)."""
        self.mesh = mesh
        self.tx, self.schedule, self.frozen = tx, schedule, frozen
        self.graphdef, abstract_state = abstract if abstract is not None else abstract_model(model_cfg)
        self.param_shardings = nnx.to_pure_dict(sharding.state_shardings(abstract_state, mesh))
        self.param_shapes = nnx.to_pure_dict(abstract_state)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_shapes = jax.eval_shape(tx.init, self.param_shapes)
        opt_shardings = _optimizer_shardings(opt_shapes, self.param_shapes, self.param_shardings, replicated)
        self.state_shapes = {"params": self.param_shapes, "opt_state": opt_shapes,
                             "step": jax.ShapeDtypeStruct((), jnp.int32)}
        self.state_shardings = {"params": self.param_shardings, "opt_state": opt_shardings, "step": replicated}
        self.replicated = replicated
        # A LoRA run's checkpoints hold the params it trains and no base (training/adapter_checkpoint.py).
        lora_run = model_cfg is not None and model_cfg.lora is not None
        self.saved_paths = adapter_checkpoint.trained_paths(frozen) if lora_run else None

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, train_cfg, mesh: Mesh) -> TrainLayout:
        """The layout with the configured optimizer; param groups resolve against the model's paths."""
        param_shapes = nnx.to_pure_dict(abstract_model(model_cfg)[1])
        tx, schedule = build_optimizer(train_cfg, param_shapes, model_cfg.lora)
        frozen = None
        if train_cfg.param_groups or model_cfg.lora is not None:
            frozen = frozen_mask(param_shapes, groups_of(train_cfg, param_shapes, model_cfg.lora))
        return cls(model_cfg, tx, mesh, schedule, frozen)

    @classmethod
    def for_drafter(cls, drafter_cfg: DrafterConfig, train_cfg, mesh: Mesh) -> TrainLayout:
        """The layout of a drafter's train state: its parameters alone (the target is an input, never state)."""
        abstract = abstract_drafter(drafter_cfg)
        tx, schedule = build_optimizer(train_cfg, nnx.to_pure_dict(abstract[1]))
        return cls(None, tx, mesh, schedule, None, abstract=abstract)

    def batch_shardings(self, batch_shapes: dict) -> dict:
        return {name: sharding.batch_sharding(self.mesh, len(shape.shape)) for name, shape in batch_shapes.items()}

    def abstract_state(self):
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            self.state_shapes, self.state_shardings)

    def saved(self, state):
        """What a checkpoint of `state` holds: all of it, or under LoRA the optimizer state, the step and the
        trained params alone (the frozen base is recorded by its fingerprints instead)."""
        if self.saved_paths is None:
            return state
        return {**state, "params": adapter_checkpoint.select(state["params"], lambda path: path in self.saved_paths)}

    def saved_abstract_state(self):
        """`saved` of the abstract state: what a resume restores from a checkpoint of this layout."""
        return self.saved(self.abstract_state())


def compile_step(step: Callable, layout: TrainLayout, batch_shapes: dict, *inputs, per_row_metrics=()):
    """`step(state, batch, *inputs) -> (state, metrics)` jitted with the layout's shardings (the state
    donated, metrics replicated) and compiled for the layout's mesh from abstract shapes alone.

    `inputs`: abstract arrays (ShapeDtypeStruct with their sharding) of read-only arguments after the
    batch, e.g. a drafter's frozen target. `per_row_metrics`: the names of metrics that are per-row arrays
    the caller feeds back as batch inputs (a reinforcement rollout's old log-probabilities): laid out as the
    batch, not replicated, so no all-gather makes them and no copy splits them again. The one place a train
    step is compiled: tasks, benchmarks and the ahead-of-time compile all come here.
    """
    in_shardings = (layout.state_shardings, layout.batch_shardings(batch_shapes),
                    *(jax.tree.map(lambda leaf: leaf.sharding, x) for x in inputs))
    metrics_shardings = layout.replicated
    if per_row_metrics:
        with jax.set_mesh(layout.mesh):
            _, metrics = jax.eval_shape(step, layout.abstract_state(), batch_shapes, *inputs)
        missing = sorted(set(per_row_metrics) - set(metrics))
        if missing:
            raise ValueError(f"compile_step: per_row_metrics {missing} are not among the step's metrics {sorted(metrics)}")
        metrics_shardings = {name: (sharding.batch_sharding(layout.mesh, value.ndim) if name in per_row_metrics
                                    else layout.replicated) for name, value in metrics.items()}
    jitted = jax.jit(step, in_shardings=in_shardings, out_shardings=(layout.state_shardings, metrics_shardings),
                     donate_argnums=(0,))
    with jax.set_mesh(layout.mesh):
        return jitted.lower(layout.abstract_state(), batch_shapes, *inputs).compile()
