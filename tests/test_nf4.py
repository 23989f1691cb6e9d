"""NF4 (models/nf4.py) against bitsandbytes, the reference QLoRA implementation: the same 16 levels (and
both equal to their construction from normal quantiles), the same packed codes and block maxima, the same
dequantised weights; and the QLoRA layer computes with exactly those dequantised weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from valen_jax.models import nf4

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes.functional")


def test_the_levels_are_bitsandbytes_nf4_table_and_its_normal_quantile_construction():
    ours = nf4.LEVELS
    assert ours.shape == (16,) and ours[0] == -1.0 and ours[7] == 0.0 and ours[-1] == 1.0
    np.testing.assert_array_equal(ours, bnb.get_4bit_type("nf4", device="cpu").numpy())
    np.testing.assert_allclose(nf4.levels_from_quantiles(), ours, atol=2e-6)


@pytest.mark.parametrize("shape", [(4, 128), (3, 2, 64), (640,)])
def test_codes_maxima_and_dequantised_weights_match_bitsandbytes(shape):
    w = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    w.reshape(-1)[:64] = 0.0  # an all-zero block: level 0.0 (index 7) everywhere, maximum 0
    codes, absmax = nf4.quantise(jnp.asarray(w))
    packed, state = bnb.quantize_4bit(torch.from_numpy(w), blocksize=nf4.BLOCK, quant_type="nf4")
    np.testing.assert_array_equal(np.asarray(absmax), state.absmax.numpy())
    np.testing.assert_array_equal(np.asarray(codes), packed.numpy().reshape(-1))
    ours = np.asarray(nf4.dequantise(codes, absmax, shape))
    np.testing.assert_allclose(ours, bnb.dequantize_4bit(packed, state).numpy().reshape(shape), atol=1e-6, rtol=0)
    # Each value lands on the nearest level of its block: error at most half the widest gap (0.152) × absmax.
    blocks = np.abs(w.reshape(-1, nf4.BLOCK)).max(axis=1, keepdims=True)
    assert np.all(np.abs(ours - w).reshape(-1, nf4.BLOCK) <= 0.5 * np.max(np.diff(nf4.LEVELS)) * blocks + 1e-6)


def test_a_weight_that_is_not_whole_blocks_is_refused():
    with pytest.raises(nf4.QuantiseError, match=r"100 values \(\(10, 10\)\) are not a multiple of the NF4 block 64"):
        nf4.quantise(jnp.zeros((10, 10)))


@pytest.mark.parametrize("shape,in_dims", [((64, 2, 32), 1), ((2, 32, 64), 2)])
def test_the_nf4_matmuls_own_backward_equals_autodiff_of_dequantise_then_matmul(shape, in_dims):
    import jax

    from valen_jax.models import layers

    codes, absmax = nf4.quantise(jax.random.normal(jax.random.key(0), shape))
    x = jax.random.normal(jax.random.key(1), (3, 5, *shape[:in_dims]))

    def ours(x):
        return jnp.sum(jnp.sin(layers.nf4_dense(codes, absmax, x, shape, jnp.float32, in_dims)))

    def reference(x):
        return jnp.sum(jnp.sin(layers.dense(x, nf4.dequantise(codes, absmax, shape), in_dims)))

    assert float(ours(x)) == float(reference(x))
    np.testing.assert_allclose(np.asarray(jax.grad(ours)(x)), np.asarray(jax.grad(reference)(x)), atol=1e-6, rtol=0)
