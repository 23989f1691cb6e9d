"""4-bit NormalFloat (NF4, QLoRA, Dettmers et al. 2023): the one quantise/dequantise pair of a frozen base.

A weight is flattened row-major and cut into blocks of `BLOCK` (64) values; each block keeps its absolute
maximum (f32) and, per value, the index of the nearest of the 16 NF4 levels to value / absmax. Two indices
share a byte, the first in the high nibble, as bitsandbytes packs them, so 4.5 bits a parameter in all
(absmax is not itself quantised: no "double quantisation", which would save another 0.37 bits).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64

# The 16 levels of bitsandbytes' `get_4bit_type("nf4")` (functional.py), i.e. the quantiles of N(0, 1) with
# offset 0.9677 normalised to [-1, 1], 8 positive, 7 negative and an exact zero (`levels_from_quantiles`
# rebuilds them; tests/test_nf4.py checks both).
LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=np.float32)


class QuantiseError(ValueError):
    """A weight NF4 cannot hold (its size not a multiple of the block)."""


def levels_from_quantiles(offset: float = 0.9677083) -> np.ndarray:
    """NF4's levels by their construction (QLoRA appendix E; bitsandbytes `create_normal_map`)."""
    from jax.scipy.special import ndtri

    positive = np.asarray(ndtri(jnp.linspace(offset, 0.5, 9, dtype=jnp.float32)[:-1]))
    negative = -np.asarray(ndtri(jnp.linspace(offset, 0.5, 8, dtype=jnp.float32)[:-1]))
    values = np.sort(np.concatenate([positive, [0.0], negative]))
    return (values / values.max()).astype(np.float32)


def check_quantisable(shape, where: str) -> None:
    size = math.prod(shape)
    if size % BLOCK:
        raise QuantiseError(f"{where}: {size} values ({tuple(shape)}) are not a multiple of the NF4 block {BLOCK}")


def quantise(w):
    """w (any shape, float) → (codes uint8 [w.size / 2], absmax f32 [w.size / 64])."""
    check_quantisable(w.shape, "nf4.quantise")
    blocks = w.astype(jnp.float32).reshape(-1, BLOCK)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    # An all-zero block: any scale gives codes of level 0.0; 1 keeps the division finite.
    normalised = blocks / jnp.where(absmax > 0, absmax, 1.0)[:, None]
    levels = jnp.asarray(LEVELS)
    # Nearest level by the midpoints between neighbours (ties go up, as bitsandbytes' comparisons do).
    midpoints = (levels[1:] + levels[:-1]) / 2
    index = jnp.sum(normalised.reshape(-1)[:, None] > midpoints[None, :], axis=1).astype(jnp.uint8)
    codes = (index[0::2] << 4) | index[1::2]
    return codes, absmax


def dequantise(codes, absmax, shape, dtype=jnp.float32):
    """The inverse of `quantise` up to the rounding to levels: the [shape] weight in `dtype`."""
    index = jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(-1)
    values = jnp.asarray(LEVELS)[index.astype(jnp.int32)].reshape(-1, BLOCK) * absmax[:, None]
    return values.reshape(shape).astype(dtype)


def quantise_stacked(w, leading: int):
    """`quantise` over each index of the first `leading` axes (scanned layers: one base weight per layer)."""
    fn = quantise
    for _ in range(leading):
        fn = jax.vmap(fn)
    return fn(w)
