"""Masked losses. Every loss is driven by an explicit weight or mask array, never by the pad id.

Each loss returns sums (numerator and denominator kept apart) rather than means, so a caller
can add micro-batches or hosts before dividing once: gradient accumulation then equals one
big batch exactly (up to summation order).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from valen_jax.sharding import constrain

OBJECTIVES = ("tokens", "branches", "drafter")
LOSS_REDUCTIONS = ("state_mean", "question_mean")


def token_cross_entropy(logits, targets, weights, z_loss: float = 0.0):
    """Weighted next-token cross-entropy.

    logits: f32 [B, T, V] predicting `targets` [B, T]; weights: f32 [B, T].
    Returns (sum of weighted losses, sum of weights, weighted count of correct argmax). With
    `z_loss` > 0 the sum includes `z_loss · log(Z)²` per token (see `token_losses`).
    """
    sums = token_losses(logits, targets, weights)
    return sums["ce"] + z_loss * sums["z"], sums["weight"], sums["correct"]


def token_losses(logits, targets, weights) -> dict[str, jax.Array]:
    """Weighted sums of the token objective's parts over a batch.

    `ce`: cross-entropy; `z`: log(Z)² of the softmax normaliser (PaLM's z-loss: it keeps the
    logits from drifting upward, which in bf16 costs precision, without changing the argmax);
    `weight`: the supervised-token count; `correct`: weighted argmax hits.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {"ce": jnp.sum((log_z - target_logit) * weights), "z": jnp.sum(jnp.square(log_z) * weights),
            "weight": jnp.sum(weights), "correct": jnp.sum(correct * weights)}


def head_token_losses(hidden, head, targets, weights) -> dict[str, jax.Array]:
    """`token_losses(hidden @ head, ...)` for training, with a hand-written backward.

    hidden: [B, T, D] (compute dtype); head: [D, V] (compute dtype); targets int [B, T];
    weights f32 [B, T]. Same `ce`, `z` and `weight` sums and the same gradients as autodiff
    through `token_losses`, in fewer passes over the [B·T, V] logits, which dominate the memory
    traffic of a small model's step: the forward takes the row maximum once (for the
    normaliser and the hit count), and the backward forms softmax − one-hot in one elementwise
    pass (autodiff scatters the one-hot into a separate buffer and transposes it) before the two
    matmuls. `correct` counts a hit when the target's logit equals its row's maximum, without a
    separate argmax pass; it differs from `token_losses` only on exact ties (which count as
    hits here), a training-time progress figure; evaluation uses `token_losses`.
    """
    return _head_token_losses(hidden, head, targets, weights.astype(jnp.float32))


def _head_forward(hidden, head, targets, weights):
    rows = hidden.reshape(-1, hidden.shape[-1])
    logits = constrain(jnp.dot(rows, head, preferred_element_type=jnp.float32), ("batch", "act_vocab"))
    flat_targets, flat_weights = targets.reshape(-1), weights.reshape(-1)
    row_max = jnp.max(logits, axis=-1)
    log_z = row_max + jnp.log(jnp.sum(jnp.exp(logits - row_max[:, None]), axis=-1))
    target_logit = jnp.take_along_axis(logits, flat_targets[:, None], axis=-1)[:, 0]
    hit = (target_logit >= row_max).astype(jnp.float32)
    sums = {"ce": jnp.sum((log_z - target_logit) * flat_weights), "z": jnp.sum(jnp.square(log_z) * flat_weights),
            "weight": jnp.sum(flat_weights), "correct": jnp.sum(hit * flat_weights)}
    return sums, (rows, head, logits, log_z, flat_targets, flat_weights, hidden.shape)


def _head_backward(residuals, cotangents):
    rows, head, logits, log_z, targets, weights, hidden_shape = residuals
    # d/dlogits of Σw(log Z − logit_t)·g_ce + Σw·log Z²·g_z  =  softmax·w(g_ce + 2 g_z log Z) − one-hot·w·g_ce
    scale = weights * (cotangents["ce"] + 2.0 * cotangents["z"] * log_z)
    target_scale = weights * cotangents["ce"]
    is_target = jnp.arange(logits.shape[-1], dtype=targets.dtype)[None, :] == targets[:, None]
    d_logits = jnp.exp(logits - log_z[:, None]) * scale[:, None] - jnp.where(is_target, target_scale[:, None], 0.0)
    d_logits = d_logits.astype(rows.dtype)
    d_rows = jnp.dot(d_logits, head.T, preferred_element_type=jnp.float32).astype(rows.dtype)
    # The [D, N] transpose of the rows is materialised (the barrier stops XLA folding it back
    # into the dot): a plain [D, N] @ [N, V] product runs ~9% faster on XLA:CPU than the
    # transposed-operand form, for a copy of only D·N values.
    rows_t = jax.lax.optimization_barrier(rows.T)
    d_head = jnp.dot(rows_t, d_logits, preferred_element_type=jnp.float32).astype(head.dtype)
    return d_rows.reshape(hidden_shape), d_head, None, None


@jax.custom_vjp
def _head_token_losses(hidden, head, targets, weights):
    return _head_forward(hidden, head, targets, weights)[0]


_head_token_losses.defvjp(_head_forward, _head_backward)


def branch_cross_entropy(log_probs, labels, labeled):
    """Cross-entropy of each question's branch distribution against its soft label.

    log_probs: f32 [B, Q, K] (−inf on absent branches, as `heads.branch_log_probs` gives);
    labels: f32 [B, Q, K] probabilities (0 on absent branches); labeled: bool [B, Q].
    Returns f32 [B, Q]: −Σ_k p_k log q_k for labeled questions, 0 for the others (seed 000:
    unlabeled questions do not count toward the loss).
    """
    # 0 · (−inf) is NaN: take only branches the label gives mass to. A label never puts mass on
    # an absent branch (the reader checks labels cover exactly the candidates).
    terms = jnp.where(labels > 0, labels * jnp.where(labels > 0, log_probs, 0.0), 0.0)
    return jnp.where(labeled, -jnp.sum(terms, axis=-1), 0.0)


def reduce_question_losses(losses, labeled, reduction: str, state_ids=None) -> tuple[jax.Array, jax.Array]:
    """(numerator, denominator) of Valen's `loss_reduction` over a batch's question losses.

    losses: f32 [B, Q]; labeled: bool [B, Q]; state_ids: int [B, Q] or None. A state is one
    record (seed 000, "Labels and missing values"): its questions share a state id within a
    row, so a row packing several records gives each its own id; None means each row is one
    state. Ids are compared for equality only, so any integers work.

    `state_mean` (seed 000's default): average question losses within each state, then over
    states with at least one labeled question: numerator Σ_states mean, denominator #states.
    `question_mean`: numerator Σ losses, denominator #labeled questions.
    Both parts add over micro-batches (rows never span micro-batches); divide with
    `mean_of`, which gives 0 when nothing is labeled.
    """
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction {reduction!r}; choose one of {', '.join(LOSS_REDUCTIONS)}")
    labeled = labeled.astype(bool)
    losses = jnp.where(labeled, losses.astype(jnp.float32), 0.0)
    if reduction == "question_mean":
        return jnp.sum(losses), jnp.sum(labeled.astype(jnp.float32))
    if state_ids is None:
        state_ids = jnp.zeros(labeled.shape, jnp.int32)
    # For each question q: n_q = labeled questions in q's state. Σ_q loss_q / n_q over labeled q
    # is Σ_states (state mean), and Σ_q 1 / n_q is the number of labeled states. O(Q²) per row;
    # Q is a handful of questions, and no bound on the ids is needed.
    same_state = state_ids[:, :, None] == state_ids[:, None, :]
    n = jnp.sum(same_state & labeled[:, None, :], axis=-1).astype(jnp.float32)
    share = jnp.where(labeled, 1.0 / jnp.maximum(n, 1.0), 0.0)
    return jnp.sum(losses * share), jnp.sum(share)


def mean_of(numerator, denominator):
    """numerator / denominator, and 0 (not NaN) for an empty denominator."""
    return numerator / jnp.maximum(denominator, 1e-9) * (denominator > 0)


def combine(objectives: Mapping[str, jax.Array], weights: Mapping[str, float]) -> jax.Array:
    """Σ weight · objective over the objectives present; weights must name every objective.

    An objective with a positive weight that the batch cannot provide is an error rather than a
    silent zero (train.py checks this when it compiles the step).
    """
    unknown = set(objectives) - set(weights)
    if unknown:
        raise ValueError(f"no loss weight for objective(s) {sorted(unknown)}")
    missing = [name for name, w in weights.items() if w > 0 and name not in objectives]
    if missing:
        raise ValueError(f"loss weight > 0 for {', '.join(missing)}, but this model/batch does not provide "
                         f"{'it' if len(missing) == 1 else 'them'}; set config.loss.weights.{missing[0]}=0")
    return sum(float(weights[name]) * value for name, value in objectives.items())
