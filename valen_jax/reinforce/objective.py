"""Group-relative advantages and the clipped policy-gradient loss (GRPO family).

Normalisation: DAPO's token-level form — the clipped per-token terms are summed over every
completion token of the batch and divided by the number of those tokens. GRPO's per-sequence mean
weights a token of a short completion more than one of a long one (a length bias Dr.GRPO points
out); the token-level sum treats every sampled token alike and still keeps the loss's scale
independent of batch size. Pure jnp: traced into the compiled update, nothing host-chosen.
"""

from __future__ import annotations

import jax.numpy as jnp

from valen_jax.decoding.sampling import mask_vocab
from valen_jax.training.losses import log_z_and_target_logit


def group_advantages(rewards, group_size: int, scale_by_std: bool = True, eps: float = 1e-6):
    """rewards [B*G] (groups contiguous) -> advantages [B*G]: reward minus its group's mean,
    divided by the group's std when scale_by_std (GRPO; Dr.GRPO sets it False)."""
    r = rewards.reshape(-1, group_size)
    a = r - r.mean(axis=1, keepdims=True)
    if scale_by_std:
        a = a / (r.std(axis=1, keepdims=True) + eps)
    return a.reshape(-1)


def clipped_loss(logp, old_logp, advantages, mask, clip_eps: float, ref_logp=None, kl_coef: float = 0.0):
    """logp/old_logp/ref_logp/mask [N, K] (each row's completion window); advantages [N]. Returns (loss, stats).

    Per token: -min(ratio*A, clip(ratio, 1-eps, 1+eps)*A); the KL to the reference is the k3
    estimator exp(ref-logp) - (ref-logp) - 1, added with kl_coef."""
    mask = mask.astype(logp.dtype)
    ratio = jnp.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -jnp.minimum(unclipped, clipped)
    tokens = jnp.maximum(mask.sum(), 1.0)
    stats = {"clip_fraction": ((clipped < unclipped) * mask).sum() / tokens}  # where the clip bound the term
    if ref_logp is not None:
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
        stats["kl"] = (kl * mask).sum() / tokens
    return (per_token * mask).sum() / tokens, stats


def token_log_probs(logits, targets, temperature: float = 1.0, vocab: int | None = None):
    """Per-token log p(target) [B, T] from logits [B, T, V], under the distribution the rollout sampled
    from: the ids the decode engine never produces (>= `vocab`, the embedding's padding rows) removed and
    the logits divided by the sampling `temperature`, as `decoding.sampling` does before it draws. The
    ratio and its gradient are then those of the policy that drew the completions; with the raw logits a
    temperature other than 1 would clip and differentiate another policy's probabilities (TRL's
    GRPOTrainer divides by its temperature too). top-p is not applied: a later policy's nucleus differs,
    and a token outside it would get log p = -inf. Per token, with the same f32 log-normaliser as
    `training.losses.token_losses`' `ce`, because the policy-gradient ratio needs each one."""
    if vocab is not None:
        logits = mask_vocab(logits, vocab)
    log_z, target_logit = log_z_and_target_logit(logits.astype(jnp.float32) / temperature, targets)
    return target_logit - log_z
