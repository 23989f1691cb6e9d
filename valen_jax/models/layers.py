"""Building blocks shared by the decoder and the vision encoder.

Every parameter carries `logical_axes` metadata; `valen_jax.models.sharding` maps the names to
mesh axes. Parameters live in `param_dtype` (f32 master weights); matmuls run in `dtype`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from valen_jax.models import kv_cache, nf4
from valen_jax.models import lora as adapters
from valen_jax.models.attention import IMPLEMENTATIONS, attend
from valen_jax.models.config import RopeScaling
from valen_jax.models.sharding import constrain

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


def _after(grad, dtype):
    """An exact 1 in `dtype` computed from the backward's incoming gradient. A weight the backward rebuilds
    (cast or dequantised again) multiplied by it is tied to that gradient: XLA can neither merge the rebuild
    with the forward's identical one (CSE; an optimization barrier does not survive to the schedule on
    XLA:CPU) nor schedule it before the backward reaches the layer, either of which keeps every layer's
    full-size weight alive from the forward to the backward. (0·g + 1 is not folded: XLA keeps IEEE
    semantics. A non-finite g[0] makes it NaN, but such a gradient is fatal to the step anyway: the global
    norm clip turns every update NaN, and the loop stops on a non-finite loss.)"""
    return jnp.zeros((), dtype) * grad.reshape(-1)[0].astype(dtype) + jnp.ones((), dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def nf4_dense(codes, absmax, x, shape, dtype, in_dims: int):
    """x · (a QLoRA base weight dequantised from NF4 in `dtype`). The backward keeps only the codes, the
    maxima and x, and dequantises again: saving the full-size weight of every layer for it (what autodiff
    of a plain dequantise-then-matmul may do across a layer scan) would undo QLoRA's saving. The frozen
    base has no gradient; only x's is returned."""
    return dense(x, nf4.dequantise(codes, absmax, shape, dtype), in_dims)


def _nf4_dense_forward(codes, absmax, x, shape, dtype, in_dims):
    return nf4_dense(codes, absmax, x, shape, dtype, in_dims), (codes, absmax, x)


def _nf4_dense_backward(shape, dtype, in_dims, residuals, grad):
    codes, absmax, x = residuals
    w = nf4.dequantise(codes, absmax, shape, dtype)
    w2 = w.reshape(math.prod(shape[:in_dims]), math.prod(shape[in_dims:]))
    dx = (grad.reshape(-1, w2.shape[1]).astype(dtype) @ w2.T).reshape(x.shape).astype(x.dtype)
    return None, None, dx


nf4_dense.defvjp(_nf4_dense_forward, _nf4_dense_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def cast_dense(w, x, dtype, in_dims: int):
    """x · w cast to the compute `dtype` (a bf16 LoRA base in an f32 step; f32 masters in a bf16 step). The
    backward keeps w as stored and casts it again (`_after`): autodiff of a plain cast-then-matmul keeps the
    cast copy of every layer's weight for x's gradient, which in an f32 step on a bf16 base is twice the
    base's own memory (benchmarks/lora.py: 86 MiB of the dim-512 model's 119 MiB state). w's gradient is
    autodiff's; XLA drops it for a frozen weight, whose gradient nothing reads."""
    return dense(x, w.astype(dtype), in_dims)


def _cast_dense_forward(w, x, dtype, in_dims):
    return cast_dense(w, x, dtype, in_dims), (w, x)


def _cast_dense_backward(dtype, in_dims, residuals, grad):
    w, x = residuals
    w2 = (w.astype(dtype) * _after(grad, dtype)).reshape(math.prod(w.shape[:in_dims]), -1)
    g2 = grad.reshape(-1, w2.shape[1]).astype(dtype)
    dx = (g2 @ w2.T).reshape(x.shape).astype(x.dtype)
    dw = (x.reshape(-1, w2.shape[0]).astype(dtype).T @ g2).reshape(w.shape).astype(w.dtype)
    return dw, dx


cast_dense.defvjp(_cast_dense_forward, _cast_dense_backward)


def linear(module, name: str, x, in_dims: int = 1, lora_key=None):
    """x · module.<name> in the module's compute dtype, plus the weight's low-rank adapter when it has one
    (`models/lora.py`; the base dequantised first when QLoRA holds it as NF4). `lora_key`: a training
    step's key for this layer, which turns on the adapters' dropout (none without it)."""
    weight = getattr(module, name)
    if isinstance(weight, adapters.NF4Weight):
        y = nf4_dense(weight.codes[...], weight.absmax[...], x, weight.shape, module.dtype, in_dims)
    elif weight.dtype != module.dtype:
        y = cast_dense(weight[...], x, module.dtype, in_dims)
    else:
        y = dense(x, weight[...], in_dims)
    if module.lora_scale is not None:
        update = adapters.delta(module, name, x, dense, module.lora_scale, module.dtype, module.lora_dropout,
                                lora_key)
        if update is not None:
            y = y + update
    return y


def adapt(module, names, rngs: nnx.Rngs, lora, param_dtype, scope: str = "") -> None:
    """Give `module`'s weights `names` that `lora` targets their adapters (and NF4 storage under QLoRA).
    `scope`: "" in the decoder, `adapters.VISION` in the vision tower, whose targets carry that prefix and
    whose base stays float under QLoRA (NF4 is the decoder's: the tower is a small part of the weights)."""
    module.lora_scale = lora.scale if lora is not None else None
    module.lora_dropout = float(lora.dropout) if lora is not None else 0.0
    if lora is None:
        return
    for name in names:
        if scope + name not in lora.targets:
            continue
        weight = getattr(module, name)
        shape, axes = weight.shape, weight.get_metadata()["logical_axes"]
        # f32 whatever the base's dtype: the adapters are the master weights Adam updates.
        a, b = adapters.create(rngs, name, shape, axes, lora.rank, jnp.float32)
        setattr(module, name + adapters.SUFFIX_A, a)
        setattr(module, name + adapters.SUFFIX_B, b)
        if lora.quantize_base == "nf4" and not scope:
            setattr(module, name, adapters.NF4Weight(shape, param_dtype, rngs, f"{type(module).__name__}.{name}"))


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


class Attention(nnx.Module):
    """Multi-head attention with grouped key/value heads.

    The mask comes from ids (`attention.attend`): `causal=True` for the decoder, `causal=False`
    (the vision encoders: bidirectional within a segment). `implementation` is
    config.model.attention (`attention.IMPLEMENTATIONS`).
    """

    def __init__(self, dim, num_heads, num_kv_heads, head_dim, *, bias: bool, rope_theta: float | None,
                 dtype, param_dtype, rngs: nnx.Rngs, qk_norm: bool = False, rope_scaling=None, eps=1e-6,
                 causal: bool = True, mrope_section: tuple[int, ...] | None = None, mrope_interleaved: bool = False,
                 implementation: str = "auto", lora=None, lora_scope: str = ""):
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"attention implementation {implementation!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
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
        self.implementation = implementation
        adapt(self, adapters.ATTENTION, rngs, lora, param_dtype, lora_scope)

    def _project(self, x, positions, lora_key=None):
        """Queries [B, T, N, H] and keys, values [B, T, K, H], normed and rotated as the model attends them."""
        x = x.astype(self.dtype)
        q, k, v = (linear(self, name, x, lora_key=lora_key) for name in ("q", "k", "v"))
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
        return constrain(q, ("batch", "length", "act_heads", None)), k, v

    def _output(self, out, lora_key=None):
        return linear(self, "o", out, in_dims=2, lora_key=lora_key)

    def __call__(self, x, positions, segment_ids, branch_ids=None):
        """x: [B, T, D]; positions: [B, T] (or [B, T, A]); segment_ids, branch_ids: int [B, T] (`attention.attend`)."""
        return self.prefill(x, positions, segment_ids, branch_ids)[0]

    def prefill(self, x, positions, segment_ids, branch_ids=None, lora_key=None):
        """`__call__`, also returning the keys and values [B, T, K, H] a KV cache keeps (`lora_key`: `linear`)."""
        q, k, v = self._project(x, positions, lora_key)
        out = attend(q, k, v, segment_ids, branch_ids, causal=self.causal, implementation=self.implementation)
        return self._output(out, lora_key), k, v

    def decode(self, x, positions, cache: kv_cache.KVCache, layer, cursor):
        """One token per row. x: [B, 1, D]; positions [B, 1] (or [B, 1, 3]); the token's keys and values go
        to slot cursor[b] of `layer` in `cache`, and its query attends that row's slots <= cursor[b]."""
        q, k, v = self._project(x, positions)
        cache = kv_cache.write_token(cache, layer, k[:, 0], v[:, 0], cursor)
        keys, values = kv_cache.layer_view(cache, layer)
        out = kv_cache.attend_token(q[:, 0], keys, values, cursor)
        return self._output(out[:, None]), cache

    def extend(self, x, positions, cache: kv_cache.KVCache, layer, cursor):
        """T tokens per row (speculative verification). x: [B, T, D]; positions [B, T]; their keys and
        values go to slots cursor[b] .. cursor[b] + T - 1 of `layer`, and query t attends slots <= cursor[b] + t."""
        q, k, v = self._project(x, positions)
        cache = kv_cache.write_block(cache, layer, k, v, cursor)
        keys, values = kv_cache.layer_view(cache, layer)
        return self._output(kv_cache.attend_block(q, keys, values, cursor)), cache


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
    def __init__(self, dim, hidden, dtype, param_dtype, rngs: nnx.Rngs, lora=None, lora_scope: str = ""):
        self.gate = param(rngs, (dim, hidden), ("embed", "mlp"), param_dtype)
        self.up = param(rngs, (dim, hidden), ("embed", "mlp"), param_dtype)
        self.down = param(rngs, (hidden, dim), ("mlp", "embed"), param_dtype)
        self.dtype = dtype
        adapt(self, adapters.MLP, rngs, lora, param_dtype, lora_scope)

    def __call__(self, x, lora_key=None):
        x = x.astype(self.dtype)
        gate, up = linear(self, "gate", x, lora_key=lora_key), linear(self, "up", x, lora_key=lora_key)
        hidden = constrain(gated_silu(gate, up), ("batch", "length", "act_mlp"))
        return linear(self, "down", hidden, lora_key=lora_key)


class Block(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim, num_heads, num_kv_heads, head_dim, mlp_dim, *, bias, rope_theta, eps,
                 dtype, param_dtype, rngs, qk_norm=False, rope_scaling=None, causal=True, mrope_section=None,
                 mrope_interleaved=False, attention="auto", lora=None, lora_scope=""):
        self.attn_norm = RMSNorm(dim, eps, param_dtype, rngs)
        self.attn = Attention(dim, num_heads, num_kv_heads, head_dim, bias=bias, rope_theta=rope_theta,
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs, qk_norm=qk_norm,
                              rope_scaling=rope_scaling, eps=eps, causal=causal, mrope_section=mrope_section,
                              mrope_interleaved=mrope_interleaved, implementation=attention, lora=lora,
                              lora_scope=lora_scope)
        self.mlp_norm = RMSNorm(dim, eps, param_dtype, rngs)
        self.mlp = SwiGLU(dim, mlp_dim, dtype, param_dtype, rngs, lora=lora, lora_scope=lora_scope)

    def __call__(self, x, positions, segment_ids, branch_ids=None, lora_key=None):
        """`lora_key`: a training step's key for this layer (its adapters' dropout; `linear`)."""
        return self.prefill(x, positions, segment_ids, branch_ids, lora_key)[0]

    def _finish(self, x, attended, lora_key=None):
        x = x + attended.astype(x.dtype)
        x = constrain(x, ("batch", "length", "act_embed"))
        return x + self.mlp(self.mlp_norm(x), lora_key).astype(x.dtype)

    def prefill(self, x, positions, segment_ids, branch_ids=None, lora_key=None):
        """The block's output and its attention's keys and values [B, T, K, H] (`Attention.prefill`)."""
        attended, k, v = self.attn.prefill(self.attn_norm(x), positions, segment_ids, branch_ids, lora_key)
        return self._finish(x, attended, lora_key), k, v

    def decode(self, x, positions, cache, layer, cursor):
        """One token per row against the KV cache (`Attention.decode`) → (output [B, 1, D], cache)."""
        attended, cache = self.attn.decode(self.attn_norm(x), positions, cache, layer, cursor)
        return self._finish(x, attended), cache

    def extend(self, x, positions, cache, layer, cursor):
        """T tokens per row against the KV cache (`Attention.extend`) → (output [B, T, D], cache)."""
        attended, cache = self.attn.extend(self.attn_norm(x), positions, cache, layer, cursor)
        return self._finish(x, attended), cache
