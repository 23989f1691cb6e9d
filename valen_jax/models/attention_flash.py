"""`flash` attention: portable online softmax (FlashAttention-2 style) for any backend.

Queries and keys are cut into tiles of `block` positions. The forward runs, per query tile, a loop
over key tiles keeping a running max, sum and f32 accumulator, and saves only the output and the
per-row log-sum-exp: O(T) residuals per layer instead of the O(T²) softmax weights. The backward
(`jax.custom_vjp`) recomputes each tile's probabilities from the saved log-sum-exp: an outer scan
over key tiles accumulates dK and dV, while dQ accumulates in one carried [T] buffer. Each tile's mask
comes from the id slices (`attention_masks.tile_mask`), never a [T, T] array. Under `causal` the tiles
above the diagonal are never visited (loop bounds), and any tile whose mask is empty for the whole
batch (another packed segment) is skipped by a `lax.cond`.

The row is padded to a multiple of `block` with segment 0 (padding sees only itself), so the
padding never reaches a real row and is cut off afterwards.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from valen_jax.models.attention_masks import tile_mask

# Tile side in positions (rows are block × query-groups): 128 keeps a tile's f32 scores at
# 64 KiB per (batch, kv head, group) while the matmuls stay large enough for any backend.
FLASH_BLOCK = 128


def flash_attention(q, k, v, segment_ids, branch_ids=None, *, causal: bool, block: int | None = None):
    """`attention.attend`'s contract. q [B, T, N, H]; k, v [B, T, K, H]; ids int [B, T]."""
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    block = block or min(FLASH_BLOCK, 8 * math.ceil(length / 8))
    padded = block * math.ceil(length / block)
    branch = jnp.zeros_like(segment_ids) if branch_ids is None else branch_ids  # all prefix: no restriction

    def tiles(x):  # [B, T, ...] → [n, B, block, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(batch, padded // block, block, *x.shape[2:]), 1, 0)

    # Queries [n, B, K, block, G, H]; keys/values [n, B, K, block, H]: each tile a batched matmul over (B, K).
    queries = tiles(q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)).transpose(0, 1, 3, 2, 4, 5)
    keys, values = tiles(k).transpose(0, 1, 3, 2, 4), tiles(v).transpose(0, 1, 3, 2, 4)
    ids = (tiles(segment_ids.astype(jnp.int32)), tiles(branch.astype(jnp.int32)))
    out = _flash(queries, keys, values, ids, causal)
    out = out.transpose(1, 0, 3, 2, 4, 5).reshape(batch, padded, heads, head_dim)
    return out[:, :length]


def _mask(ids, i, j, block, causal):
    """Tile (i, j)'s allowed pairs, bool [B, block, block]."""
    seg, branch = ids
    index = jnp.arange(block)
    return tile_mask(seg[i], seg[j], i * block + index, j * block + index, branch[i], branch[j], causal=causal)


def _scores(rows, keys, mask, scale):
    """rows [B, K, b, G, H] · keys [B, K, b, H] → masked f32 scores [B, K, b, G, b]."""
    scores = jnp.einsum("bkqgh,bksh->bkqgs", rows, keys, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask[:, None, :, None, :], scores, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(queries, keys, values, ids, causal):
    return _flash_forward(queries, keys, values, ids, causal)[0]


def _flash_forward(queries, keys, values, ids, causal):
    count, batch, kv_heads, block, groups, head_dim = queries.shape
    scale = head_dim ** -0.5

    def query_tile(i):
        rows = queries[i]

        def visit(j, carry):
            mask = _mask(ids, i, j, block, causal)

            def update(state):
                top, total, acc = state
                scores = _scores(rows, keys[j], mask, scale)
                new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
                # A row with nothing allowed yet keeps -inf: shift by 0 so exp gives 0, not NaN.
                shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
                probs = jnp.exp(scores - shift[..., None])
                decay = jnp.exp(top - shift)
                acc = decay[..., None] * acc + jnp.einsum("bkqgs,bksh->bkqgh", probs.astype(values.dtype), values[j],
                                                          preferred_element_type=jnp.float32)
                return new_top, decay * total + jnp.sum(probs, axis=-1), acc

            return lax.cond(jnp.any(mask), update, lambda state: state, carry)

        stats = jnp.full((batch, kv_heads, block, groups), -jnp.inf, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros(rows.shape, jnp.float32))
        top, total, acc = lax.fori_loop(0, i + 1 if causal else count, visit, init)
        # Every row keeps its diagonal, so total > 0 and top is finite.
        return (acc / total[..., None]).astype(queries.dtype), top + jnp.log(total)

    out, lse = lax.map(query_tile, jnp.arange(count))
    return out, (queries, keys, values, ids, out, lse)


def _flash_backward(causal, residuals, d_out):
    queries, keys, values, ids, out, lse = residuals
    count, batch, kv_heads, block, groups, head_dim = queries.shape
    scale = head_dim ** -0.5
    # Σ_s p·dp = Σ_h dO·O per row: the softmax backward's correction without a pass over scores.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def key_tile(d_queries, j):
        tile_keys, tile_values = keys[j], values[j]

        def visit(i, carry):
            mask = _mask(ids, i, j, block, causal)

            def update(state):
                d_queries, d_keys, d_values = state
                rows, grad = queries[i], d_out[i]
                probs = jnp.exp(_scores(rows, tile_keys, mask, scale) - lse[i][..., None])
                d_values += jnp.einsum("bkqgs,bkqgh->bksh", probs.astype(grad.dtype), grad,
                                       preferred_element_type=jnp.float32)
                d_probs = jnp.einsum("bkqgh,bksh->bkqgs", grad, tile_values, preferred_element_type=jnp.float32)
                d_scores = probs * (d_probs - delta[i][..., None]) * scale
                d_keys += jnp.einsum("bkqgs,bkqgh->bksh", d_scores.astype(rows.dtype), rows,
                                     preferred_element_type=jnp.float32)
                d_rows = jnp.einsum("bkqgs,bksh->bkqgh", d_scores.astype(tile_keys.dtype), tile_keys,
                                    preferred_element_type=jnp.float32)
                return d_queries.at[i].add(d_rows), d_keys, d_values

            return lax.cond(jnp.any(mask), update, lambda state: state, carry)

        zeros = jnp.zeros(tile_keys.shape, jnp.float32)
        d_queries, d_keys, d_values = lax.fori_loop(j if causal else 0, count, visit, (d_queries, zeros, zeros))
        return d_queries, (d_keys, d_values)

    d_queries, (d_keys, d_values) = lax.scan(key_tile, jnp.zeros(queries.shape, jnp.float32), jnp.arange(count))
    return (d_queries.astype(queries.dtype), d_keys.astype(keys.dtype), d_values.astype(values.dtype), None)


_flash.defvjp(_flash_forward, _flash_backward)
