"""The compiled programs of `slots.SlotEngine` over its cache, one `KVCache` of [L, S, K, C, H] (S slots,
C = the model's context), each with static shapes, so an accelerator runs the same executables for the
whole life of the server:

- `prefill` of one prompt, right-padded to its length bucket (`engine.bucket`), written into a chosen
  slot of the shared cache (the cache donated: updated in place), → the logits at its last token;
  compiled once per prompt bucket;
- `decode`: `steps_per_sync` tokens for every slot in one scan of `Transformer.decode_step` (each slot
  its own cursor and position, its own stop and budget, its own temperature, top-k and top-p on the
  device), the cache donated; compiled once per (slot rows, cache prefix, `SamplingKind`: greedy, or
  sampled with or without each of top-k and top-p), whatever numbers the clients send. An empty or finished slot still
  occupies its lane (static shapes); its writes land in its own row, which the next prefill into it
  replaces whole;
- `choose`: the first token of each new request from its prompt's logits (`sampling.sample_rows`), once
  per `SamplingKind`;
- `copy_rows`: slot rows of the cache copied into other slots (the cache donated): requests admitted in
  one round with the same prompt (a request's `n` choices, or equal prompts of different requests) are
  prefilled once, and the others' slots receive its rows; each draws its first token from the same
  logits with its own key. Compiled per power-of-two count of copies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from valen_jax.decoding import loop
from valen_jax.decoding.sampling import RowSampling, SamplingKind, sample_rows
from valen_jax.models.kv_cache import KVCache


@functools.cache
def cache_programs(graphdef, vocab: int, cache_length: int):
    def prefill(params, cache, tokens, positions, lengths, slots, vision):
        """New requests [A, P] into their slots (a padding row's slot is out of range: dropped); `vision`
        (patches, their positions and segments, padded) or None: a separate program for image prompts."""
        model = nnx.merge(graphdef, params)
        logits, rows = model.prefill(tokens, positions, lengths, cache_length, vision)
        keys = cache.keys.at[:, slots].set(rows.keys, mode="drop")
        values = cache.values.at[:, slots].set(rows.values, mode="drop")
        return logits, KVCache(keys, values)

    def copy_rows(cache, sources, targets):
        """Slot rows `sources` into slots `targets` (a padding entry's target is out of range: dropped)."""
        return KVCache(*(x.at[:, targets].set(x[:, sources], mode="drop") for x in cache))

    def empty(params, slots):
        model = nnx.merge(graphdef, params)
        tokens = jnp.zeros((slots, 1), jnp.int32)
        return model.prefill(tokens, tokens, jnp.ones(slots, jnp.int32), cache_length)[1]

    return (jax.jit(prefill, donate_argnums=(1,)), jax.jit(empty, static_argnums=(1,)),
            jax.jit(copy_rows, donate_argnums=(0,)))


@functools.cache
def decoder(graphdef, vocab: int, kind: SamplingKind, steps: int, rows: int, length: int):
    """`steps` decode steps of slots [0, rows) over cache positions [0, length) in one program (the
    other slots and positions untouched): the rows not `live` (free or finished) keep their token and
    cursor, and rewrite the same keys/values at their cursor. `sampling`: every slot's (`sampling.sampling_rows`),
    of `kind`."""
    def decode(params, cache, last, cursor, offsets, seeds, choices, counts, live, budgets, stop_ids,
               sampling: RowSampling):
        model = nnx.merge(graphdef, params)
        full = cache
        cache = KVCache(full.keys[:, :rows, :, :length], full.values[:, :rows, :, :length])
        last, cursor, offsets, seeds, choices, counts, live, budgets, sampling = jax.tree.map(
            lambda x: x[:rows], (last, cursor, offsets, seeds, choices, counts, live, budgets, sampling))

        def step(carry, _):
            cache, last, cursor, counts, live = carry
            # A generated token's position is its slot plus the prompt's offset (0 but for M-RoPE media).
            logits, cache = model.decode_step(last, cursor + offsets, cache, cursor)
            token = sample_rows(logits, jax.vmap(loop.token_key)(seeds, choices, counts), sampling, vocab)
            token = jnp.where(live, token, last)
            moved = live.astype(jnp.int32)
            counts = counts + moved
            live = live & ~jnp.isin(token, stop_ids) & (counts < budgets)
            return (cache, token, cursor + moved, counts, live), token

        (cache, *_), tokens = jax.lax.scan(step, (cache, last, cursor, counts, live), None, length=steps)
        keys = jax.lax.dynamic_update_slice(full.keys, cache.keys, (0, 0, 0, 0, 0))
        values = jax.lax.dynamic_update_slice(full.values, cache.values, (0, 0, 0, 0, 0))
        return tokens, KVCache(keys, values)

    return jax.jit(decode, donate_argnums=(1,))


@functools.cache
def chooser(kind: SamplingKind, vocab: int):
    def choose(logits, rows, seeds, choices, counts, sampling: RowSampling):
        """One token per entry from logits row `rows[i]` with entry i's own key and sampling (of `kind`)."""
        return sample_rows(logits[rows], jax.vmap(loop.token_key)(seeds, choices, counts), sampling, vocab)
    return jax.jit(choose)
