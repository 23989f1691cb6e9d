"""The decoder's key/value cache: static-size per-layer keys and values, written one token per row.

Layout: keys and values [L, B, S, K, H] (layers, rows, cache slots, key/value heads, head dim) in the
compute dtype, for scanned and unscanned decoders alike. One stacked array (not a list per layer)
lets a decode step write each layer's new token in place while the cache is a `while_loop` carry:
XLA updates a loop-carried buffer through a dynamic-update-slice without copying it, where
rebuilding a per-layer slice and stacking it back would copy the whole cache every token.

Each row has its own cursor, the slot its next token goes to. Prompts are right-padded, so a row's
slots [length, P) hold padding keys after prefill; decoding overwrites them in order before any
query can see them (a query at slot c attends slots <= c only).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from valen_jax.sharding import constrain

# Shards like training's activations: rows over ("data", "fsdp"), key/value heads over "tensor".
CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


class KVCache(NamedTuple):
    keys: jax.Array  # [L, B, S, K, H]
    values: jax.Array

    @property
    def length(self) -> int:
        return self.keys.shape[2]


def from_prefill(keys, values, length: int) -> KVCache:
    """A cache of `length` slots holding the prompt's keys/values [L, B, P, K, H] in slots [0, P)."""
    if keys.shape[2] > length:
        raise ValueError(f"a prompt bucket of {keys.shape[2]} tokens does not fit a cache of {length} slots")
    pad = [(0, 0), (0, 0), (0, length - keys.shape[2]), (0, 0), (0, 0)]
    return KVCache(constrain(jnp.pad(keys, pad), CACHE_AXES), constrain(jnp.pad(values, pad), CACHE_AXES))


def _write_rows(stacked, layer, new, cursor):
    """stacked [L, B, S, K, H] with new [B, K, H] at (layer, b, cursor[b]) for every row b.

    A vmap over rows of one dynamic-update-slice: XLA sees a scatter whose batch dimension is the
    rows, which GSPMD keeps local to each row's shard (an index array over rows would not say so)."""
    def one_row(rows, token, slot):  # rows [L, S, K, H]
        return jax.lax.dynamic_update_slice(rows, token[None, None].astype(rows.dtype), (layer, slot, 0, 0))

    return jax.vmap(one_row, in_axes=(1, 0, 0), out_axes=1)(stacked, new, cursor)


def write_token(cache: KVCache, layer, keys, values, cursor) -> KVCache:
    """The cache with one new token per row: keys/values [B, K, H] at slot cursor[b] of `layer`."""
    return KVCache(constrain(_write_rows(cache.keys, layer, keys, cursor), CACHE_AXES),
                   constrain(_write_rows(cache.values, layer, values, cursor), CACHE_AXES))


def layer_view(cache: KVCache, layer) -> tuple[jax.Array, jax.Array]:
    """One layer's keys and values [B, S, K, H] (`layer` an int or a traced index)."""
    return (jax.lax.dynamic_index_in_dim(cache.keys, layer, 0, keepdims=False),
            jax.lax.dynamic_index_in_dim(cache.values, layer, 0, keepdims=False))


def attend_token(q, keys, values, cursor):
    """One query per row against its cache: q [B, N, H]; keys, values [B, S, K, H]; a row attends
    slots <= cursor[b] (its prompt, the tokens generated so far and the current one). O(S) per token.
    Scores and softmax in f32, as every `attention.attend` implementation computes them."""
    batch, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    queries = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bkgh,bskh->bkgs", queries, keys, preferred_element_type=jnp.float32) * head_dim ** -0.5
    visible = jnp.arange(keys.shape[1])[None, :] <= cursor[:, None]  # [B, S]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgs,bskh->bkgh", weights, values.astype(jnp.float32))
    return out.reshape(batch, heads, head_dim).astype(q.dtype)
