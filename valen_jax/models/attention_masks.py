"""The attention mask rule as a function of ids, tile by tile: the leaf every attention kernel builds on.

`tile_mask` is the one statement of `attention`'s rule (same segment > 0, causal, branch trees,
the diagonal always) for one tile of queries against one tile of keys; `attention.attend`'s kernels
(`attention_blockwise`, `attention_flash`) and the dense `reference_mask` (tests only) all call it,
so `attention` can import its kernels without the kernels importing it back.
"""

from __future__ import annotations

import jax.numpy as jnp


def tile_mask(q_seg, k_seg, q_index, k_index, q_branch=None, k_branch=None, *, causal: bool):
    """The allowed (query, key) pairs of one tile: bool [B, R, S] from ids [B, R] / [B, S] and the
    absolute positions q_index [R], k_index [S] of the tile's rows and columns."""
    allowed = (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] > 0)
    if causal:
        allowed &= k_index[None, None, :] <= q_index[None, :, None]
    if q_branch is not None:
        key_branch = k_branch[:, None, :]
        allowed &= (key_branch == 0) | (key_branch == q_branch[:, :, None])
    return allowed | (q_index[:, None] == k_index[None, :])[None]


def reference_mask(segment_ids, branch_ids=None, *, causal: bool = True):
    """The dense bool [B, 1, T, T] mask (tests and the reference only; never in the model path)."""
    index = jnp.arange(segment_ids.shape[1])
    return tile_mask(segment_ids, segment_ids, index, index, branch_ids, branch_ids, causal=causal)[:, None]
