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


def _levels_of(index):
    """LEVELS[index] (index: 0..15, any numeric dtype) by a chain of selects: elementwise, so it fuses with
    the scaling that follows, where a gather from the 16-entry table needs its index array in memory."""
    values = jnp.full(index.shape, LEVELS[0], jnp.float32)
    for k in range(1, len(LEVELS)):
        values = jnp.where(index == k, LEVELS[k], values)
    return values


def _interleave(width: int) -> np.ndarray:
    """[width, width] 0/1 matrix taking a row [high nibbles | low nibbles] to the values' order (high, low,
    high, low, ...): row j of the first half to column 2j, row j of the second half to column 2j + 1."""
    half = width // 2
    matrix = np.zeros((width, width), np.float32)
    matrix[np.arange(half), 2 * np.arange(half)] = 1.0
    matrix[half + np.arange(half), 2 * np.arange(half) + 1] = 1.0
    return matrix


def dequantise(codes, absmax, shape, dtype=jnp.float32):
    """The inverse of `quantise` up to the rounding to levels: the [shape] weight in `dtype`.

    The two nibbles of a byte are neighbours in the weight. Interleaving them by `stack(axis=-1)` makes an
    [n, 2] array, which XLA:TPU lays out with its size-2 minor axis padded to 128 lanes (or 64 for bf16)
    and materialises: 16 GiB for one 7B MLP weight (ahead-of-time compile, README's LoRA section). Here a
    row of `width` values (128: one lane tile; 64, one block, when the size is no multiple of 128) is
    interleaved by a 0/1 matmul of nibble indices (integers 0..15 and products by 1 are exact in bf16),
    and the block maxima are spread over their 64 values the same way (at HIGHEST precision: f32 exact).
    The matmul costs 2 x width FLOPs a weight value, about 1.4% of a 7B step at 8k tokens per row (three
    dequantisations a step: forward, remat's recompute, backward). tests/test_nf4.py checks the values bit
    for bit, tests/test_compile.py the temporaries.
    """
    size = math.prod(shape)
    width = 2 * BLOCK if size % (2 * BLOCK) == 0 else BLOCK
    rows = codes.reshape(-1, width // 2)
    nibbles = jnp.concatenate([rows >> 4, rows & 0xF], axis=-1).astype(jnp.bfloat16)
    index = jnp.dot(nibbles, jnp.asarray(_interleave(width), jnp.bfloat16), preferred_element_type=jnp.bfloat16)
    blocks = width // BLOCK
    spread = np.repeat(np.eye(blocks, dtype=np.float32), BLOCK, axis=1)  # [blocks, width]
    scale = jnp.dot(absmax.reshape(-1, blocks), jnp.asarray(spread), precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)
    return (_levels_of(index) * scale).reshape(shape).astype(dtype)


def quantise_stacked(w, leading: int):
    """`quantise` over each index of the first `leading` axes (scanned layers: one base weight per layer)."""
    fn = quantise
    for _ in range(leading):
        fn = jax.vmap(fn)
    return fn(w)
