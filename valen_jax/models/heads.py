"""Scored-branch heads for Valen questions (seed 000, "Records and questions").

Every candidate of a question is a branch (choice: one per candidate name, in input order or
shuffled with its label; noul: two branches, "true" first; score: one per grade, list order).
The head reads one scalar at each branch's scoring position (its last token); a softmax over
a question's branches gives the candidate probabilities that the soft labels train.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from valen_jax.models.layers import param


class ScoreHead(nnx.Module):
    def __init__(self, dim: int, param_dtype, rngs: nnx.Rngs):
        self.kernel = param(rngs, (dim,), ("embed",), param_dtype)
        self.bias = param(rngs, (), (), param_dtype, init="zeros")

    def __call__(self, hidden):
        """hidden [..., D] → f32 scores [...]."""
        return (jnp.einsum("...d,d->...", hidden.astype(jnp.float32), self.kernel[...].astype(jnp.float32))
                + self.bias[...].astype(jnp.float32))


def branch_log_probs(scores, score_positions, branch_mask):
    """Log-softmax over each question's branches.

    scores: f32 [B, T] per-token scalar scores; score_positions: int32 [B, Q, K] token index of
    each branch's scoring position; branch_mask: bool [B, Q, K] (False for absent branches).
    Returns f32 [B, Q, K], -inf where a branch is absent, 0 for questions with no branch.
    """
    batch = scores.shape[0]
    gathered = jnp.take_along_axis(scores, score_positions.reshape(batch, -1).clip(0), axis=1)
    gathered = jnp.where(branch_mask, gathered.reshape(score_positions.shape), -jnp.inf)
    any_branch = branch_mask.any(axis=-1, keepdims=True)
    safe = jnp.where(any_branch, gathered, 0.0)
    log_probs = jax.nn.log_softmax(safe, axis=-1)
    return jnp.where(branch_mask, log_probs, jnp.where(any_branch, -jnp.inf, 0.0))
