"""Building blocks shared by the decoder and the vision encoder.

Every parameter carries `logical_axes` metadata; `valen_jax.sharding` maps the names to
mesh axes. Parameters live in `param_dtype` (f32 master weights); matmuls run in `dtype`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from valen_jax.models.config import RopeScaling
from valen_jax.sharding import constrain

_INIT_STD = 0.02


def dense(x, w, in_dims: int = 1):
    """Contract the last `in_dims` axes of x with the leading `in_dims` axes of w.

    Both sides are flattened to one 2-D matmul ([rows, in] @ [in, out]) and reshaped back. The
    same product written as a multi-axis einsum ("btd,dnh->btnh") makes XLA's backward contract
    two axes at once (batch and length) for the weight gradient, and on CPU it then copies whole
    activations into a transposed layout first: about twice the time of the 2-D form
    (benchmarks/train_step.py). Flattening is free (row-major bitcasts) on every backend.
    """
    lead, out = x.shape[:x.ndim - in_dims], w.shape[in_dims:]
    rows = x.reshape(-1, math.prod(x.shape[x.ndim - in_dims:]))
    y = rows @ w.reshape(rows.shape[1], math.prod(out))
    return y.reshape(*lead, *out)


def param(rngs: nnx.Rngs, shape, axes, dtype, init: str = "normal") -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (_INIT_STD * jax.random.normal(rngs.params(), shape)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("norm",), param_dtype, init="ones")
        self.eps = eps

    def __call__(self, x):
        # Normalise in f32 whatever the compute dtype: bf16 variance loses too many bits.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """RoPE frequencies as HF computes them (`modeling_rope_utils`), in float64 then f32."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3: long wavelengths slowed by `factor`, short ones kept, a smooth band in between.
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotate(x, angles):
    """HF's "rotate half" with one angle per frequency pair: x [B, T, N, H]; angles [B, T, H/2] f32.
    The one application every rotary variant here (1-D, multimodal, vision) shares."""
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def rope(x, positions, theta: float, scaling: RopeScaling | None = None):
    """Rotary embedding, HF "rotate half" layout. x: [B, T, N, H]; positions: [B, T] or [B, T, A].

    With A position axes (vision patches: t, h, w) the head's frequency pairs are split into A
    sections, each rotated by its own coordinate: positions on any grid size, no learned table.
    """
    if positions.ndim == 3:
        pairs = x.shape[-1] // 2
        first = pairs // 4  # time gets fewer frequencies than the two spatial axes
        sizes = [first, (pairs - first) // 2]
        sizes.append(pairs - sum(sizes))
        bounds = np.cumsum([0, *[2 * n for n in sizes]])
        parts = [rope(x[..., bounds[i]:bounds[i + 1]], positions[..., i], theta) for i in range(3) if sizes[i]]
        return jnp.concatenate(parts, axis=-1)
    head_dim = x.shape[-1]
    inv_freq = jnp.asarray(inverse_frequencies(head_dim, theta, scaling))
    return rotate(x, positions.astype(jnp.float32)[..., None] * inv_freq)  # angles [B, T, H/2]


def mrope(x, positions, theta: float, section: tuple[int, ...], interleaved: bool = False):
    """Qwen2-VL's multimodal rotary embedding. x: [B, T, N, H]; positions: [B, T, 3] (t, h, w) or [B, T].

    Unlike `rope` with three position axes, the frequencies are those of the whole head
    (`inverse_frequencies(H)`), and consecutive runs of `section` frequency pairs take their
    angle from the t, h, w coordinate in turn (HF `recomposition_frequencies`); text tokens
    carry equal coordinates, so for them this is plain 1-D RoPE. `interleaved` (Qwen3-VL): pair j
    takes h when j % 3 == 1 and j < 3·section[1], w when j % 3 == 2 and j < 3·section[2], else t.
    """
    if sum(section) != x.shape[-1] // 2:
        raise ValueError(f"mrope_section {section} must sum to half the head dim {x.shape[-1]}")
    if positions.ndim == 2:
        positions = jnp.repeat(positions[..., None], 3, axis=-1)
    inv_freq = jnp.asarray(inverse_frequencies(x.shape[-1], theta, None))
    axis = np.concatenate([np.full(n, i % 3) for i, n in enumerate(section)])  # position axis of each pair
    if interleaved:
        j = np.arange(len(axis))
        axis = np.where((j % 3 == 1) & (j < 3 * section[1]), 1, np.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))
    chosen = jnp.take(positions.astype(jnp.float32), jnp.asarray(axis), axis=-1)  # [B, T, H/2]
    return rotate(x, chosen * inv_freq)


# Query positions per block in `causal_attention`: blocks of 64 measured best on CPU (against
# 128 and 256) at 512 tokens; longer rows get at most 8 blocks, each a multiple of 64, so the
# unrolled graph (and compile time) stays small while about 44% of the work is still skipped.
ATTENTION_BLOCK = 64
ATTENTION_MAX_BLOCKS = 8


def attention_block_size(length: int) -> int:
    return ATTENTION_BLOCK * math.ceil(math.ceil(length / ATTENTION_MAX_BLOCKS) / ATTENTION_BLOCK)


def causal_attention(q, k, v, mask, chunk: int | None = None):
    """Softmax attention for a mask that never allows a key after its query (causal, packed, branch trees).

    q: [B, T, N, H]; k, v: [B, T, K, H] with N a multiple of K (grouped-query); mask: bool
    [B, 1, T, T]. Queries are processed in blocks of `chunk` positions (default:
    `attention_block_size(T)`), each against the keys up to its last position only: the blocks
    above the diagonal, all masked, are never computed, nor their backward, which removes close
    to half the work of a full [T, T] product. Exact with respect to full attention, since
    those blocks carry zero weight.

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
    scale = head_dim ** -0.5
    outputs = []
    for i, block_queries in enumerate(query_blocks):
        start = i * chunk
        end = start + block_queries.shape[2]
        rows = block_queries.reshape(batch, kv_heads, (end - start) * groups, head_dim)
        prefix_keys = jnp.concatenate(key_blocks[:i + 1], axis=2) if i else key_blocks[0]
        prefix_values = jnp.concatenate(value_blocks[:i + 1], axis=2) if i else value_blocks[0]
        block = _attend_block(rows, prefix_keys, prefix_values, mask[:, :, start:end, :end], scale)
        outputs.append(block.reshape(batch, kv_heads, end - start, groups, head_dim))
    out = jnp.concatenate(outputs, axis=2)  # [B, K, T, G, H]
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, length, heads, head_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend_block(rows, keys, values, mask, scale):
    """One query block: rows [B, K, R, H] (R = positions x groups) against keys/values [B, K, S, H]."""
    return _attend_block_forward(rows, keys, values, mask, scale)[0]


def _attend_block_forward(rows, keys, values, mask, scale):
    batch, kv_heads, count, _ = rows.shape
    positions, length = mask.shape[2], mask.shape[3]
    scores = jnp.einsum("bkrh,bksh->bkrs", rows, keys, preferred_element_type=jnp.float32)
    scores = scores.reshape(batch, kv_heads, positions, count // positions, length) * scale
    scores = jnp.where(mask[:, :, :, None, :], scores, -jnp.inf)  # every row keeps its diagonal
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


class Attention(nnx.Module):
    """Multi-head attention with grouped key/value heads.

    `causal=True` (the decoder) requires masks that never let a query see a later key and skips
    the work above the diagonal (`causal_attention`); `causal=False` (the vision encoder)
    takes any mask.
    """

    def __init__(self, dim, num_heads, num_kv_heads, head_dim, *, bias: bool, rope_theta: float | None,
                 dtype, param_dtype, rngs: nnx.Rngs, qk_norm: bool = False, rope_scaling=None, eps=1e-6,
                 causal: bool = True, mrope_section: tuple[int, ...] | None = None, mrope_interleaved: bool = False):
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads are not a multiple of {num_kv_heads} key/value heads")
        self.q = param(rngs, (dim, num_heads, head_dim), ("embed", "heads", "head_dim"), param_dtype)
        self.k = param(rngs, (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.v = param(rngs, (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.o = param(rngs, (num_heads, head_dim, dim), ("heads", "head_dim", "embed"), param_dtype)
        if bias:
            self.q_bias = param(rngs, (num_heads, head_dim), ("heads", "head_dim"), param_dtype, "zeros")
            self.k_bias = param(rngs, (num_kv_heads, head_dim), ("kv_heads", "head_dim"), param_dtype, "zeros")
            self.v_bias = param(rngs, (num_kv_heads, head_dim), ("kv_heads", "head_dim"), param_dtype, "zeros")
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, param_dtype, rngs)
            self.k_norm = RMSNorm(head_dim, eps, param_dtype, rngs)
        self.bias = bias
        self.qk_norm = qk_norm
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.dtype = dtype
        self.causal = causal
        self.mrope_section = tuple(mrope_section) if mrope_section else None
        self.mrope_interleaved = mrope_interleaved

    def __call__(self, x, positions, mask):
        """x: [B, T, D]; positions: [B, T]; mask: bool [B, 1, T, T], True where attention is allowed."""
        x = x.astype(self.dtype)
        q = dense(x, self.q[...].astype(self.dtype))
        k = dense(x, self.k[...].astype(self.dtype))
        v = dense(x, self.v[...].astype(self.dtype))
        if self.bias:
            q = q + self.q_bias[...].astype(self.dtype)
            k = k + self.k_bias[...].astype(self.dtype)
            v = v + self.v_bias[...].astype(self.dtype)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.mrope_section is not None:
            q = mrope(q, positions, self.rope_theta, self.mrope_section, self.mrope_interleaved)
            k = mrope(k, positions, self.rope_theta, self.mrope_section, self.mrope_interleaved)
        elif self.rope_theta is not None:
            q = rope(q, positions, self.rope_theta, self.rope_scaling)
            k = rope(k, positions, self.rope_theta, self.rope_scaling)
        q = constrain(q, ("batch", "length", "act_heads", None))
        if self.causal:
            out = causal_attention(q, k, v, mask)
        else:
            out = jax.nn.dot_product_attention(q, k, v, mask=mask)
        return dense(out, self.o[...].astype(self.dtype), in_dims=2)


@jax.custom_vjp
def gated_silu(gate, up):
    """silu(gate) · up, whose backward is one elementwise pass over (gate, up, gradient)."""
    return jax.nn.silu(gate) * up


def _gated_silu_forward(gate, up):
    return gated_silu(gate, up), (gate, up)


def _gated_silu_backward(residuals, grad):
    gate, up = residuals
    sigmoid = jax.nn.sigmoid(gate)
    silu = gate * sigmoid
    return grad * up * (sigmoid + silu * (1 - sigmoid)), grad * silu


gated_silu.defvjp(_gated_silu_forward, _gated_silu_backward)


class SwiGLU(nnx.Module):
    def __init__(self, dim, hidden, dtype, param_dtype, rngs: nnx.Rngs):
        self.gate = param(rngs, (dim, hidden), ("embed", "mlp"), param_dtype)
        self.up = param(rngs, (dim, hidden), ("embed", "mlp"), param_dtype)
        self.down = param(rngs, (hidden, dim), ("mlp", "embed"), param_dtype)
        self.dtype = dtype

    def __call__(self, x):
        x = x.astype(self.dtype)
        gate = dense(x, self.gate[...].astype(self.dtype))
        up = dense(x, self.up[...].astype(self.dtype))
        hidden = constrain(gated_silu(gate, up), ("batch", "length", "act_mlp"))
        return dense(hidden, self.down[...].astype(self.dtype))


class Block(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim, num_heads, num_kv_heads, head_dim, mlp_dim, *, bias, rope_theta, eps,
                 dtype, param_dtype, rngs, qk_norm=False, rope_scaling=None, causal=True, mrope_section=None,
                 mrope_interleaved=False):
        self.attn_norm = RMSNorm(dim, eps, param_dtype, rngs)
        self.attn = Attention(dim, num_heads, num_kv_heads, head_dim, bias=bias, rope_theta=rope_theta,
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs, qk_norm=qk_norm,
                              rope_scaling=rope_scaling, eps=eps, causal=causal, mrope_section=mrope_section,
                              mrope_interleaved=mrope_interleaved)
        self.mlp_norm = RMSNorm(dim, eps, param_dtype, rngs)
        self.mlp = SwiGLU(dim, mlp_dim, dtype, param_dtype, rngs)

    def __call__(self, x, positions, mask):
        x = x + self.attn(self.attn_norm(x), positions, mask).astype(x.dtype)
        x = constrain(x, ("batch", "length", "act_embed"))
        return x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
