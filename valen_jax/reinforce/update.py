"""The compiled halves of a reinforcement step: per-token log-probabilities of sampled completions, and
one optimizer update on the clipped objective (`reinforce.objective`).

A rollout batch holds N = P·G rows of `config.data.seq_len` tokens: prompt then completion, right-padded,
and each row's completion window (`rollout.training_rows`): from `completion_start`, K =
config.rl.max_new_tokens positions whose next tokens are `targets` [N, K], `mask` 1 on the sampled ones
(the stop token included: the policy learns to stop), so the loss reads exactly the sampled tokens.

Only the window's hidden states are projected to the vocabulary: the prompt's positions need no logits.
That is K of T positions of the output projection and its f32 log-normaliser, forward and backward
(5 of 24 in configs/reinforce.py, where the projection over ~2.1k ids costs about as much as both
layers); for a 150k-id vocabulary it is also the [N, T, V] f32 logits that no longer exist (7.5 GB for
512 rows of 24 positions), where a GPU/TPU update would hold them. Shapes are fixed by the config, so
each function compiles once per run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from valen_jax.reinforce.objective import clipped_loss, token_log_probs
from valen_jax.training.step import apply_update, frozen_partition, whole_gradient

# What `rollout.training_rows` gives, per row: the arrays the update reads, besides the advantages.
SEQUENCE_KEYS = ("tokens", "positions", "segment_ids", "completion_start", "targets", "mask")


def sequence_log_probs(graphdef, params, batch, temperature: float, vocab: int | None) -> jax.Array:
    """f32 [N, K]: log p(targets[k] | tokens up to completion_start + k) under `params`, as the rollout's
    sampler draws (`temperature`, ids < `vocab`: `objective.token_log_probs`). Window positions past the
    row's end (mask 0) read its last position: their values are not used."""
    model = nnx.merge(graphdef, params)
    hidden = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
    window = batch["targets"].shape[1]
    at = jnp.minimum(batch["completion_start"][:, None] + jnp.arange(window), hidden.shape[1] - 1)
    picked = jnp.take_along_axis(hidden, at[:, :, None], axis=1)
    return token_log_probs(model.logits(picked), batch["targets"], temperature, vocab)


def make_log_probs(graphdef, temperature: float, vocab: int | None):
    """(params, batch) -> f32 [N, K]: the old (rollout-time) and the reference log-probabilities."""
    return jax.jit(lambda params, batch: sequence_log_probs(graphdef, params, batch, temperature, vocab))


def make_update(graphdef, tx: optax.GradientTransformation, schedule, frozen, clip_epsilon: float,
                kl_coef: float, updates_per_step: int, temperature: float, vocab: int | None):
    """(state, batch) -> (state, metrics): one optimizer update on the clipped objective. `state["step"]`
    is left alone: the run's step counts rollouts, the optimizer its own updates (`updates_per_step` per
    rollout, its schedule stretched to match: `tasks.reinforce`); log-probabilities are the sampler's
    (`temperature`, ids < `vocab`), as `make_log_probs`' old ones must be. `batch` holds SEQUENCE_KEYS,
    `advantages` [N], with kl_coef > 0 `ref_logp` [N, K], and `old_logp` [N, K] for every update but a
    rollout's first.

    A rollout's first update runs on the params that sampled it, so its own forward pass gives the old
    log-probabilities: without `old_logp` in `batch` it takes them from that pass (no gradient through
    them: the ratio is 1, its gradient the policy gradient's) and returns them as metrics["old_logp"]
    for the updates after it. That saves the separate forward TRL and a naive loop run per rollout
    (1/7 of a rollout's update compute at 2 updates per rollout)."""
    split, join = frozen_partition(frozen)

    def loss_of(trained, frozen_leaves, treedef, batch):
        logp = sequence_log_probs(graphdef, join(trained, frozen_leaves, treedef), batch, temperature, vocab)
        old_logp = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)
        loss, stats = clipped_loss(logp, old_logp, batch["advantages"], batch["mask"], clip_epsilon,
                                   ref_logp=batch.get("ref_logp"), kl_coef=kl_coef)
        return loss, (stats, old_logp)

    def update(state, batch):
        trained, frozen_leaves, treedef = split(state["params"])
        (loss, (stats, old_logp)), grads = jax.value_and_grad(loss_of, has_aux=True)(trained, frozen_leaves,
                                                                                    treedef, batch)
        grads = whole_gradient(grads, frozen_leaves, join, treedef)
        params, opt_state = apply_update(tx, grads, state, split, join)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **stats}
        if "old_logp" not in batch:
            metrics["old_logp"] = old_logp
        if schedule is not None:
            metrics["learning_rate"] = schedule(state["step"] * updates_per_step)
        return {"params": params, "opt_state": opt_state, "step": state["step"]}, metrics

    return update
