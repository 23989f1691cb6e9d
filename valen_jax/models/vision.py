"""A ViT over variable grids whose patch merger projects into the decoder's width.

Layout follows Qwen2-VL: patches of temporal × patch² pixels → bidirectional transformer
blocks with (t, h, w) rotary positions, attention confined to one image or clip → each run of
merge_size² patches (one spatial window, as the processor orders them) concatenated and
projected to one text-width token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from valen_jax.models import image_norm
from valen_jax.models import lora as adapters
from valen_jax.models.config import VisionConfig, dtype_of
from valen_jax.models.layers import Block, RMSNorm, adapt, linear, param


def grid_position_embeddings(rows, columns, dim: int, theta: float = 10000.0):
    """Fixed 2-D sin/cos embeddings [..., dim] of patch (row, column) positions (MAE's 2-D sincos):
    the first half of the channels encodes the row, the second the column, each as sin and cos at
    dim / 4 frequencies from 1 down to 1/theta."""
    quarter = dim // 4
    frequencies = theta ** (-jnp.arange(quarter, dtype=jnp.float32) / quarter)

    def one(position):
        angle = position.astype(jnp.float32)[..., None] * frequencies
        return [jnp.sin(angle), jnp.cos(angle)]

    return jnp.concatenate(one(rows) + one(columns), axis=-1)


class VisionEncoder(nnx.Module):
    def __init__(self, cfg: VisionConfig, text_dim: int, dtype: str, param_dtype: str, rngs: nnx.Rngs,
                 attention: str = "auto", lora=None):
        pdt, cdt = dtype_of(param_dtype), dtype_of(dtype)
        self.cfg = cfg
        self.dtype = cdt
        # standardise_pixels: the raw patch and its image-standardised copy side by side (models/image_norm.py).
        features = cfg.patch_dim * (2 if cfg.standardise_pixels else 1)
        self.patch_embed = param(rngs, (features, cfg.dim), ("patch", "embed"), pdt)
        self.blocks = nnx.List([
            Block(cfg.dim, cfg.num_heads, cfg.num_heads, cfg.dim // cfg.num_heads, cfg.mlp_dim, bias=True,
                  rope_theta=cfg.rope_theta, eps=1e-6, dtype=cdt, param_dtype=pdt, rngs=rngs,
                  causal=False, attention=attention, lora=lora, lora_scope=adapters.VISION)
            for _ in range(cfg.num_layers)
        ])
        merged = cfg.dim * cfg.merge_size * cfg.merge_size
        self.merge_norm = RMSNorm(merged, 1e-6, pdt, rngs)
        self.merge_in = param(rngs, (merged, merged), ("embed", "mlp"), pdt)
        self.merge_out = param(rngs, (merged, text_dim), ("mlp", "embed"), pdt)
        adapt(self, ("merge_in", "merge_out"), rngs, lora, pdt, adapters.VISION)

    def __call__(self, patches, positions, segments, lora_key=None):
        """patches [B, P, patch_dim]; positions int [B, P, 3]; segments int [B, P] → [B, P / merge², text_dim].
        `lora_key`: a training step's key (adapter dropout), one per block and one for the merger."""
        cfg = self.cfg
        batch, count = patches.shape[:2]
        group = cfg.merge_size * cfg.merge_size
        features = patches.astype(self.dtype)
        if cfg.standardise_pixels:
            features = jnp.concatenate([features, image_norm.standardised(features, segments)], axis=-1)
        x = jnp.einsum("bpc,cd->bpd", features, self.patch_embed[...].astype(self.dtype))
        if cfg.absolute_positions:
            x = x + grid_position_embeddings(positions[..., 1], positions[..., 2], cfg.dim).astype(self.dtype)
        keys = [None] * (len(self.blocks) + 1) if lora_key is None else jax.random.split(lora_key, len(self.blocks) + 1)
        for block, key in zip(self.blocks, keys, strict=False):  # patches attend within their own media item
            x = block(x, positions, segments, lora_key=key)
        x = self.merge_norm(x.reshape(batch, count // group, group * cfg.dim))
        hidden = nnx.gelu(linear(self, "merge_in", x.astype(self.dtype), lora_key=keys[-1]))
        return linear(self, "merge_out", hidden, lora_key=keys[-1])
