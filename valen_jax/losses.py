"""Masked losses. Every loss is driven by an explicit weight array, never by the pad id."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_cross_entropy(logits, targets, weights, z_loss: float = 0.0):
    """Weighted next-token cross-entropy.

    logits: f32 [B, T, V] predicting `targets` [B, T]; weights: f32 [B, T].
    Returns (sum of weighted losses, sum of weights, weighted count of correct argmax), so
    callers can sum over micro-batches or hosts before dividing.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    loss = log_z - target_logit
    if z_loss:
        loss = loss + z_loss * jnp.square(log_z)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(loss * weights), jnp.sum(weights), jnp.sum(correct * weights)
