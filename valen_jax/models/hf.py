"""Hugging Face checkpoints in and out: the one entry point over text and vision-language import/export.

    model, cfg = from_pretrained("Qwen/Qwen2.5-0.5B", dtype="bfloat16", mesh=mesh)
    save_pretrained(model, "/tmp/export")   # transformers loads it (AutoModelForCausalLM, or the VL class)

A facade: Qwen2, Qwen3 and Llama decoders are `hf_text`'s, Qwen2-VL, Qwen2.5-VL and Qwen3-VL
checkpoints (decoder + vision tower + M-RoPE) `hf_vl`'s, and what both use (the error, the
checkpoint resolver, dtype names, added-token rows) `hf_common`'s. This module picks one by the
checkpoint's config.json (or the model's config) and re-exports the names callers use
(`hf.HFImportError`, `hf.resolve`, `hf.config_from_hf`, `hf.load_params`...); nothing below it imports it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from valen_jax.models import hf_text, hf_vl, lora, lora_init, sharding
from valen_jax.models.config import ModelConfig
from valen_jax.models.hf_common import HFImportError, added_token_pieces, dtype_name, extend_rows, resolve
from valen_jax.models.hf_text import FAMILIES, config_from_hf, config_to_hf, decoder_tensors, load_params
from valen_jax.models.transformer import Transformer, abstract_model

__all__ = ["FAMILIES", "HFImportError", "added_token_pieces", "config_from_hf", "config_to_hf", "decoder_tensors",
           "dtype_name", "extend_rows", "from_pretrained", "load_params", "resolve", "save_pretrained"]


def from_pretrained(path_or_name: str | Path, dtype="float32", param_dtype="float32",
                    mesh: Mesh | None = None, revision: str | None = None, **overrides) -> tuple[nnx.Module, ModelConfig]:
    """The model (with logits from `model(tokens, positions, segment_ids)`) and its config, text or VL.

    `dtype`/`param_dtype`: a name ("bfloat16") or a JAX/NumPy dtype (`jnp.bfloat16`); `lora=LoraConfig(...)`
    in `overrides` adds adapters to the imported base (`models/lora.py`)."""
    directory = resolve(path_or_name, revision)
    if not (directory / "config.json").is_file():
        raise HFImportError(f"{path_or_name}: no config.json in {directory}; not a transformers checkpoint")
    hf_config = json.loads((directory / "config.json").read_text())
    importer = hf_vl if hf_vl.is_vl(hf_config) else hf_text
    cfg = importer.config_from_hf(hf_config, dtype=dtype_name(dtype), param_dtype=dtype_name(param_dtype), **overrides)
    graphdef, abstract = abstract_model(cfg)
    if mesh is None:
        mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
    if cfg.lora is None:
        return nnx.merge(graphdef, importer.load_params(directory, cfg, shardings)), cfg
    # `lora=LoraConfig(...)`: the checkpoint is the base; fresh adapters beside it (NF4 under QLoRA).
    base = importer.load_params(directory, lora.base_config(cfg), lora_init.base_shardings(cfg, shardings))
    return nnx.merge(graphdef, lora_init.attach(base, cfg, shardings, seed=0)), cfg


def save_pretrained(model: Transformer, path: str | Path, family: str | None = None) -> Path:
    """Write config.json + model.safetensors that `transformers` loads as the same model: a Qwen-VL
    checkpoint for a model with M-RoPE (decoder and vision tower), else a `family` decoder (default: the
    one the config implies). A LoRA model is written merged: W + (alpha/r)·A·B, NF4 dequantised."""
    if model.cfg.lora is not None:
        base_cfg = lora.base_config(model.cfg)
        params = lora.merged(nnx.to_pure_dict(nnx.state(model)), model.cfg)
        model = nnx.merge(abstract_model(base_cfg)[0], params)
    if model.cfg.mrope_section is not None:
        return hf_vl.save_pretrained(model, path)
    return hf_text.save_pretrained(model, path, family)
