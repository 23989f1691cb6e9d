"""Import and export Hugging Face Qwen2, Qwen3 and Llama decoders (`*ForCausalLM` checkpoints).

`hf.from_pretrained` / `hf.save_pretrained` (the facade) call this module for text checkpoints and
`hf_vl` for vision-language ones; `hf_vl` builds its decoder on this one (a Qwen-VL decoder is a
Qwen2/Qwen3 decoder with M-RoPE). Parameters are built shard by shard with
`jax.make_array_from_callback` from memory-mapped safetensors, one tensor at a time: no device (and
no host) ever holds the whole model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from valen_jax.models.config import ModelConfig, RopeScaling
from valen_jax.models.hf_common import HFImportError, extend_rows, get_path, set_path
from valen_jax.models.safetensors_io import CheckpointTensors, save_file
from valen_jax.models.transformer import Transformer, abstract_model

FAMILIES = ("qwen2", "qwen3", "llama")
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    family = hf.get("model_type")
    if "text_config" in hf and "vision_config" in hf:
        # Its decoder alone would drop the vision tower and M-RoPE: a different model.
        raise HFImportError(f"model_type {family!r} is a vision-language checkpoint: hf.from_pretrained and "
                            "config.model.init_from import it whole (hf_vl.config_from_hf)")
    if family not in FAMILIES:
        raise HFImportError(f"model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFImportError(f"hidden_act {hf['hidden_act']!r}: only silu (SwiGLU) is implemented")
    if hf.get("mlp_bias"):
        raise HFImportError("mlp_bias=true is not implemented")
    if hf.get("use_sliding_window"):
        raise HFImportError("sliding-window attention is not implemented")
    rope = dict(hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0),
                                              **(hf.get("rope_scaling") or {})})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type != "default":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = RopeScaling(rope_type, **{k: rope[k] for k in keys if k in rope})
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads), head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"], rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        # Qwen2 always has q/k/v biases; Llama and Qwen3 say so in `attention_bias`.
        attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=family == "qwen3", rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), **overrides)


def config_to_hf(cfg: ModelConfig, family: str) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**dataclasses.asdict(cfg.rope_scaling), "rope_theta": cfg.rope_theta}
    if family == "qwen2" and not cfg.attention_bias:
        raise HFImportError("Qwen2 always has attention biases; export this model as llama or qwen3")
    return {
        "model_type": family, "architectures": [_ARCHITECTURES[family]], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias, "hidden_act": "silu",
        "max_position_embeddings": 32768, "dtype": cfg.param_dtype,
    }


def _layer_tensors(cfg: ModelConfig, i: int) -> Iterator[tuple[tuple, str, callable, callable]]:
    """(our path inside a layer, HF name, to ours, to HF) for every tensor of layer i."""
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dim
    prefix = f"model.layers.{i}."
    yield ("attn_norm", "scale"), prefix + "input_layernorm.weight", None, None
    yield ("mlp_norm", "scale"), prefix + "post_attention_layernorm.weight", None, None
    for ours, hf, heads in (("q", "q_proj", n), ("k", "k_proj", k), ("v", "v_proj", k)):
        yield (("attn", ours), f"{prefix}self_attn.{hf}.weight",
               lambda w, heads=heads: w.T.reshape(d, heads, h), lambda w: w.reshape(d, -1).T)
        if cfg.attention_bias:
            yield (("attn", ours + "_bias"), f"{prefix}self_attn.{hf}.bias",
                   lambda b, heads=heads: b.reshape(heads, h), lambda b: b.reshape(-1))
    yield ("attn", "o"), prefix + "self_attn.o_proj.weight", lambda w: w.T.reshape(n, h, d), lambda w: w.reshape(-1, d).T
    if cfg.qk_norm:
        yield ("attn", "q_norm", "scale"), prefix + "self_attn.q_norm.weight", None, None
        yield ("attn", "k_norm", "scale"), prefix + "self_attn.k_norm.weight", None, None
    for ours, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        yield ("mlp", ours), f"{prefix}mlp.{hf}.weight", np.transpose, np.transpose


def _top_tensors(cfg: ModelConfig):
    yield ("embed",), "model.embed_tokens.weight", None, None
    yield ("final_norm", "scale"), "model.norm.weight", None, None
    if not cfg.tie_embeddings:
        yield ("lm_head",), "lm_head.weight", None, np.transpose  # import transposes after growing rows


def _host_param(tensors: CheckpointTensors, cfg: ModelConfig, path: tuple, dtype,
                added_pieces: dict[int, list[int]]) -> np.ndarray:
    """The full host array of one parameter of ours, converted from the HF tensors."""
    if path[0] != "layers":
        for ours, name, convert, _ in _top_tensors(cfg):
            if ours == path:
                value = np.asarray(tensors.get(name))
                if path in (("embed",), ("lm_head",)) and (added_pieces or value.shape[0] != cfg.vocab_size):
                    value = extend_rows(value, cfg.vocab_size, added_pieces)
                if path == ("lm_head",):  # HF stores [V, D]; ours is [D, V]
                    return value.T.astype(dtype)
                return (convert(value) if convert else value).astype(dtype)
    layer_path = path[2:] if not cfg.scan_layers else path[1:]
    layers = [path[1]] if not cfg.scan_layers else range(cfg.num_layers)
    stacked = []
    for i in layers:
        match = [(name, convert) for ours, name, convert, _ in _layer_tensors(cfg, i) if ours == layer_path]
        if not match:
            raise HFImportError(f"no HF tensor maps to parameter {'/'.join(map(str, path))}")
        name, convert = match[0]
        value = np.asarray(tensors.get(name))
        stacked.append((convert(value) if convert else value).astype(dtype))
    return stacked[0] if not cfg.scan_layers else np.stack(stacked)


def load_params(directory: str | Path, cfg: ModelConfig, shardings, added_pieces: dict[int, list[int]] | None = None,
                fresh: dict | None = None, tensors: CheckpointTensors | None = None) -> dict:
    """Sharded parameters of `cfg` from an HF checkpoint; each device receives only its slice.

    `added_pieces` maps token ids beyond the checkpoint's vocabulary to their base-tokenizer
    pieces (see `extend_rows`). Parameters the checkpoint has no counterpart for (a vision
    tower, a score head) are taken from `fresh`, a freshly initialised parameter tree;
    without it they are an error. `tensors`: the checkpoint reader (default: `directory`'s).
    """
    tensors = tensors if tensors is not None else CheckpointTensors(directory)
    _, abstract = abstract_model(cfg)
    shapes = nnx.to_pure_dict(abstract)
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(np.float32)
    params: dict = jax.tree.map(lambda _: None, shapes)
    for key_path, shape in jax.tree_util.tree_leaves_with_path(shapes):
        path = tuple(k.key for k in key_path)
        if path[0] in ("vision", "score_head"):
            if fresh is None:
                raise HFImportError(f"{'/'.join(map(str, path))}: not in a text checkpoint; pass fresh parameters")
            set_path(params, path, get_path(fresh, path))
            continue
        host = _host_param(tensors, cfg, path, dtype, added_pieces or {})
        if host.shape != shape.shape:
            raise HFImportError(f"{'/'.join(map(str, path))}: checkpoint gives {host.shape}, model wants {shape.shape}")
        target = get_path(shardings, path)
        set_path(params, path, jax.make_array_from_callback(host.shape, target, lambda index, host=host: host[index]))
        del host
    return params


def save_pretrained(model: Transformer, path: str | Path, family: str | None = None) -> Path:
    """Write config.json + model.safetensors that `transformers.AutoModelForCausalLM` loads as the same model."""
    cfg: ModelConfig = model.cfg
    if cfg.mrope_section is not None:
        raise HFImportError("a model with M-RoPE exports as a Qwen-VL checkpoint: hf.save_pretrained (hf_vl)")
    family = family or ("qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    params = jax.tree.map(lambda a: np.asarray(jax.device_get(a)), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    save_file(decoder_tensors(cfg, params), path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, family), indent=2) + "\n")
    return path


def decoder_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """The decoder's tensors under their HF names, from host parameters."""
    tensors = {}
    for ours, name, _, back in _top_tensors(cfg):
        value = get_path(params, ours)
        tensors[name] = back(value) if back else value
    for i in range(cfg.num_layers):
        for ours, name, _, back in _layer_tensors(cfg, i):
            value = get_path(params["layers"], ours)[i] if cfg.scan_layers else get_path(params["layers"][i], ours)
            tensors[name] = np.ascontiguousarray(back(value) if back else value)
    return tensors
