"""Import and export Hugging Face Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`, `Qwen3VLForConditionalGeneration`).

The decoder is a Qwen2 decoder with M-RoPE (`ModelConfig.mrope_section`); the vision tower is
`qwen_vision.QwenVisionEncoder` (`VisionConfig.family` = the checkpoint's model_type). Tensor names: transformers 5 `save_pretrained` writes the
legacy layout (`model.layers.*`, `visual.*`, `lm_head.weight`); checkpoints in the new layout
(`model.language_model.*`, `model.visual.*`, which Qwen3-VL's `save_pretrained` writes) are read
too. Export writes the layout the family's own `save_pretrained` writes.

Not expressible yet, refused by name: Qwen3-VL-MoE, sliding-window decoders, rope types other
than default, deepstack with scan_layers (a training run from Qwen3-VL, `config.model.init_from`, unrolls
its layers instead, with a logged warning: models/build.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from valen_jax.models import hf_text
from valen_jax.models.config import ModelConfig, VisionConfig
from valen_jax.models.hf_common import HFImportError, get_path, set_path
from valen_jax.models.qwen_vision import activation
from valen_jax.models.safetensors_io import CheckpointTensors, save_file
from valen_jax.models.transformer import Transformer, abstract_model

VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                  "qwen3_vl": "Qwen3VLForConditionalGeneration"}
_CONFIGS = {"qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig", "qwen3_vl": "Qwen3VLConfig"}
_REFUSED = {
    "qwen3_vl_moe": "Qwen3-VL-MoE (mixture-of-experts decoder, deepstack) is not implemented",
}


def is_vl(hf_config: dict) -> bool:
    return hf_config.get("model_type") in VL_FAMILIES or hf_config.get("model_type") in _REFUSED


def normalised_config(hf_config: dict) -> dict:
    """The config as transformers 5 reads it: `text_config` with `rope_parameters`. Hub checkpoints ship
    older forms: Qwen2-VL and Qwen2.5-VL a flat one (decoder keys at the top, M-RoPE in `rope_scaling`
    {"type": "mrope", ...}, `vision_config.in_chans`), Qwen3-VL `text_config.rope_scaling`. The family's
    own transformers config class reads each form into the current one, so we let it: its reading is the
    one the checkpoint's logits come from. A config in the current form is read as it is, by our own checks."""
    text = hf_config.get("text_config")
    if isinstance(text, dict) and "rope_parameters" in text:
        return hf_config
    import transformers  # only for the older forms: their reading is transformers' to define

    name = _CONFIGS[hf_config["model_type"]]
    try:
        return getattr(transformers, name)(**hf_config).to_dict()
    except (KeyError, ValueError, TypeError) as error:
        raise HFImportError(f"model_type {hf_config['model_type']!r}: config.json is in an older form that "
                            f"transformers' {name} cannot read either ({error})") from None


def config_from_hf(hf_config: dict, **overrides) -> ModelConfig:
    family = hf_config.get("model_type")
    if family in _REFUSED:
        raise HFImportError(f"model_type {family!r}: {_REFUSED[family]}")
    if family not in VL_FAMILIES:
        raise HFImportError(f"model_type {family!r} is not a supported vision-language family; supported: "
                            f"{', '.join(VL_FAMILIES)}")
    hf_config = normalised_config(hf_config)
    text = dict(hf_config["text_config"])
    rope = dict(text.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise HFImportError(f"text_config.rope_parameters.rope_type {rope['rope_type']!r}: only default M-RoPE "
                            "is implemented")
    section = rope.get("mrope_section")
    if not section:
        raise HFImportError("text_config.rope_parameters.mrope_section is missing")
    vis = hf_config["vision_config"]
    if vis.get("in_channels", 3) != 3:
        raise HFImportError(f"vision_config.in_channels {vis['in_channels']}: only 3 (RGB) is implemented")
    try:
        activation(vis.get("hidden_act", "quick_gelu"))
    except ValueError as error:
        raise HFImportError(f"vision_config: {error}") from None
    vision_rope = vis.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 10000.0}
    if vision_rope.get("rope_type", "axial") != "axial":
        raise HFImportError(f"vision_config.rope_parameters.rope_type {vision_rope['rope_type']!r}: only axial")
    # The merger's output width: Qwen2-VL calls it hidden_size (and the tower's width embed_dim),
    # Qwen2.5-VL out_hidden_size (and the tower's width hidden_size).
    out_key = "hidden_size" if family == "qwen2_vl" else "out_hidden_size"
    if vis[out_key] != text["hidden_size"]:
        raise HFImportError(f"vision_config.{out_key} {vis[out_key]} differs from the decoder's hidden_size "
                            f"{text['hidden_size']}")
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(vis.get(key, 1), int):
            raise HFImportError(f"vision_config.{key} {vis[key]!r}: only a single int is implemented")
    common = dict(patch_size=vis.get("patch_size", 14), merge_size=vis.get("spatial_merge_size", 2),
                  temporal_patch_size=vis.get("temporal_patch_size", 2), num_layers=vis["depth"],
                  num_heads=vis["num_heads"], rope_theta=float(vision_rope.get("rope_theta", 10000.0)), family=family)
    if family == "qwen2_vl":
        vision = VisionConfig(dim=vis["embed_dim"], mlp_dim=int(vis["embed_dim"] * vis.get("mlp_ratio", 4)),
                              hidden_act=vis.get("hidden_act", "quick_gelu"), **common)
    elif family == "qwen3_vl":
        count = vis.get("num_position_embeddings", 2304)
        if int(round(count ** 0.5)) ** 2 != count:
            raise HFImportError(f"vision_config.num_position_embeddings {count} is not a square grid")
        deep = tuple(vis.get("deepstack_visual_indexes", (8, 16, 24)))
        if len(deep) > text["num_hidden_layers"] or any(not 0 <= i < vis["depth"] for i in deep):
            raise HFImportError(f"vision_config.deepstack_visual_indexes {list(deep)} do not fit depth {vis['depth']} "
                                f"and {text['num_hidden_layers']} decoder layers")
        vision = VisionConfig(dim=vis["hidden_size"], mlp_dim=vis["intermediate_size"],
                              hidden_act=vis.get("hidden_act", "gelu_pytorch_tanh"), num_position_embeddings=count,
                              deepstack_layers=deep, **common)
    else:
        window = vis.get("window_size", 112)
        if window // common["merge_size"] // common["patch_size"] < 1:
            raise HFImportError(f"vision_config.window_size {window} is smaller than one merged patch")
        blocks = tuple(vis.get("fullatt_block_indexes", (7, 15, 23, 31)))
        vision = VisionConfig(dim=vis["hidden_size"], mlp_dim=vis["intermediate_size"],
                              hidden_act=vis.get("hidden_act", "silu"), window_size=window, fullatt_blocks=blocks,
                              tokens_per_second=vis.get("tokens_per_second", 4), **common)
    tie = hf_config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    settings = dict(image_pad_id=hf_config["image_token_id"], video_pad_id=hf_config["video_token_id"],
                    mrope_section=tuple(section), mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
                    vision=vision)
    settings.update(overrides)
    if vision.deepstack_layers and settings.get("scan_layers"):
        raise HFImportError("Qwen3-VL deepstack features are added between decoder layers: scan_layers=True "
                            "is not implemented for them")
    decoder = "qwen3" if family == "qwen3_vl" else "qwen2"  # Qwen3: q/k RMSNorm, biases per attention_bias
    return hf_text.config_from_hf({**text, "model_type": decoder, "tie_word_embeddings": tie}, **settings)


def config_to_hf(cfg: ModelConfig) -> dict:
    v = cfg.vision
    text = hf_text.config_to_hf(cfg, "qwen3" if v.family == "qwen3_vl" else "qwen2")
    text.pop("architectures")
    rope = {**text["rope_parameters"], "mrope_section": list(cfg.mrope_section)}
    if cfg.mrope_interleaved:
        rope["mrope_interleaved"] = True
    text.update(model_type=f"{v.family}_text", use_sliding_window=False, rope_parameters=rope)
    top = {"model_type": v.family, "architectures": [_ARCHITECTURES[v.family]], "image_token_id": cfg.image_pad_id,
           "video_token_id": cfg.video_pad_id, "tie_word_embeddings": cfg.tie_embeddings, "dtype": cfg.param_dtype,
           "text_config": text}
    common = {"model_type": f"{v.family}_vision", "depth": v.num_layers, "hidden_act": v.hidden_act,
              "num_heads": v.num_heads, "in_channels": 3, "patch_size": v.patch_size, "spatial_merge_size": v.merge_size,
              "temporal_patch_size": v.temporal_patch_size,
              "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
    if v.family == "qwen3_vl":
        return {**top, "vision_config": {
            **common, "hidden_size": v.dim, "intermediate_size": v.mlp_dim, "out_hidden_size": cfg.dim,
            "num_position_embeddings": v.num_position_embeddings, "deepstack_visual_indexes": list(v.deepstack_layers)}}
    if v.family == "qwen2_5_vl":
        return {**top, "vision_config": {
            **common, "hidden_size": v.dim, "intermediate_size": v.mlp_dim, "out_hidden_size": cfg.dim,
            "window_size": v.window_size, "fullatt_block_indexes": list(v.fullatt_blocks),
            "tokens_per_second": v.tokens_per_second}}
    if v.mlp_dim % v.dim:
        raise HFImportError(f"vision mlp_dim {v.mlp_dim} is not a whole multiple of dim {v.dim}: Qwen2-VL's "
                            "mlp_ratio is an int")
    return {**top, "vision_config": {**common, "embed_dim": v.dim, "hidden_size": cfg.dim,
                                     "mlp_ratio": v.mlp_dim // v.dim}}


def _vision_tensors(cfg: ModelConfig) -> Iterator[tuple[tuple, str, callable, callable]]:
    """(our path under `vision`, HF name, to ours, to HF) for every vision tensor."""
    v = cfg.vision
    d, n = v.dim, v.num_heads
    h = d // n
    embed_shape = (d, 3, v.temporal_patch_size, v.patch_size, v.patch_size)
    yield ("patch_embed",), "visual.patch_embed.proj.weight", lambda w: w.reshape(d, -1).T, \
        lambda w: w.T.reshape(embed_shape)
    qwen3 = v.family == "qwen3_vl"
    if qwen3:
        yield ("patch_bias",), "visual.patch_embed.proj.bias", None, None
        yield ("pos_embed",), "visual.pos_embed.weight", None, None
    layer_norm = v.family != "qwen2_5_vl"  # Qwen2.5-VL's norms are RMSNorms: no bias
    fc = "linear_fc" if qwen3 else "fc"
    for i in range(v.num_layers):
        p = f"visual.blocks.{i}."
        for norm in ("norm1", "norm2"):
            yield ("blocks", i, norm, "scale"), f"{p}{norm}.weight", None, None
            if layer_norm:
                yield ("blocks", i, norm, "bias"), f"{p}{norm}.bias", None, None
        yield ("blocks", i, "qkv"), p + "attn.qkv.weight", lambda w: w.T.reshape(d, 3, n, h), \
            lambda w: w.reshape(d, 3 * d).T
        yield ("blocks", i, "qkv_bias"), p + "attn.qkv.bias", lambda b: b.reshape(3, n, h), lambda b: b.reshape(-1)
        yield ("blocks", i, "proj"), p + "attn.proj.weight", lambda w: w.T.reshape(n, h, d), \
            lambda w: w.reshape(d, d).T
        yield ("blocks", i, "proj_bias"), p + "attn.proj.bias", None, None
        linears = (("fc1", fc + "1"), ("fc2", fc + "2")) if layer_norm else \
            (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
        for ours, theirs in linears:
            yield ("blocks", i, ours), f"{p}mlp.{theirs}.weight", np.transpose, np.transpose
            yield ("blocks", i, ours + "_bias"), f"{p}mlp.{theirs}.bias", None, None
    norm, linears = ("norm", ("linear_fc1", "linear_fc2")) if qwen3 else ("ln_q", ("mlp.0", "mlp.2"))
    yield ("ln_q", "scale"), f"visual.merger.{norm}.weight", None, None
    if layer_norm:
        yield ("ln_q", "bias"), f"visual.merger.{norm}.bias", None, None
    for ours, theirs in zip(("merge_in", "merge_out"), linears, strict=True):
        yield (ours,), f"visual.merger.{theirs}.weight", np.transpose, np.transpose
        yield (ours + "_bias",), f"visual.merger.{theirs}.bias", None, None
    for k in range(len(v.deepstack_layers)):
        p = f"visual.deepstack_merger_list.{k}."
        yield ("deepstack", k, "norm", "scale"), p + "norm.weight", None, None
        yield ("deepstack", k, "norm", "bias"), p + "norm.bias", None, None
        for ours in ("fc1", "fc2"):
            yield ("deepstack", k, ours), f"{p}linear_{ours}.weight", np.transpose, np.transpose
            yield ("deepstack", k, ours + "_bias"), f"{p}linear_{ours}.bias", None, None


class _Tensors(CheckpointTensors):
    """Reads legacy names from a checkpoint in either layout (`model.layers.*` or `model.language_model.layers.*`)."""

    _NEW = (("model.", "model.language_model."), ("visual.", "model.visual."), ("lm_head.", "lm_head."))

    @classmethod
    def new_name(cls, name: str) -> str:
        for old, new in cls._NEW:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def _name(self, name: str) -> str:
        if name in self._files:
            return name
        for old, new in self._NEW:
            if name.startswith(old) and new + name[len(old):] in self._files:
                return new + name[len(old):]
        return name  # missing: CheckpointTensors.get names it

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self._files

    def get(self, name: str) -> np.ndarray:
        return super().get(self._name(name))


def load_params(directory: str | Path, cfg: ModelConfig, shardings, added_pieces=None, fresh: dict | None = None) -> dict:
    """Sharded parameters of a Qwen2-VL `cfg` from its checkpoint, vision tower included."""
    tensors = _Tensors(directory)
    _, abstract = abstract_model(cfg)
    shapes = nnx.to_pure_dict(abstract)
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(np.float32)
    vision: dict = jax.tree.map(lambda _: None, shapes["vision"])
    for ours, name, convert, _ in _vision_tensors(cfg):
        host = np.asarray(tensors.get(name))
        host = (convert(host) if convert else host).astype(dtype)
        want = get_path(shapes["vision"], ours).shape
        if host.shape != want:
            raise HFImportError(f"{name}: checkpoint gives {host.shape} after conversion, model wants {want}")
        target = get_path(shardings["vision"], ours)
        set_path(vision, ours, jax.make_array_from_callback(host.shape, target, lambda index, host=host: host[index]))
    known = {name for _, name, _, _ in _vision_tensors(cfg)}
    extra = sorted(n for n in tensors.names() if "visual." in n and n.replace("model.visual.", "visual.") not in known)
    if extra:
        raise HFImportError(f"{directory}: vision tensors this importer does not model: {', '.join(extra[:5])}")
    return hf_text.load_params(directory, cfg, shardings, added_pieces, fresh={**(fresh or {}), "vision": vision},
                               tensors=tensors)


def save_pretrained(model: Transformer, path: str | Path) -> Path:
    """config.json + model.safetensors that the family class (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) loads as the same model."""
    cfg: ModelConfig = model.cfg
    if cfg.vision is None or cfg.vision.family not in VL_FAMILIES or cfg.mrope_section is None:
        raise HFImportError(f"only a model with a {' or '.join(VL_FAMILIES)} vision tower and M-RoPE exports as "
                            "a Qwen-VL checkpoint")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    params = jax.tree.map(lambda a: np.asarray(jax.device_get(a)), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tensors = hf_text.decoder_tensors(cfg, params)
    for ours, name, _, back in _vision_tensors(cfg):
        value = get_path(params["vision"], ours)
        tensors[name] = np.ascontiguousarray(back(value) if back else value)
    if cfg.vision.family == "qwen3_vl":  # what Qwen3-VL's save_pretrained writes: the transformers 5 layout
        tensors = {_Tensors.new_name(name): value for name, value in tensors.items()}
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    return path
