"""LoRA adapters as a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained(<transformers model of the base>, folder)` loads with our logits, and such
a folder read back (`load_adapter`: `config.model.lora.init_adapter`, to continue training a PEFT adapter).

PEFT names each adapter after the base module it wraps (`base_model.model.` + the transformers module
path + `.lora_A.weight` [r, in] / `.lora_B.weight` [out, r]) and scales B·A by lora_alpha / r; our A and B
(`models/lora.py`) are the same matrices transposed, with our weights' multi-axis in/out flattened the
way the HF importer flattens them (`hf_text._layer_tensors`).

The embedding rows our model holds that the base does not (`token_rows`): the rows of tokens the training
tokenizer added (set by rule from their pieces, `hf_common.extend_rows`, where transformers'
`resize_token_embeddings` draws them at random) and any row training changed. They travel as PEFT's
`trainable_token_indices` (`embed_tokens.token_adapter.trainable_tokens_delta` [n, D]: the rows' values,
which replace the base's; `lm_head`'s too when the head is not tied to the embedding), so the base resized
to the tokenizer's length plus the folder is our model on every token the tokenizer can produce.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import jax
import numpy as np

from valen_jax.models import hf_vl, lora
from valen_jax.models.config import ModelConfig
from valen_jax.models.hf_common import HFImportError, get_path, resolve
from valen_jax.models.safetensors_io import SafetensorsFile, save_file

log = logging.getLogger(__name__)

_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_GROUP = {**dict.fromkeys(lora.ATTENTION, "attn"), **dict.fromkeys(lora.MLP, "mlp")}
_OPTIONAL_KEYS = ("use_rslora", "use_dora", "modules_to_save")  # adapter_config.json keys PEFT may omit
TOKEN_DELTA = ".token_adapter.trainable_tokens_delta"  # PEFT's tensor of the rows trainable_token_indices name
_ROWS_AT_ONCE = 8192  # rows compared per slice: a 150k × 3584 table is never copied whole


def _decoder_prefix(cfg: ModelConfig) -> str:
    # transformers 5 nests a Qwen-VL decoder under model.language_model; a text model's is model.
    return "base_model.model.model.language_model.layers" if cfg.mrope_section is not None else \
        "base_model.model.model.layers"


def _entries(cfg: ModelConfig):
    """(our path of an adapted weight, its layer's index in a stacked leaf or None, PEFT's module path) for
    every adapter of `cfg`: the decoder's targets in each layer, then the tower's `vision/` targets, named
    as the HF importer names the tower's weights (`hf_vl._vision_tensors`, in transformers 5's layout:
    `model.visual.blocks.N.attn.qkv`, `model.visual.merger.mlp.0`, ...)."""
    decoder = [name for name in cfg.lora.targets if name in lora.DECODER]
    for i in range(cfg.num_layers):
        for name in decoder:
            path = ("layers", _GROUP[name], name) if cfg.scan_layers else ("layers", i, _GROUP[name], name)
            yield path, i if cfg.scan_layers else None, f"{_decoder_prefix(cfg)}.{i}.{_MODULES[name]}"
    tower = cfg.lora.vision_targets
    if not tower:
        return
    if cfg.vision.family not in hf_vl.VL_FAMILIES:  # our own tower has no transformers module to adapt
        raise ValueError(f"the adapters on the {cfg.vision.family} vision tower (config.model.lora.targets="
                         f"{cfg.lora.targets!r}) have no PEFT form: that tower has no transformers module")
    for ours, name, _, _ in hf_vl._vision_tensors(cfg):
        # Blocks and the merger only: the deepstack mergers (Qwen3-VL) share fc1/fc2's names but get no adapters.
        if ours[-1] in tower and ours[0] in ("blocks", "merge_in", "merge_out") and name.endswith(".weight"):
            yield ("vision", *ours), None, "base_model.model." + hf_vl._Tensors.new_name(name)[: -len(".weight")]


def adapter_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """PEFT's state dict of the adapters in host `params` (unscanned or stacked layers)."""
    tensors = {}
    for path, index, stem in _entries(cfg):
        *where, name = path
        group = get_path(params, tuple(where))
        a, b = group[name + lora.SUFFIX_A], group[name + lora.SUFFIX_B]
        if index is not None:
            a, b = a[index], b[index]
        a = np.asarray(a, np.float32).reshape(-1, cfg.lora.rank)  # [in, r]
        b = np.asarray(b, np.float32).reshape(cfg.lora.rank, -1)  # [r, out]
        tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b.T)
    return tensors


def _target_modules(cfg: ModelConfig) -> list[str] | str:
    """PEFT's `target_modules`: the projection names for a text model; for a Qwen-VL model a regex (PEFT
    full-matches a string against each module's path) of exactly the modules adapted, because its vision
    tower has `gate_proj`/`up_proj`/`down_proj` too and a list of names would wrap those in fresh adapters
    (or miss the tower's `qkv`, `proj` and merger when they are targeted)."""
    decoder = [name for name in cfg.lora.targets if name in lora.DECODER]
    names = sorted(_MODULES[name].split(".")[-1] for name in decoder)
    if cfg.mrope_section is None:
        return names
    stems = {stem.removeprefix("base_model.model.") for _, _, stem in _entries(cfg)}
    return "|".join(sorted({re.sub(r"\\.\d+\\.", r"\\.\\d+\\.", re.escape(stem)) for stem in stems}))


def _embedding_prefix(cfg: ModelConfig) -> str:
    return "base_model.model.model.language_model." if cfg.mrope_section is not None else "base_model.model.model."


def _changed_rows(ours: np.ndarray, base: np.ndarray, vocabulary: int) -> list[int]:
    """Ids below `vocabulary` whose row of `ours` [V, D] is not the base's [V_base, D] (compared in our dtype,
    where the import cast them): every row the base lacks, which transformers' resize draws at random."""
    common = min(len(base), vocabulary)
    changed = []
    for start in range(0, common, _ROWS_AT_ONCE):
        stop = min(start + _ROWS_AT_ONCE, common)
        theirs = np.asarray(base[start:stop]).astype(ours.dtype).astype(np.float32)
        differs = np.any(np.asarray(ours[start:stop], np.float32) != theirs, axis=1)
        changed.extend(int(i) + start for i in np.flatnonzero(differs))
    return changed + list(range(common, vocabulary))


def token_rows(cfg: ModelConfig, params: dict, base: str | Path, vocabulary: int) -> dict[str, tuple[list[int], np.ndarray]]:
    """{PEFT's embedding module name: (token ids, their rows [n, D] in float32)} of the rows in host `params`
    that the HF checkpoint `base`, resized to `vocabulary` rows as transformers resizes it, does not hold:
    `embed_tokens`, and `lm_head` for an untied head (ours [D, V], HF's [V, D]). Empty when none differ."""
    tensors = hf_vl._Tensors(resolve(base))  # either layout's names (a VLM's may be model.language_model.*)
    ours = {"embed_tokens": (np.asarray(params["embed"]), tensors.get("model.embed_tokens.weight"))}
    if not cfg.tie_embeddings:
        ours["lm_head"] = (np.asarray(params["lm_head"]).T, tensors.get("lm_head.weight"))
    rows = {}
    for name, (table, base_table) in ours.items():
        if vocabulary > len(table):
            raise HFImportError(f"a vocabulary of {vocabulary} tokens is larger than the model's {len(table)} rows")
        ids = _changed_rows(table, base_table, vocabulary)
        if ids:
            rows[name] = (ids, np.ascontiguousarray(table[ids], np.float32))
    return rows


def _token_indices(cfg: ModelConfig, rows: dict) -> list[int] | dict[str, list[int]] | None:
    """adapter_config.json's `trainable_token_indices`: a list (the input embedding's, which PEFT ties to a
    tied head), or by module for an untied head."""
    if not rows:
        return None
    if cfg.tie_embeddings:
        return rows["embed_tokens"][0]
    return {name: ids for name, (ids, _) in rows.items()}  # a module none of whose rows changed is not named


def adapter_config(cfg: ModelConfig, base: str, token_indices=None) -> dict:
    """adapter_config.json: the keys PEFT's LoraConfig reads to rebuild the same adapters."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout, "bias": "none",
        "target_modules": _target_modules(cfg),
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "trainable_token_indices": token_indices, "inference_mode": True,
    }


def save_adapter(cfg: ModelConfig, params: dict, path: str | Path, base: str = "", vocabulary: int | None = None
                 ) -> int:
    """Write the PEFT adapter folder of a LoRA model's host `params`; `base`: the base model's path or name
    ("" for a fresh base: no HF checkpoint to load onto); `vocabulary`: the training tokenizer's length, to
    which the user resizes the base (default: the base's own vocabulary). Returns how many embedding rows
    it carries (`token_rows`)."""
    if cfg.lora is None:
        raise ValueError("the model has no LoRA adapters (config.model.lora is unset)")
    if cfg.lora.quantize_base != "none":
        # PEFT would load the adapters onto a float base, a different function from the NF4 base trained
        # under them; bitsandbytes' own NF4 is not ours bit for bit either.
        raise ValueError(f"a QLoRA model (quantize_base={cfg.lora.quantize_base}) exports merged only")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(cfg, params)
    rows = {}
    if base:
        size = vocabulary if vocabulary is not None else len(hf_vl._Tensors(resolve(base)).get(
            "model.embed_tokens.weight"))
        rows = token_rows(cfg, params, base, size)
    for name, (_, values) in rows.items():
        module = _embedding_prefix(cfg) + "embed_tokens" if name == "embed_tokens" else "base_model.model.lm_head"
        tensors[module + TOKEN_DELTA] = values
    save_file(tensors, path / "adapter_model.safetensors")
    config = adapter_config(cfg, base, _token_indices(cfg, rows))
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return max((len(ids) for ids, _ in rows.values()), default=0)


def load_adapter(cfg: ModelConfig, folder: str | Path, template: dict) -> dict:
    """The adapters of the PEFT folder `folder` as our adapter tree, shaped like `template` (a tree of
    `lora.adapter_tree` leaves with `.shape`; unscanned or stacked layers): the inverse of `adapter_tensors`.
    Refused in one line naming the file and the key: another rank, alpha or target set than the config's,
    a PEFT feature we do not compute (rsLoRA, DoRA, bias, modules_to_save), a tensor missing, of another
    shape, or one the config does not adapt."""
    folder = Path(folder)
    config_path, tensors_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for path in (config_path, tensors_path):
        if not path.is_file():
            raise HFImportError(f"config.model.lora.init_adapter={str(folder)!r}: no {path.name} (a PEFT adapter "
                                "folder holds adapter_config.json and adapter_model.safetensors)")
    try:
        saved = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise HFImportError(f"{config_path}: not JSON ({error})") from None
    expected = adapter_config(cfg, "")
    for key in ("peft_type", "r", "lora_alpha", "bias", *_OPTIONAL_KEYS):
        # A key PEFT may leave out reads as its default, which is ours; a required one absent is a mismatch.
        if saved.get(key, expected[key] if key in _OPTIONAL_KEYS else None) != expected[key]:
            raise HFImportError(f"{config_path}: {key}={saved.get(key)!r}, where config.model.lora asks "
                                f"{expected[key]!r}")
    stored = SafetensorsFile(tensors_path)
    wanted = adapter_tensors(cfg, jax.tree.map(lambda leaf: np.zeros(leaf.shape, np.float32), template))
    rows = [name for name in stored.keys() if name.endswith(TOKEN_DELTA)]
    if rows:
        # The run's base holds its added tokens' rows by the same rule as the run that exported them
        # (`hf_common.extend_rows`); rows that run trained are not read back (the base stays frozen).
        log.warning("%s: the embedding rows of trainable_token_indices (%s) are not read: the base's added-token "
                    "rows are set by rule, as in the run that wrote them", tensors_path, ", ".join(rows))
    extra = sorted(set(stored.keys()) - set(wanted) - set(rows))
    if extra:
        raise HFImportError(f"{tensors_path}: {extra[0]!r} is an adapter config.model.lora.targets="
                            f"{tuple(cfg.lora.targets)} does not have ({len(extra)} such tensors)")
    tensors = {}
    for name, zero in wanted.items():
        if name not in stored.keys():
            raise HFImportError(f"{tensors_path}: no tensor {name!r} (config.model.lora.targets="
                                f"{tuple(cfg.lora.targets)})")
        tensors[name] = np.array(stored.get(name), np.float32)  # a copy: not a view of the mapped file
        if tensors[name].shape != zero.shape:
            raise HFImportError(f"{tensors_path}: {name!r} has shape {tensors[name].shape}, the model's is "
                                f"{zero.shape}")
    return _adapter_tree(cfg, tensors, template)


def _adapter_tree(cfg: ModelConfig, tensors: dict, template: dict) -> dict:
    """`tensors` (PEFT's names) as our adapter tree shaped and typed like `template` (stacked over the
    layers under `scan_layers`, else one subtree per layer index)."""
    stems: dict[tuple, list[str]] = {}
    for path, _, stem in _entries(cfg):  # a stacked weight's stems in layer order
        stems.setdefault(tuple(str(key) for key in path), []).append(stem)

    def leaf(path, like):
        keys = [str(entry.key) for entry in path]
        which = "lora_A" if keys[-1].endswith(lora.SUFFIX_A) else "lora_B"
        weight = (*keys[:-1], keys[-1][: -len(lora.SUFFIX_A)])
        # PEFT's A [r, in] / B [out, r], ours transposed
        values = [tensors[f"{stem}.{which}.weight"].T for stem in stems[weight]]
        value = np.stack(values) if cfg.scan_layers and weight[0] == "layers" else values[0]
        return value.reshape(like.shape).astype(like.dtype)

    return jax.tree_util.tree_map_with_path(leaf, template)
