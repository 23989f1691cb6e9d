"""LoRA adapters as a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained(<transformers model of the base>, folder)` loads with our logits.

PEFT names each adapter after the base module it wraps (`base_model.model.` + the transformers module
path + `.lora_A.weight` [r, in] / `.lora_B.weight` [out, r]) and scales B·A by lora_alpha / r; our A and B
(`models/lora.py`) are the same matrices transposed, with our weights' multi-axis in/out flattened the
way the HF importer flattens them (`hf_text._layer_tensors`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from valen_jax.models import lora
from valen_jax.models.config import ModelConfig
from valen_jax.models.safetensors_io import save_file

_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_GROUP = {**dict.fromkeys(lora.ATTENTION, "attn"), **dict.fromkeys(lora.MLP, "mlp")}


def _decoder_prefix(cfg: ModelConfig) -> str:
    # transformers 5 nests a Qwen-VL decoder under model.language_model; a text model's is model.
    return "base_model.model.model.language_model.layers" if cfg.mrope_section is not None else \
        "base_model.model.model.layers"


def adapter_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """PEFT's state dict of the adapters in host `params` (unscanned or stacked layers)."""
    tensors = {}
    for i in range(cfg.num_layers):
        layer = params["layers"][i] if not cfg.scan_layers else None
        for name in cfg.lora.targets:
            group = (layer if layer is not None else params["layers"])[_GROUP[name]]
            a, b = group[name + lora.SUFFIX_A], group[name + lora.SUFFIX_B]
            if layer is None:
                a, b = a[i], b[i]
            a = np.asarray(a, np.float32).reshape(-1, cfg.lora.rank)  # [in, r]
            b = np.asarray(b, np.float32).reshape(cfg.lora.rank, -1)  # [r, out]
            stem = f"{_decoder_prefix(cfg)}.{i}.{_MODULES[name]}"
            tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a.T)
            tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b.T)
    return tensors


def _target_modules(cfg: ModelConfig) -> list[str] | str:
    """PEFT's `target_modules`: the projection names for a text model; for a Qwen-VL model a regex (PEFT
    full-matches a string against each module's path) held to the decoder, because its vision tower has
    `gate_proj`/`up_proj`/`down_proj` too and a list of names would wrap those in fresh adapters."""
    names = sorted(_MODULES[name].split(".")[-1] for name in cfg.lora.targets)
    if cfg.mrope_section is None:
        return names
    return rf"model\.language_model\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(names)})"


def adapter_config(cfg: ModelConfig, base: str) -> dict:
    """adapter_config.json: the keys PEFT's LoraConfig reads to rebuild the same adapters."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": _target_modules(cfg),
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "inference_mode": True,
    }


def save_adapter(cfg: ModelConfig, params: dict, path: str | Path, base: str = "") -> Path:
    """Write the PEFT adapter folder of a LoRA model's host `params`; `base`: the base model's path or name."""
    if cfg.lora is None:
        raise ValueError("the model has no LoRA adapters (config.model.lora is unset)")
    if cfg.lora.quantize_base != "none":
        # PEFT would load the adapters onto a float base, a different function from the NF4 base trained
        # under them; bitsandbytes' own NF4 is not ours bit for bit either.
        raise ValueError(f"a QLoRA model (quantize_base={cfg.lora.quantize_base}) exports merged only")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(cfg, params), path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, base), indent=2) + "\n")
    return path
