"""Masked losses. Every loss is driven by an explicit weight or mask array, never by the pad id.

Each loss returns sums (numerator and denominator kept apart) rather than means, so a caller
can add micro-batches or hosts before dividing once: gradient accumulation then equals one
big batch exactly (up to summation order).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp

from valen_jax.config.schema import LOSS_REDUCTIONS  # declared with the config it checks
from valen_jax.models.sharding import constrain, logical_to_spec


def token_cross_entropy(logits, targets, weights, z_loss: float = 0.0):
    """Weighted next-token cross-entropy.

    logits: f32 [B, T, V] predicting `targets` [B, T]; weights: f32 [B, T].
    Returns (sum of weighted losses, sum of weights, weighted count of correct argmax). With
    `z_loss` > 0 the sum includes `z_loss · log(Z)²` per token (see `token_losses`).
    """
    sums = token_losses(logits, targets, weights)
    return sums["ce"] + z_loss * sums["z"], sums["weight"], sums["correct"]


def log_z_and_target_logit(logits, targets) -> tuple[jax.Array, jax.Array]:
    """Per token, in f32: the softmax's log-normaliser log Z and the target's logit (log p(target) is their
    difference). The one home of the token objective's normaliser: the supervised loss and the policy
    ratio of reinforcement runs (`reinforce.objective.token_log_probs`) both read it."""
    logits = logits.astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1), jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def token_losses(logits, targets, weights) -> dict[str, jax.Array]:
    """Weighted sums of the token objective's parts over a batch.

    `ce`: cross-entropy; `z`: log(Z)² of the softmax normaliser (PaLM's z-loss: it keeps the
    logits from drifting upward, which in bf16 costs precision, without changing the argmax);
    `weight`: the supervised-token count; `correct`: weighted argmax hits.
    """
    log_z, target_logit = log_z_and_target_logit(logits, targets)
    correct = (jnp.argmax(logits.astype(jnp.float32), axis=-1) == targets).astype(jnp.float32)
    return {"ce": jnp.sum((log_z - target_logit) * weights), "z": jnp.sum(jnp.square(log_z) * weights),
            "weight": jnp.sum(weights), "correct": jnp.sum(correct * weights)}


# Budget for one chunk's f32 logits on one device: the training loss never holds more of the
# [tokens, V] logits than this (plus about as much again for the backward's softmax − one-hot),
# against 18.5 GiB for the whole logits of one 32k-token row at Qwen's 152k vocabulary. Not
# smaller: every chunk's backward reads and writes the f32 [D, V] head-gradient accumulator, about
# ¾·C FLOP per byte moved for C tokens a chunk, and accelerators need ~200 FLOP/byte (H200: ~1 PFLOP/s
# bf16 over 4.8 TB/s) to stay compute-bound; 128 MiB gives 216 tokens a chunk at V = 152k (1048
# at a 32k vocabulary).
CHUNK_BYTES = 128 * 2**20
# A problem whose whole logits fit in this many bytes per device takes one chunk: no loop, the
# fastest form on CPU (`benchmarks/train_step.py`'s 8×512 tokens × 32k vocabulary, 512 MiB).
SINGLE_CHUNK_BYTES = 512 * 2**20


def coordinate_targets(targets, coordinate_ids, sigma):
    """The soft target of every coordinate-token target: (is_coordinate bool [M], q f32 [M, N]).

    targets int [M]; coordinate_ids int [N]: the vocabulary ids of the coordinate tokens `<0>`..`<N-1>`
    in value order (`data_pipeline.tokenizer.number_token_ids`); sigma: f32 scalar, in token units.
    Row m whose target is `<v>` gets q[m, u] ∝ exp(-(u - v)² / 2σ²) over the N coordinate tokens
    (normalised over them, so a value near the edge keeps its whole mass on the grid); other rows get
    q = 0 (their target stays one-hot). σ below 1e-3 is one-hot exactly (every other weight underflows to 0).
    """
    match = targets[:, None] == coordinate_ids[None, :].astype(targets.dtype)
    is_coordinate = jnp.any(match, axis=-1)
    value = jnp.argmax(match, axis=-1).astype(jnp.float32)
    grid = jnp.arange(coordinate_ids.shape[0], dtype=jnp.float32)
    width = jnp.maximum(jnp.asarray(sigma, jnp.float32), 1e-3)
    q = jax.nn.softmax(-0.5 * jnp.square((grid[None, :] - value[:, None]) / width), axis=-1)
    return is_coordinate, jnp.where(is_coordinate[:, None], q, 0.0)


def head_token_losses(hidden, head, targets, weights, chunk_length: int | None = None,
                      coordinates: tuple | None = None) -> dict[str, jax.Array]:
    """`token_losses(hidden @ head, ...)` for training, token-tiled, with a hand-written backward.

    hidden: [B, T, D] (compute dtype); head: [D, V] (compute dtype); targets int [B, T];
    weights f32 [B, T]. Same `ce`, `z` and `weight` sums and the same gradients as autodiff
    through `token_losses`, without ever holding the whole [B·T, V] logits: the sequence is cut
    into chunks of `chunk_length` positions (all B rows at once, so the batch sharding is kept);
    the forward computes each chunk's logits, its sums and its log-normaliser, and keeps only
    the log-normalisers ([B, T] f32) for the backward, which recomputes each chunk's logits,
    forms softmax − one-hot in one elementwise pass, and accumulates d_hidden chunk by chunk and
    d_head (f32) across chunks. Peak logits memory is one chunk's, O(chunk · V), not O(T · V).
    `chunk_length=None` derives it from `CHUNK_BYTES` (one chunk when the whole problem is within
    `SINGLE_CHUNK_BYTES`); a length that does not divide T leaves a shorter last chunk.

    `correct` counts a hit when the target's logit equals its row's maximum, without a separate
    argmax pass; it differs from `token_losses` only on exact ties (which count as hits here), a
    training-time progress figure; evaluation uses `token_losses`.

    `coordinates=(coordinate_ids int [N], sigma f32 scalar)` (config.loss.coordinate_sigma): a target
    that is a coordinate token `<v>` is scored against the Gaussian `coordinate_targets` over its
    neighbouring values instead of one-hot, `ce` = Σ w·(log Z − Σ_u q_u·logit_u), exactly in the forward and
    the backward (softmax − q). Coordinate tokens are ordered values, but one-hot cross-entropy treats
    `<499>` as as wrong as `<0>` for a target `<500>`, and each of the 1001 rows of the head is trained
    only by the few records whose answer is that exact value; the soft target shares every record's
    gradient with its neighbours, so the head's coordinate rows become a smooth function of the value.
    """
    batch, length, _ = hidden.shape
    if chunk_length is None:
        chunk_length = default_chunk_length(batch, length, head.shape[-1])
    if chunk_length < 1:
        raise ValueError(f"head_token_losses: chunk_length must be ≥ 1, got {chunk_length}")
    if coordinates is not None:
        ids, sigma = coordinates
        coordinates = (jnp.asarray(ids, jnp.int32), jnp.asarray(sigma, jnp.float32))
    return _tiled_losses(hidden, head, targets, weights.astype(jnp.float32), coordinates,
                         min(int(chunk_length), length))


def _batch_shards(batch: int) -> int:
    """Devices the rows are split over (mesh axes of the `batch` rule), 1 outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    axes = logical_to_spec(("batch",))[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    shards = math.prod(mesh.shape[a] for a in axes if a in mesh.shape)
    return shards if batch % shards == 0 else 1


def default_chunk_length(batch: int, length: int, vocab: int) -> int:
    """Sequence positions per chunk so one chunk's f32 logits on one device stay within CHUNK_BYTES."""
    rows = max(1, batch // _batch_shards(batch))
    if rows * length * vocab * 4 <= SINGLE_CHUNK_BYTES:
        return length
    positions = max(1, CHUNK_BYTES // (4 * vocab * rows))
    if positions >= 8:
        positions -= positions % 8  # whole sublanes for the accelerators' matmul tiles
    return min(positions, length)


def _chunk_logits(rows, head):
    return constrain(jnp.dot(rows, head, preferred_element_type=jnp.float32), ("batch", "act_vocab"))


def _chunk_forward(rows, head, targets, weights, coordinates=None):
    """One chunk: rows [M, D], targets/weights [M] → (its four sums, log Z [M], logits [M, V] f32)."""
    logits = _chunk_logits(rows, head)
    row_max = jnp.max(logits, axis=-1)
    log_z = row_max + jnp.log(jnp.sum(jnp.exp(logits - row_max[:, None]), axis=-1))
    target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    hit = (target_logit >= row_max).astype(jnp.float32)
    scored = target_logit
    if coordinates is not None:  # E_q[logit] for coordinate targets: the soft target's cross-entropy
        ids, sigma = coordinates
        is_coordinate, q = coordinate_targets(targets, ids, sigma)
        scored = jnp.where(is_coordinate, jnp.sum(q * jnp.take(logits, ids, axis=-1), axis=-1), target_logit)
    sums = {"ce": jnp.sum((log_z - scored) * weights), "z": jnp.sum(jnp.square(log_z) * weights),
            "weight": jnp.sum(weights), "correct": jnp.sum(hit * weights)}
    return sums, log_z, logits


def _chunk_backward(rows, head, targets, weights, log_z, cotangents, logits=None, coordinates=None, shards: int = 1):
    """One chunk's (d_rows [M, D] in the rows' dtype, d_head [D, V] f32); `logits` recomputed unless given.
    `shards` > 1: d_head per batch shard, [S, D, V] (rows s·M/S .. (s+1)·M/S - 1 in shard s), unsummed."""
    if logits is None:
        logits = _chunk_logits(rows, head)
    # d/dlogits of Σw(log Z − logit_t)·g_ce + Σw·log Z²·g_z  =  softmax·w(g_ce + 2 g_z log Z) − one-hot·w·g_ce
    # (with a soft coordinate target q: − q·w·g_ce on the coordinate tokens instead of the one-hot)
    scale = weights * (cotangents["ce"] + 2.0 * cotangents["z"] * log_z)
    target_scale = weights * cotangents["ce"]
    is_target = jnp.arange(logits.shape[-1], dtype=targets.dtype)[None, :] == targets[:, None]
    if coordinates is not None:
        ids, sigma = coordinates
        is_coordinate, q = coordinate_targets(targets, ids, sigma)
        is_target = is_target & ~is_coordinate[:, None]
    d_logits = jnp.exp(logits - log_z[:, None]) * scale[:, None] - jnp.where(is_target, target_scale[:, None], 0.0)
    if coordinates is not None:
        d_logits = d_logits.at[:, ids].add(-q * target_scale[:, None])
    d_logits = d_logits.astype(rows.dtype)
    d_rows = jnp.dot(d_logits, head.T, preferred_element_type=jnp.float32).astype(rows.dtype)
    # The [D, M] transpose of the rows is materialised (the barrier stops XLA folding it back
    # into the dot): a plain [D, M] @ [M, V] product runs ~9% faster on XLA:CPU than the
    # transposed-operand form, for a copy of only D·M values.
    if shards > 1:
        # Each shard's rows against its own d_logits: no communication inside the loop.
        rows_s = _shard_rows(rows.reshape(shards, -1, rows.shape[-1]), shards)
        d_logits_s = _shard_rows(d_logits.reshape(shards, -1, d_logits.shape[-1]), shards)
        return d_rows, _shard_rows(jnp.einsum("smd,smv->sdv", rows_s, d_logits_s,
                                              preferred_element_type=jnp.float32), shards)
    rows_t = jax.lax.optimization_barrier(rows.T)
    return d_rows, jnp.dot(rows_t, d_logits, preferred_element_type=jnp.float32)


def _pieces(hidden, targets, weights, start, size):
    """Positions [start, start + size) of every row, flattened to [B·size, ...] (start may be traced)."""
    batch, _, dim = hidden.shape

    def take(x, tail):
        return jax.lax.dynamic_slice(x, (0, start) + (0,) * len(tail), (batch, size) + tail)

    return (take(hidden, (dim,)).reshape(batch * size, dim), take(targets, ()).reshape(-1),
            take(weights, ()).reshape(-1))


def _tiled_forward(hidden, head, targets, weights, coordinates, chunk):
    batch, length, dim = hidden.shape
    if chunk == length:
        # One chunk (a small problem): keep its logits for the backward rather than recompute them.
        rows, flat_targets, flat_weights = hidden.reshape(-1, dim), targets.reshape(-1), weights.reshape(-1)
        sums, log_z, logits = _chunk_forward(rows, head, flat_targets, flat_weights, coordinates)
        return sums, (hidden, head, targets, weights, coordinates, log_z, logits)
    count, tail = divmod(length, chunk)

    def one(carry, index):
        rows, chunk_targets, chunk_weights = _pieces(hidden, targets, weights, index * chunk, chunk)
        sums, log_z, _ = _chunk_forward(rows, head, chunk_targets, chunk_weights, coordinates)
        return jax.tree.map(jnp.add, carry, sums), log_z.reshape(batch, chunk)

    zero = {name: jnp.zeros((), jnp.float32) for name in ("ce", "z", "weight", "correct")}
    sums, stacked = jax.lax.scan(one, zero, jnp.arange(count))
    log_z = jnp.moveaxis(stacked, 0, 1).reshape(batch, count * chunk)
    if tail:
        rows, chunk_targets, chunk_weights = _pieces(hidden, targets, weights, count * chunk, tail)
        last, tail_log_z, _ = _chunk_forward(rows, head, chunk_targets, chunk_weights, coordinates)
        sums = jax.tree.map(jnp.add, sums, last)
        log_z = jnp.concatenate([log_z, tail_log_z.reshape(batch, tail)], axis=1)
    return sums, (hidden, head, targets, weights, coordinates, log_z, None)


def _tiled_backward(chunk, residuals, cotangents):
    hidden, head, targets, weights, coordinates, log_z, logits = residuals
    batch, length, dim = hidden.shape
    no_coordinates = None if coordinates is None else (None, None)
    if logits is not None:  # the one-chunk form
        d_rows, d_head = _chunk_backward(hidden.reshape(-1, dim), head, targets.reshape(-1), weights.reshape(-1),
                                         log_z, cotangents, logits, coordinates)
        return d_rows.reshape(hidden.shape), d_head.astype(head.dtype), None, None, no_coordinates
    count, tail = divmod(length, chunk)
    # Under a mesh, d_head is accumulated per batch shard ([S, D, V], the S axis sharded like the rows)
    # and summed over S once after the loop. Accumulated as one [D, V] carry, GSPMD all-reduced every
    # chunk's partial product (a full f32 [D, V] per chunk: 18 of them a step for Qwen2.5-0.5B at 4 x 4k
    # tokens, issue 28's census) and re-gathered the head each chunk; summing the shards once lets XLA
    # reduce-scatter the gradient into the head's own (fsdp) sharding, once a step.
    shards = _batch_shards(batch)
    head = constrain(head, (None, "act_vocab"))  # gathered once for every chunk, not once per chunk

    def grads(carry, start, size):
        d_hidden, d_head = carry
        rows, chunk_targets, chunk_weights = _pieces(hidden, targets, weights, start, size)
        chunk_log_z = jax.lax.dynamic_slice(log_z, (0, start), (batch, size)).reshape(-1)
        d_rows, d_head_part = _chunk_backward(rows, head, chunk_targets, chunk_weights, chunk_log_z, cotangents,
                                              coordinates=coordinates, shards=shards)
        d_hidden = jax.lax.dynamic_update_slice(d_hidden, d_rows.reshape(batch, size, dim), (0, start, 0))
        return d_hidden, d_head + d_head_part

    per_shard = (shards, *head.shape) if shards > 1 else head.shape
    carry = (jnp.zeros(hidden.shape, hidden.dtype), _shard_rows(jnp.zeros(per_shard, jnp.float32), shards))
    carry, _ = jax.lax.scan(lambda c, index: (grads(c, index * chunk, chunk), None), carry, jnp.arange(count))
    if tail:
        carry = grads(carry, count * chunk, tail)
    d_hidden, d_head = carry
    if shards > 1:
        d_head = constrain(jnp.sum(d_head, axis=0), ("embed", "vocab"))
    return d_hidden, d_head.astype(head.dtype), None, None, no_coordinates


def _shard_rows(x, shards: int):
    """The per-batch-shard axis of a [S, ...] accumulator on the batch's mesh axes (nothing for S = 1)."""
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1)) if shards > 1 else x


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _tiled_losses(hidden, head, targets, weights, coordinates, chunk):
    return _tiled_forward(hidden, head, targets, weights, coordinates, chunk)[0]


_tiled_losses.defvjp(_tiled_forward, _tiled_backward)


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
