"""Architecture settings as plain frozen dataclasses, saved as JSON in checkpoint meta."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from valen_jax.models.lora import LoraConfig
from valen_jax.models.remat import remat_name

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_of(name: str):
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class VisionConfig:
    """A ViT over variable grids: images and video clips of any size the processor allows."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    dim: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    rope_theta: float = 10000.0
    # "valen": our own RMSNorm/SwiGLU ViT (from-scratch models); "qwen2_vl": Qwen2-VL's tower
    # (LayerNorm blocks, fused-bias QKV, `hidden_act` MLP, 2-D rotary, ln_q → Linear → GELU → Linear merger);
    # "qwen2_5_vl": the same with RMSNorm, a biased SwiGLU MLP and window attention.
    family: str = "valen"
    hidden_act: str = "quick_gelu"
    window_size: int = 0  # qwen2_5_vl: attention window side in pixels, except in `fullatt_blocks`
    fullatt_blocks: tuple[int, ...] = ()
    tokens_per_second: int = 0  # qwen2_5_vl: video time positions per second (decoder M-RoPE), kept for export
    # "qwen3_vl": a learned square position table resampled to each grid, and features of these
    # blocks merged and added to the decoder's hidden states at the media slots after layers 0, 1, ...
    num_position_embeddings: int = 0
    deepstack_layers: tuple[int, ...] = ()
    # "valen" only: fixed 2-D sin/cos embeddings of each patch's (row, column) added to its embedding, so
    # a vision token's features say where it is in the image, not only what it shows (the rotary
    # positions of the blocks are relative: on a uniform background no token can tell its place).
    absolute_positions: bool = False
    # "valen" only: each patch's pixels are embedded beside a copy standardised over its whole image, per colour
    # channel (valen_jax.models.image_norm): a small object stands out on a background of any colour.
    standardise_pixels: bool = False

    @property
    def patch_dim(self) -> int:
        return self.temporal_patch_size * self.patch_size * self.patch_size * 3

    def __post_init__(self):
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            raise ValueError(f"vision dim {self.dim} must split into {self.num_heads} heads of even size")
        if self.family not in VISION_FAMILIES:
            raise ValueError(f"vision family {self.family!r}; choose one of {VISION_FAMILIES}")
        if self.absolute_positions and self.family != "valen":
            raise ValueError(f"absolute_positions is an option of the valen tower, not of {self.family!r}")
        if self.standardise_pixels and self.family != "valen":
            raise ValueError(f"standardise_pixels is an option of the valen tower, not of {self.family!r}")
        if self.absolute_positions and self.dim % 4:
            raise ValueError(f"absolute_positions: vision dim {self.dim} must be a multiple of 4 (sin, cos × row, column)")
        if self.family != "valen" and (self.dim // self.num_heads) % 4:
            raise ValueError(f"{self.family} vision head size {self.dim // self.num_heads} must be a multiple of 4 (h, w rotary)")


VISION_FAMILIES = ("valen", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class RopeScaling:
    """HF `rope_parameters` beyond the plain theta: "linear" or Llama 3's "llama3" frequency bands."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: linear, llama3")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # RMSNorm of each query/key head before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = True
    # What each layer keeps for the backward pass: none | full | save_dots | offload (models/remat.py).
    # Older checkpoint metas hold a bool: True is "full", False "none".
    remat: str = "none"
    scan_layers: bool = False  # one stacked block under nnx.scan: compile time independent of depth
    # config.model.attention: which kernel every Attention (decoder and vision) runs; attention.IMPLEMENTATIONS.
    attention: str = "auto"
    dtype: str = "float32"
    param_dtype: str = "float32"
    image_pad_id: int = -1
    video_pad_id: int = -1  # a second media-slot token (Qwen-VL's <|video_pad|>); -1: none
    # Qwen2-VL M-RoPE: frequency pairs per (t, h, w) position axis; positions are then [B, T, 3].
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL: pairs cycle t, h, w instead of running in sections
    score_head: bool = False  # a scalar head for Valen's scored branches
    vision: VisionConfig | None = None
    # config.model.lora: low-rank adapters on the decoder's (and targeted tower's) linear layers, QLoRA's NF4
    # base, or None.
    lora: LoraConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "remat", remat_name(self.remat))
        if self.lora is not None:
            self.lora.check_tower(self.vision)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        vision = data.pop("vision", None)
        scaling = data.pop("rope_scaling", None)
        lora = LoraConfig.from_json(data.pop("lora", None))
        if data.get("mrope_section") is not None:  # JSON gives a list; the frozen config keeps a tuple
            data["mrope_section"] = tuple(data["mrope_section"])
        if vision:
            vision = {**vision, **{k: tuple(vision[k]) for k in ("fullatt_blocks", "deepstack_layers") if k in vision}}
        return cls(**data, vision=VisionConfig(**vision) if vision else None,
                   rope_scaling=RopeScaling(**scaling) if scaling else None, lora=lora)


def padded_vocab(size: int, multiple: int = 128) -> int:
    """Round the vocabulary up so the `vocab` axis divides evenly over tensor-parallel shards."""
    return -(-size // multiple) * multiple
