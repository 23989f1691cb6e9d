"""The VFlash drafter's objective: which blocks a step trains on, their position-decayed loss, and the
train step that fits the drafter to a frozen target (`valen_jax.vflash.task.DrafterTask` compiles it).

The target's head scores the drafter's mask slots through the same token-tiled `head_token_losses` the
token objective uses (no [B·A·K, V] logits are held); the target's parameters come in as an argument,
never in the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from valen_jax.models.drafter import draft_hidden
from valen_jax.training.losses import head_token_losses
from valen_jax.training.step import micro_batches


def position_weights(block_size: int, decay: float):
    """f32 [block_size]: w_k = exp(-(k-1)/decay) for block position k = 1…B (DFlash's decay, γ = 7 for B = 16).

    A drafted block is accepted up to its first miss, so position k only counts when positions 1…k-1
    were right: early positions carry most of the acceptance length and get most of the weight.
    """
    return jnp.exp(-jnp.arange(block_size, dtype=jnp.float32) / float(decay))


def drafter_targets(draft_block, targets, target_weights, anchors_per_row: int, block_size: int, key):
    """The blocks a drafter step trains on: (anchors [B, A], block targets [B, A, K], block weights [B, A, K]).

    draft_block int [B, T]: k ≥ 1 where `targets[t]` is the k-th token of a primitive block announced by an
    `atomic_decoding` call (the batch field `draft_block`), 0 elsewhere. An anchor is a row index p with
    draft_block[p] ≥ 1: the drafter sees tokens[p] (the last committed token) and predicts targets[p],
    targets[p+1], … (block position k = 1…K). Every block's first anchor (the token before its first
    token, draft_block = 1) is taken first, then anchors inside blocks (where drafting restarts after a
    partial acceptance) at random from `key`, A = `anchors_per_row` (capped at T) in all; unfilled anchors
    weigh 0. Block position k of anchor p weighs `target_weights[p+k-1]` (0 on coordinates that
    atom_loss_masks removes) while p+k-1 stays inside the anchor's block, else 0.
    """
    batch, length = draft_block.shape
    count = min(int(anchors_per_row), length)
    draft_block = draft_block.astype(jnp.int32)
    noise = jax.random.uniform(key, (batch, length))
    score = jnp.where(draft_block == 1, 2.0 + noise, 1.0 + noise)
    score = jnp.where(draft_block >= 1, score, -1.0)
    chosen, anchors = jax.lax.top_k(score, count)
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    where = anchors[..., None] + offsets  # [B, A, K]
    inside = where < length
    where = jnp.minimum(where, length - 1)

    def gather(x):
        return jnp.take_along_axis(x, where.reshape(batch, -1), axis=1).reshape(where.shape)

    start = jnp.take_along_axis(draft_block, anchors, axis=1)
    same_block = inside & (gather(draft_block) == start[..., None] + offsets) & (chosen[..., None] > 0)
    weights = jnp.where(same_block, gather(target_weights.astype(jnp.float32)), 0.0)
    return anchors.astype(jnp.int32), gather(targets), weights


def drafter_losses(hidden, head, block_targets, block_weights, decay: float) -> dict[str, jax.Array]:
    """Sums of the drafter objective: hidden [B, A, K, D] (the drafter's mask slots), head [D, V] (the
    target's), block targets/weights [B, A, K] (`drafter_targets`).

    `ce`: Σ w_k · weight · cross-entropy; `weight`: Σ w_k · weight (the denominator, fixed by the batch);
    `correct` and `count` [K]: per block position, argmax hits and supervised positions (unweighted by
    w_k), from which `acceptance_length` reads. Each position's logits go through the token-tiled
    `head_token_losses`, so no [B·A·K, V] logits are ever held.
    """
    size = hidden.shape[2]
    decays = position_weights(size, decay)
    parts = [head_token_losses(hidden[:, :, k], head, block_targets[:, :, k], block_weights[:, :, k])
             for k in range(size)]
    ce = sum(decays[k] * part["ce"] for k, part in enumerate(parts))
    weight = sum(decays[k] * part["weight"] for k, part in enumerate(parts))
    return {"ce": ce, "weight": weight, "correct": jnp.stack([part["correct"] for part in parts]),
            "count": jnp.stack([part["weight"] for part in parts])}


def acceptance_length(correct, count):
    """Expected drafted tokens accepted per block, τ = Σ_k Π_{j≤k} acc_j with acc_j = correct_j / count_j.

    The batch's per-position accuracies taken as independent acceptance probabilities; the bonus token
    the target adds after every verification is not counted (tokens per target pass = τ + 1). A
    position with nothing supervised counts as a miss.
    """
    accuracy = jnp.where(count > 0, correct / jnp.maximum(count, 1e-9), 0.0)
    return jnp.sum(jnp.cumprod(accuracy))



@dataclass(frozen=True)
class DrafterOptions:
    """What shapes the drafter objective (config.model.drafter, config.loss, config.train)."""

    block_size: int = 16
    anchors_per_row: int = 64
    position_decay: float = 7.0
    weight: float = 1.0  # config.loss.weights.drafter
    grad_accum_steps: int = 1
    seed: int = 0

    @classmethod
    def from_config(cls, config) -> DrafterOptions:
        drafter = config.model.drafter
        return cls(block_size=int(drafter.block_size), anchors_per_row=int(drafter.anchors_per_row), position_decay=float(drafter.position_decay),
                   weight=float(config.loss.weights["drafter"]), grad_accum_steps=int(config.train.grad_accum_steps),
                   seed=int(config.train.seed))


def make_drafter_train_step(graphdef, target_graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                            options: DrafterOptions) -> Callable:
    """train_step(state, batch, target_params) → (state, metrics) for `vflash` mode.

    `state` holds the drafter alone; the target's parameters come in as an argument, so they are never
    in the optimizer, never donated and never written (bitwise unchanged). The anchors are drawn from the
    whole batch before any micro-batch split (a function of the batch, the seed and the step only), so
    accumulation equals one big batch, as for the token objective.
    """
    accum = int(options.grad_accum_steps)

    def sums_of(params, target_params, micro):
        drafter = nnx.merge(graphdef, params)
        target = nnx.merge(target_graphdef, target_params)
        hidden = draft_hidden(drafter, target, micro, micro["draft_anchors"])
        return drafter_losses(hidden, jax.lax.stop_gradient(target.head_matrix()), micro["draft_targets"],
                              micro["draft_weights"], options.position_decay)

    def train_step(state, batch, target_params):
        key = jax.random.fold_in(jax.random.key(options.seed), state["step"])
        size = options.block_size
        anchors, targets, weights = drafter_targets(batch["draft_block"], batch["targets"], batch["target_weights"],
                                                    options.anchors_per_row, size, key)
        batch = {**batch, "draft_anchors": anchors, "draft_targets": targets, "draft_weights": weights}
        decays = position_weights(size, options.position_decay)
        # Fixed by the batch alone (never by the parameters): an all-zero-weight batch gives loss 0, not NaN.
        denominator = jnp.maximum(jnp.sum(jnp.sum(weights, axis=(0, 1)) * decays), 1e-9)

        def micro_loss(params, micro):
            sums = sums_of(params, target_params, micro)
            return options.weight * sums["ce"] / denominator, sums

        grad_fn = jax.grad(micro_loss, has_aux=True)
        if accum == 1:
            grads, sums = grad_fn(state["params"], batch)
        else:
            def body(carry, micro):
                grads, sums = grad_fn(state["params"], micro)
                return jax.tree.map(jnp.add, carry, (grads, sums)), None

            micros = micro_batches(batch, accum)
            shapes = jax.eval_shape(sums_of, state["params"], target_params, jax.tree.map(lambda x: x[0], micros))
            zeros = (jax.tree.map(jnp.zeros_like, state["params"]),
                     jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
            (grads, sums), _ = jax.lax.scan(body, zeros, micros)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        loss = sums["ce"] / denominator
        accuracy = sums["correct"] / jnp.maximum(sums["count"], 1.0)
        metrics = {"loss": options.weight * loss, "loss_drafter": loss, "grad_norm": optax.tree.norm(grads),
                   "learning_rate": schedule(state["step"]),
                   "accuracy": jnp.sum(sums["correct"]) / jnp.maximum(jnp.sum(sums["count"]), 1.0),
                   "drafter_acceptance_length": acceptance_length(sums["correct"], sums["count"]),
                   "drafter_anchors": jnp.sum(weights[:, :, 0] > 0).astype(jnp.float32),
                   **{f"drafter_accuracy_{k + 1}": accuracy[k] for k in range(size)}}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return train_step
