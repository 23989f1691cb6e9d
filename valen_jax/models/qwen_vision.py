"""The Qwen2-VL and Qwen2.5-VL vision towers, numerically as transformers defines them
(`modeling_qwen2_vl.py`, `modeling_qwen2_5_vl.py`).

patches [B, P, C·T·p·p] (the processor's order: each run of merge² patches is one merge
window) → one matmul (the Conv3d with stride = kernel) → LayerNorm blocks with fused-bias QKV,
2-D rotary over (h, w) and a `hidden_act` MLP → PatchMerger (ln_q per patch, merge² patches
concatenated, Linear → GELU → Linear into the decoder width).

Attention stays within one frame of one media item: HF's `cu_seqlens` split a video per
temporal patch, so attention here is "same segment and same t". Qwen2.5-VL uses RMSNorm and a
biased SwiGLU MLP, and all blocks but `fullatt_blocks` attend within windows of
window_size / patch_size patches a side (HF permutes patches into windows and back; the same
windows as ids give the same result without moving anything). Both are one id per patch
(`cell_segments`) handed to `attention.attend` as segment ids: no [P, P] mask is built. Qwen3-VL's tower is Qwen2-VL's
with a patch-embedding bias, a learned square position table resampled bilinearly to each grid,
and "deepstack" mergers whose outputs the decoder adds after its first layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from valen_jax.models import lora as adapters
from valen_jax.models.attention import IMPLEMENTATIONS, attend
from valen_jax.models.config import VisionConfig, dtype_of
from valen_jax.models.layers import RMSNorm, adapt, dense, inverse_frequencies, linear, param, rotate

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"vision hidden_act {name!r} is not implemented; implemented: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm (scale and bias), normalised in f32."""

    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("norm",), param_dtype, init="ones")
        self.bias = param(rngs, (dim,), ("norm",), param_dtype, init="zeros")
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def vision_rope(x, positions, theta: float):
    """HF's axial vision rotary: frequencies of head_dim/2, h then w, repeated for the two halves.
    x: [B, P, N, H]; positions: [B, P, 3] (t, h, w)."""
    inv_freq = jnp.asarray(inverse_frequencies(x.shape[-1] // 2, theta, None))  # head_dim/2: h and w halves
    pos = positions.astype(jnp.float32)
    return rotate(x, jnp.concatenate([pos[..., 1:2] * inv_freq, pos[..., 2:3] * inv_freq], axis=-1))  # [B, P, H/2]


def cell_segments(positions, segments, window: int = 0):
    """One attention segment id per patch: equal for patches of the same media item and frame (and
    `window`² patch window when > 0), 0 for padding (segment 0), which then attends only to itself.

    A dense rank of the key (segment, t[, h // window, w // window]) computed by one sort along the
    row and a scatter back: O(P log P), where comparing every pair would build the [P, P] mask.
    """
    keys = [segments, positions[..., 0]]
    if window:  # windows start at row/column 0 (HF pads at the far edges)
        keys += [positions[..., 1] // window, positions[..., 2] // window]
    batch, count = segments.shape
    order = jnp.broadcast_to(jnp.arange(count, dtype=jnp.int32), (batch, count))
    *ordered, perm = jax.lax.sort([*keys, order], dimension=1, num_keys=len(keys))
    changed = jnp.zeros((batch, count - 1), bool)
    for key in ordered:
        changed |= key[:, 1:] != key[:, :-1]
    rank = jnp.cumsum(jnp.concatenate([jnp.ones((batch, 1), jnp.int32), changed.astype(jnp.int32)], axis=1), axis=1)
    ids = jnp.zeros_like(rank).at[jnp.arange(batch)[:, None], perm].set(rank)
    return jnp.where(segments > 0, ids, 0)


def _segment_max(values, segments):
    """Each patch's largest value over its own segment, [B, P] (segment ids are 0..P: the k-th media item)."""
    count = segments.shape[1] + 1
    top = jax.vmap(lambda v, s: jax.ops.segment_max(v, s, num_segments=count))(values, segments)
    return jnp.take_along_axis(top, segments, axis=1)


def resampled_positions(table, positions, segments, side: int):
    """HF `get_vision_interpolation_indices_and_weights` (bilinear, align_corners): each patch's entry of the
    side × side table resampled to its item's (h, w) grid, read off the largest row/column in its segment."""
    rows, cols = positions[..., 1], positions[..., 2]
    heights = jnp.maximum(_segment_max(rows, segments), 0) + 1
    widths = jnp.maximum(_segment_max(cols, segments), 0) + 1
    offsets = jnp.arange(2)

    def taps(index, size):
        src = index.astype(jnp.float32) * (side - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
        floor = jnp.floor(src)
        where = jnp.clip(floor.astype(jnp.int32)[..., None] + offsets, 0, side - 1)
        return where, jnp.clip(1 - jnp.abs(src[..., None] - floor[..., None] - offsets), 0)

    (h_taps, h_weights), (w_taps, w_weights) = taps(rows, heights), taps(cols, widths)
    index = (h_taps[..., :, None] * side + w_taps[..., None, :]).reshape(*rows.shape, 4)
    weights = (h_weights[..., :, None] * w_weights[..., None, :]).reshape(*rows.shape, 4)
    return jnp.sum(jnp.take(table, index, axis=0) * weights[..., None], axis=-2)


class Merger(nnx.Module):
    """norm → merge² patches concatenated → Linear → GELU → Linear. `post_shuffle` (Qwen3-VL deepstack)
    normalises the concatenation instead of each patch."""

    def __init__(self, cfg: VisionConfig, text_dim: int, norm, post_shuffle: bool, param_dtype, rngs: nnx.Rngs):
        merged = cfg.dim * cfg.merge_size * cfg.merge_size
        self.norm = norm(merged if post_shuffle else cfg.dim, 1e-6, param_dtype, rngs)
        self.fc1 = param(rngs, (merged, merged), ("embed", "mlp"), param_dtype)
        self.fc1_bias = param(rngs, (merged,), ("mlp",), param_dtype, "zeros")
        self.fc2 = param(rngs, (merged, text_dim), ("mlp", "embed"), param_dtype)
        self.fc2_bias = param(rngs, (text_dim,), ("norm",), param_dtype, "zeros")
        self.post_shuffle = post_shuffle
        self.merged = merged

    def __call__(self, x, cdt):
        batch, count = x.shape[:2]
        group = self.merged // x.shape[-1]
        x = x.reshape(batch, count // group, self.merged) if self.post_shuffle else x
        x = self.norm(x).reshape(batch, count // group, self.merged)
        hidden = jax.nn.gelu(dense(x, self.fc1[...].astype(cdt)) + self.fc1_bias[...].astype(cdt), approximate=False)
        return dense(hidden, self.fc2[...].astype(cdt)) + self.fc2_bias[...].astype(cdt)


class QwenVisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype, param_dtype, rngs: nnx.Rngs, attention: str = "auto", lora=None):
        if attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention implementation {attention!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
        d, n = cfg.dim, cfg.num_heads
        h = d // n
        self.swiglu = cfg.family == "qwen2_5_vl"
        norm = RMSNorm if self.swiglu else LayerNorm
        self.norm1 = norm(d, 1e-6, param_dtype, rngs)
        self.norm2 = norm(d, 1e-6, param_dtype, rngs)
        # HF fuses q, k, v into one [3·D, D] Linear; kept fused (axis 1 = q/k/v) so the import is a reshape.
        self.qkv = param(rngs, (d, 3, n, h), ("embed", None, "heads", "head_dim"), param_dtype)
        self.qkv_bias = param(rngs, (3, n, h), (None, "heads", "head_dim"), param_dtype, "zeros")
        self.proj = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), param_dtype)
        self.proj_bias = param(rngs, (d,), ("norm",), param_dtype, "zeros")
        # Qwen2-VL: fc1 → act → fc2. Qwen2.5-VL: act(gate) · up → down, all with biases.
        ins = ("gate", "up") if self.swiglu else ("fc1",)
        for name in ins:
            setattr(self, name, param(rngs, (d, cfg.mlp_dim), ("embed", "mlp"), param_dtype))
            setattr(self, name + "_bias", param(rngs, (cfg.mlp_dim,), ("mlp",), param_dtype, "zeros"))
        out = "down" if self.swiglu else "fc2"
        setattr(self, out, param(rngs, (cfg.mlp_dim, d), ("mlp", "embed"), param_dtype))
        setattr(self, out + "_bias", param(rngs, (d,), ("norm",), param_dtype, "zeros"))
        self.act = activation(cfg.hidden_act)
        self.theta = cfg.rope_theta
        self.dtype = dtype
        self.attention = attention
        adapt(self, ("qkv", "proj", *ins, out), rngs, lora, param_dtype, adapters.VISION)

    def __call__(self, x, positions, segment_ids, lora_key=None):
        """segment_ids [B, P]: `cell_segments`, patches attend within equal ids (bidirectional). `lora_key`: a
        training step's key for this block (its adapters' dropout; `layers.linear`)."""
        cdt = self.dtype
        y = self.norm1(x).astype(cdt)
        # `linear`: the weight in the compute dtype, plus its adapter when config.model.lora targets it.
        qkv = linear(self, "qkv", y, lora_key=lora_key) + self.qkv_bias[...].astype(cdt)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = vision_rope(q, positions, self.theta), vision_rope(k, positions, self.theta)
        out = attend(q, k, v, segment_ids, causal=False, implementation=self.attention)
        x = x + (linear(self, "proj", out, in_dims=2, lora_key=lora_key) + self.proj_bias[...].astype(cdt)).astype(x.dtype)
        y = self.norm2(x).astype(cdt)

        def biased(name, value):
            return linear(self, name, value, lora_key=lora_key) + getattr(self, name + "_bias")[...].astype(cdt)

        if self.swiglu:
            return x + biased("down", self.act(biased("gate", y)) * biased("up", y)).astype(x.dtype)
        return x + biased("fc2", self.act(biased("fc1", y))).astype(x.dtype)


class QwenVisionEncoder(nnx.Module):
    """Same call as `vision.VisionEncoder`: (patches, positions, segments) → [B, P / merge², text_dim]; with
    deepstack layers (Qwen3-VL) → (that, [one such array per deepstack layer])."""

    def __init__(self, cfg: VisionConfig, text_dim: int, dtype: str, param_dtype: str, rngs: nnx.Rngs,
                 attention: str = "auto", lora=None):
        pdt, cdt = dtype_of(param_dtype), dtype_of(dtype)
        self.cfg = cfg
        self.dtype = cdt
        self.patch_embed = param(rngs, (cfg.patch_dim, cfg.dim), ("patch", "embed"), pdt)
        if cfg.family == "qwen3_vl":
            self.patch_bias = param(rngs, (cfg.dim,), ("norm",), pdt, "zeros")
            self.pos_embed = param(rngs, (cfg.num_position_embeddings, cfg.dim), ("patch", "embed"), pdt)
            self.deepstack = nnx.List([Merger(cfg, text_dim, LayerNorm, True, pdt, rngs) for _ in cfg.deepstack_layers])
        self.blocks = nnx.List([QwenVisionBlock(cfg, cdt, pdt, rngs, attention, lora) for _ in range(cfg.num_layers)])
        merged = cfg.dim * cfg.merge_size * cfg.merge_size
        self.ln_q = (RMSNorm if cfg.family == "qwen2_5_vl" else LayerNorm)(cfg.dim, 1e-6, pdt, rngs)
        self.merge_in = param(rngs, (merged, merged), ("embed", "mlp"), pdt)
        self.merge_in_bias = param(rngs, (merged,), ("mlp",), pdt, "zeros")
        self.merge_out = param(rngs, (merged, text_dim), ("mlp", "embed"), pdt)
        self.merge_out_bias = param(rngs, (text_dim,), ("norm",), pdt, "zeros")
        adapt(self, ("merge_in", "merge_out"), rngs, lora, pdt, adapters.VISION)

    def __call__(self, patches, positions, segments, lora_key=None):
        cfg, cdt = self.cfg, self.dtype
        # A training step's key (adapter dropout): one per block, one for the merger.
        keys = [None] * (cfg.num_layers + 1) if lora_key is None else jax.random.split(lora_key, cfg.num_layers + 1)
        batch, count = patches.shape[:2]
        group = cfg.merge_size * cfg.merge_size
        x = jnp.einsum("bpc,cd->bpd", patches.astype(cdt), self.patch_embed[...].astype(cdt))
        qwen3 = cfg.family == "qwen3_vl"
        if qwen3:
            side = int(round(cfg.num_position_embeddings ** 0.5))
            x = x + self.patch_bias[...].astype(cdt)
            x = x + resampled_positions(self.pos_embed[...], positions, segments, side).astype(cdt)
        deep = []
        frames = cell_segments(positions, segments)
        window = cfg.window_size // cfg.patch_size // cfg.merge_size * cfg.merge_size if cfg.window_size else 0
        windows = cell_segments(positions, segments, window) if window else frames
        for i, block in enumerate(self.blocks):
            x = block(x, positions, frames if not window or i in cfg.fullatt_blocks else windows, lora_key=keys[i])
            if qwen3 and i in cfg.deepstack_layers:
                deep.append(self.deepstack[cfg.deepstack_layers.index(i)](x, cdt))
        x = self.ln_q(x).reshape(batch, count // group, group * cfg.dim)
        hidden = jax.nn.gelu(linear(self, "merge_in", x.astype(cdt), lora_key=keys[-1])
                             + self.merge_in_bias[...].astype(cdt), approximate=False)
        out = linear(self, "merge_out", hidden, lora_key=keys[-1]) + self.merge_out_bias[...].astype(cdt)
        return (out, deep) if qwen3 else out
