"""Decoder kernels written for speed (blockwise causal attention, gated SiLU) equal their plain forms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from valen_jax.models.attention import reference_mask
from valen_jax.models.attention_blockwise import attention_block_size, blockwise_attention


def _inputs(length, heads, kv_heads, seed=0, head_dim=8, batch=2):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, length, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, length, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, length, kv_heads, head_dim)), jnp.float32)
    return q, k, v


def _packed_segments(length, batch=2):
    # Row 0: three packed examples then padding; row 1: one example filling the row.
    first = np.zeros(length, np.int32)
    cuts = [0, length // 3, length // 2, length - 3]
    for segment, (start, end) in enumerate(zip(cuts[:-1], cuts[1:], strict=True), start=1):
        first[start:end] = segment
    return jnp.asarray(np.stack([first, np.ones(length, np.int32)])[:batch])


def _branch_tree(length):
    # A shared prefix (branch 0) then three branches that see the prefix and themselves only.
    branches = np.zeros(length, np.int32)
    bounds = np.linspace(length // 4, length, 4).astype(int)
    for branch, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), start=1):
        branches[start:end] = branch
    return jnp.asarray(branches[None]), jnp.ones((1, length), jnp.int32)


# Each case compiles for several CPU seconds: one single-chunk case stays in the fast tier beside
# branches_apart (three chunks of 16); the others run with the slow tests.
@pytest.mark.parametrize("length,chunk,heads,kv_heads", [
    pytest.param(37, 8, 4, 2, marks=pytest.mark.slow), pytest.param(64, 64, 4, 4, marks=pytest.mark.slow),
    pytest.param(50, 16, 6, 1, marks=pytest.mark.slow), (9, 128, 2, 1)])
def test_blockwise_causal_attention_equals_full_attention(length, chunk, heads, kv_heads):
    q, k, v = _inputs(length, heads, kv_heads)
    segments = _packed_segments(length)
    mask = reference_mask(segments)

    def loss(fn):
        def value(q, k, v):
            out = fn(q, k, v)
            return jnp.sum(out * jnp.cos(out)), out
        return jax.value_and_grad(value, argnums=(0, 1, 2), has_aux=True)

    (_, want), want_grads = loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask))(q, k, v)
    (_, got), got_grads = loss(lambda q, k, v: blockwise_attention(q, k, v, segments, causal=True, chunk=chunk))(q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


def test_blockwise_attention_keeps_branches_apart():
    length = 48
    branch_ids, segments = _branch_tree(length)
    q, k, v = _inputs(length, 4, 2, seed=1, batch=1)
    mask = reference_mask(segments, branch_ids)
    want = jax.nn.dot_product_attention(q, k, v, mask=mask)

    def attend(q, k, v):
        return blockwise_attention(q, k, v, segments, branch_ids, causal=True, chunk=16)

    np.testing.assert_allclose(attend(q, k, v), want, atol=2e-6, rtol=2e-5)
    # Changing branch 3's keys and values leaves branches 1 and 2 (and the prefix) unchanged.
    third = np.asarray(branch_ids[0]) == 3
    k2 = k.at[:, third].add(1.0)
    v2 = v.at[:, third].add(1.0)
    before, after = attend(q, k, v), attend(q, k2, v2)
    np.testing.assert_array_equal(np.asarray(after)[:, ~third], np.asarray(before)[:, ~third])
    assert not np.allclose(np.asarray(after)[:, third], np.asarray(before)[:, third])


def test_block_size_keeps_at_most_eight_blocks_of_multiples_of_64():
    for length in (1, 9, 512, 600, 2048, 8192, 10000):
        size = attention_block_size(length)
        assert size % 64 == 0 and -(-length // size) <= 8
    assert attention_block_size(512) == 64


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_silu_backward_matches_autodiff(dtype):
    from valen_jax.models.layers import gated_silu

    rng = np.random.default_rng(5)
    gate = jnp.asarray(rng.standard_normal((3, 5, 7)) * 3, dtype)
    up = jnp.asarray(rng.standard_normal((3, 5, 7)), dtype)
    probe = jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float32)

    def objective(fn):
        return lambda g, u: jnp.sum(fn(g, u).astype(jnp.float32) * probe)

    want = jax.grad(objective(lambda g, u: jax.nn.silu(g) * u), argnums=(0, 1))(gate, up)
    got = jax.grad(objective(gated_silu), argnums=(0, 1))(gate, up)
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(gated_silu(gate, up), np.float32),
                               np.asarray(jax.nn.silu(gate) * up, np.float32), rtol=tol, atol=tol)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)


@pytest.mark.slow
def test_blockwise_attention_in_bfloat16_follows_float32():
    q, k, v = _inputs(40, 4, 2, seed=2)
    segments = _packed_segments(40)

    def grads(dtype):
        def value(q, k, v):
            out = blockwise_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), segments, causal=True, chunk=16)
            assert out.dtype == dtype
            return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32)))
        return jax.grad(value, argnums=(0, 1, 2))(q, k, v)

    for low, high in zip(grads(jnp.bfloat16), grads(jnp.float32), strict=True):
        np.testing.assert_allclose(np.asarray(low, np.float32), np.asarray(high), atol=0.06, rtol=0.06)
