"""`blockwise` attention: the CPU-tuned kernel (config.model.attention=blockwise; `auto` on CPU).

Queries are processed in unrolled blocks; under `causal` each block meets only the keys up to its
last position, so the blocks above the diagonal (all masked) are never computed, nor their
backward: close to half the work of a full [T, T] product. Each block's mask is built from the id
slices ([B, block, keys], never [T, T] at once). The backward is written by hand (`_attend_block`)
and keeps each block's softmax weights: O(T²) residuals per layer, which is why `auto` hands long
rows to `flash`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from valen_jax.models.attention_masks import tile_mask

# Query positions per block: blocks of 64 measured best on CPU (against 128 and 256) at 512 tokens;
# longer rows get at most 8 blocks, each a multiple of 64, so the unrolled graph (and compile time)
# stays small while about 44% of the work is still skipped.
ATTENTION_BLOCK = 64
ATTENTION_MAX_BLOCKS = 8


def attention_block_size(length: int) -> int:
    return ATTENTION_BLOCK * math.ceil(math.ceil(length / ATTENTION_MAX_BLOCKS) / ATTENTION_BLOCK)


def blockwise_attention(q, k, v, segment_ids, branch_ids=None, *, causal: bool, chunk: int | None = None):
    """`attention.attend`'s contract. q: [B, T, N, H]; k, v: [B, T, K, H] with N a multiple of K.

    Queries go in blocks of `chunk` positions (default `attention_block_size(T)`); causal blocks
    stop at their last position, non-causal ones (vision) meet every key. Exact with respect to
    full attention, since skipped blocks carry zero weight.

    Layout: keys and values are transposed once to [B, K, T, H] and queries to [B, K, T, G, H],
    so each block's query rows (position, group) are contiguous and every product is a plain
    batched matmul over (B, K) with no per-block transposes. Scores and softmax in f32.
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    chunk = chunk or attention_block_size(length)
    queries = q.reshape(batch, length, kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    # Split (not slice) along positions: the backward of a split is one concatenation, where
    # slices would each pad their gradient back to full length before summing.
    cuts = list(range(chunk, length, chunk))
    query_blocks = jnp.split(queries, cuts, axis=2)
    key_blocks, value_blocks = jnp.split(keys, cuts, axis=2), jnp.split(values, cuts, axis=2)
    index = jnp.arange(length)
    scale = head_dim ** -0.5
    outputs = []
    for i, block_queries in enumerate(query_blocks):
        start = i * chunk
        end = start + block_queries.shape[2]
        stop = end if causal else length  # keys this block can see
        rows = block_queries.reshape(batch, kv_heads, (end - start) * groups, head_dim)
        last = i + 1 if causal else len(key_blocks)
        block_keys = jnp.concatenate(key_blocks[:last], axis=2) if last > 1 else key_blocks[0]
        block_values = jnp.concatenate(value_blocks[:last], axis=2) if last > 1 else value_blocks[0]
        mask = tile_mask(segment_ids[:, start:end], segment_ids[:, :stop], index[start:end], index[:stop],
                         None if branch_ids is None else branch_ids[:, start:end],
                         None if branch_ids is None else branch_ids[:, :stop], causal=causal)
        block = _attend_block(rows, block_keys, block_values, mask, scale)
        outputs.append(block.reshape(batch, kv_heads, end - start, groups, head_dim))
    out = jnp.concatenate(outputs, axis=2) if len(outputs) > 1 else outputs[0]  # [B, K, T, G, H]
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, length, heads, head_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend_block(rows, keys, values, mask, scale):
    """One query block: rows [B, K, R, H] (R = positions x groups) against keys/values [B, K, S, H];
    mask bool [B, positions, S] (every row keeps at least its diagonal)."""
    return _attend_block_forward(rows, keys, values, mask, scale)[0]


def _attend_block_forward(rows, keys, values, mask, scale):
    batch, kv_heads, count, _ = rows.shape
    positions, length = mask.shape[1], mask.shape[2]
    scores = jnp.einsum("bkrh,bksh->bkrs", rows, keys, preferred_element_type=jnp.float32)
    scores = scores.reshape(batch, kv_heads, positions, count // positions, length) * scale
    scores = jnp.where(mask[:, None, :, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).reshape(batch, kv_heads, count, length)
    out = jnp.einsum("bkrs,bksh->bkrh", weights.astype(values.dtype), values)
    return out, (rows, keys, values, weights, out)


def _attend_block_backward(scale, residuals, d_out):
    # Softmax backward from the output side: Σ_s p·dp = Σ_h dO·O, a [R, H] product instead of a
    # pass over the [R, S] scores; masked weights are exactly 0, so no select is needed.
    rows, keys, values, weights, out = residuals
    d_values = jnp.einsum("bkrs,bkrh->bksh", weights.astype(d_out.dtype), d_out)
    d_weights = jnp.einsum("bkrh,bksh->bkrs", d_out, values, preferred_element_type=jnp.float32)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    d_scores = (weights * (d_weights - delta) * scale).astype(rows.dtype)
    d_rows = jnp.einsum("bkrs,bksh->bkrh", d_scores, keys)
    d_keys = jnp.einsum("bkrs,bkrh->bksh", d_scores, rows)
    return d_rows, d_keys, d_values, None


_attend_block.defvjp(_attend_block_forward, _attend_block_backward)
