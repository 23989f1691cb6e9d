"""Drafters that run on the device, inside the decode loop (`decoding.loop`).

A device drafter is a pair: a `rule` (a frozen, hashable description: it keys the compiled programs)
and `params` (its arrays, passed as an argument so new weights never recompile). A rule says which of
the target's layers it reads (`collect`), the most tokens one pass proposes (`block_size`, None: as
many as asked), and three pure functions the loop calls:

- `init(params, features, positions, length)`: its state after the prompt's prefill;
- `absorb(params, state, features, positions, cursor)`: the state after the target processed T more
  tokens per row at slots cursor .. cursor + T - 1 (a decode step, or a verify pass: the rejected
  tail lies above the committed length and is overwritten before anything reads it, as in the
  target's KV cache);
- `draft(params, state, target, last, position, cursor, produced, keys, width)`: int32 tokens [B, width]
  following each row's last committed token `last` (slot `cursor`, 1-D `position`), and q [B, width, V]
  (the drafter's distribution, for rejection sampling) or None for a deterministic drafter.
  `produced` [B]: output tokens each row committed so far (a scripted drafter's index); `keys` [B]: one
  PRNG key per row (a row's proposals do not depend on the batch it is in).

`TrainedRule` is the VFlash block drafter with its context cache: the fused target features are
turned into each drafter layer's context keys/values ONCE per token and kept in a static cache
([L_d, B, K, S, H], `kv_cache` layout). Why keys/values rather than the fused features [B, S, D]:
features would have to be fused, normed and projected to every layer's keys/values over the whole
context on every pass (O(S·D·K·H) per pass); cached keys/values leave a pass one small forward over
its B + 1 slots, whose attention reads the cache (O(S·K·H) per slot). It costs L_d·2·K·H per slot
against D: equal for one layer without grouped heads, less with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from valen_jax.decoding.sampling import mask_vocab
from valen_jax.decoding.verification import first_argmax


@dataclass(frozen=True)
class TrainedRule:
    """A `models.drafter.Drafter` drafting against its cached context (`Drafter.draft_cached`)."""

    graphdef: nnx.GraphDef
    collect: tuple[int, ...]  # the drafter's target_layers
    block_size: int
    vocab: int

    def init(self, params, features, positions, length: int):
        return nnx.merge(self.graphdef, params).context_cache(features, positions, length)

    def absorb(self, params, state, features, positions, cursor):
        return nnx.merge(self.graphdef, params).write_context(state, features, positions, cursor)

    def draft(self, params, state, target, last, position, cursor, produced, keys, width: int):
        drafter = nnx.merge(self.graphdef, params)
        anchor = jnp.take(target.embed[...], last, axis=0)  # the target's frozen embedding, as in training
        hidden = drafter.draft_cached(state, cursor, anchor, position)[:, :width]  # [B, width, D]
        logits = jnp.einsum("bsd,dv->bsv", hidden, target.head_matrix(), preferred_element_type=jnp.float32)
        return first_argmax(mask_vocab(logits, self.vocab)), None


class _Stateless:
    """A rule that reads no target features: no drafter state to build or to absorb into."""

    def init(self, params, features, positions, length: int):
        return ()

    def absorb(self, params, state, features, positions, cursor):
        return state


@dataclass(frozen=True)
class ScriptRule(_Stateless):
    """Proposes a given continuation (params: int32 [N], or [B, N] one per row) at each row's output
    index: with the target's own greedy output it is the oracle, whose drafting costs a slice (the
    speed-up ceiling)."""

    collect: tuple[int, ...] = ()
    block_size: int | None = None

    def draft(self, params, state, target, last, position, cursor, produced, keys, width: int):
        script = jnp.broadcast_to(params, (last.shape[0], params.shape[-1]))
        # Padded so a slice near the end is not shifted back (dynamic_slice clamps its start).
        script = jnp.pad(script, ((0, 0), (0, width)))
        tokens = jax.vmap(lambda s, p: jax.lax.dynamic_slice(s, (p,), (width,)))(script, produced)
        return tokens.astype(jnp.int32), None


@dataclass(frozen=True)
class UniformRule(_Stateless):
    """Uniform random tokens in [0, vocab) from each row's key, q uniform: the worst honest drafter."""

    vocab: int
    collect: tuple[int, ...] = ()
    block_size: int | None = None

    def draft(self, params, state, target, last, position, cursor, produced, keys, width: int):
        rows, logits_width = last.shape[0], target.cfg.vocab_size
        tokens = jax.vmap(lambda k: jax.random.randint(k, (width,), 0, self.vocab, jnp.int32))(keys)
        q = jnp.where(jnp.arange(logits_width) < self.vocab, 1.0 / self.vocab, 0.0).astype(jnp.float32)
        return tokens, jnp.broadcast_to(q, (rows, width, logits_width))
