"""A ViT image encoder whose patch merger projects into the decoder's width.

Layout follows Qwen2-VL's idea: patches → bidirectional transformer → each merge_size ×
merge_size neighbourhood concatenated and projected to one text-width token.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from valen_jax.models.config import VisionConfig, dtype_of
from valen_jax.models.layers import Block, RMSNorm, param


class VisionEncoder(nnx.Module):
    def __init__(self, cfg: VisionConfig, text_dim: int, dtype: str, param_dtype: str, rngs: nnx.Rngs):
        pdt, cdt = dtype_of(param_dtype), dtype_of(dtype)
        patch_in = cfg.patch_size * cfg.patch_size * 3
        self.cfg = cfg
        self.dtype = cdt
        self.patch_embed = param(rngs, (patch_in, cfg.dim), ("patch", "embed"), pdt)
        self.position = param(rngs, (cfg.grid * cfg.grid, cfg.dim), (None, "embed"), pdt)
        self.blocks = nnx.List([
            Block(cfg.dim, cfg.num_heads, cfg.num_heads, cfg.dim // cfg.num_heads, cfg.mlp_dim, bias=True,
                  rope_theta=None, eps=1e-6, dtype=cdt, param_dtype=pdt, rngs=rngs)
            for _ in range(cfg.num_layers)
        ])
        merged = cfg.dim * cfg.merge_size * cfg.merge_size
        self.merge_norm = RMSNorm(merged, 1e-6, pdt, rngs)
        self.merge_in = param(rngs, (merged, merged), ("embed", "mlp"), pdt)
        self.merge_out = param(rngs, (merged, text_dim), ("mlp", "embed"), pdt)

    def __call__(self, images):
        """images: float [N, H, W, 3] in [-1, 1] → [N, tokens_per_image, text_dim]."""
        cfg = self.cfg
        n, g, p, m = images.shape[0], cfg.grid, cfg.patch_size, cfg.merge_size
        patches = images.reshape(n, g, p, g, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(n, g * g, p * p * 3)
        x = jnp.einsum("npc,cd->npd", patches.astype(self.dtype), self.patch_embed[...].astype(self.dtype))
        x = x + self.position[...].astype(self.dtype)
        positions = jnp.zeros(x.shape[:2], jnp.int32)
        full = jnp.ones((n, 1, g * g, g * g), bool)
        for block in self.blocks:
            x = block(x, positions, full)
        # Group each m×m neighbourhood of the grid into one token.
        x = x.reshape(n, g // m, m, g // m, m, cfg.dim).transpose(0, 1, 3, 2, 4, 5)
        x = x.reshape(n, (g // m) ** 2, m * m * cfg.dim)
        x = self.merge_norm(x)
        hidden = nnx.gelu(jnp.einsum("ntd,df->ntf", x, self.merge_in[...].astype(self.dtype)))
        return jnp.einsum("ntf,fd->ntd", hidden, self.merge_out[...].astype(self.dtype))
