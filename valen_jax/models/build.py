"""The run's model: its ModelConfig from the config (or the HF checkpoint it starts from) and first parameters.

`config.model.init_from` names a text checkpoint (Qwen2, Qwen3, Llama: the decoder is imported and the
model has no vision tower, seed 003: a base trained on images must accept them) or a vision-language
checkpoint (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the whole model is imported, decoder, vision tower,
M-RoPE and media-slot ids, so `config.model.vision` must leave every key unset). Either way the run's
dtype, remat, scan_layers and score head come from the config, and the vocabulary grows to hold the
training tokenizer's added tokens (rows by `hf.extend_rows`), never shrinks.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from transformers import AutoTokenizer

from data_pipeline import vocabulary
from data_pipeline.tokenizer import number_token_ids, token_id
from valen_jax.config.schema import ARCHITECTURE_KEYS, defaults
from valen_jax.errors import ConfigError
from valen_jax.models import hf, hf_vl, lora, lora_init, peft_adapter
from valen_jax.models.config import ModelConfig, VisionConfig, padded_vocab
from valen_jax.models.transformer import Transformer, init_params

log = logging.getLogger(__name__)

# The training tokenizer's vision tokens against the ids a VL checkpoint was trained with (its config.json).
_VL_TOKEN_IDS = ((vocabulary.IMAGE_PAD, "image_token_id"), (vocabulary.VIDEO_PAD, "video_token_id"),
                 (vocabulary.VISION_START, "vision_start_token_id"), (vocabulary.VISION_END, "vision_end_token_id"))


def checkpoint_config(init_from: str) -> dict:
    """config.json of the checkpoint a run starts from (a directory or hub name)."""
    directory = hf.resolve(init_from)
    if not (directory / "config.json").is_file():
        raise hf.HFImportError(f"config.model.init_from={init_from!r}: no config.json in {directory}; "
                               "not a transformers checkpoint")
    return json.loads((directory / "config.json").read_text())


def _fresh_vision(group: ml_collections.ConfigDict | None) -> VisionConfig | None:
    """Our own vision tower from config.model.vision; keys left unset (the :hf variants) take the schema's
    defaults, and the log names them."""
    if group is None:
        return None
    schema = defaults("vision")
    unset = sorted(key for key in schema if group[key] is None)
    if unset:
        log.info("fresh vision tower: %s unset, schema defaults used (%s)", ", ".join(unset),
                 ", ".join(f"{key}={schema[key]}" for key in unset))
    values = {key: schema[key] if group[key] is None else group[key] for key in schema}
    return VisionConfig(**values)


def model_config(config: ml_collections.ConfigDict, tokenizer) -> ModelConfig:
    m = config.model
    common = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, scan_layers=bool(m.scan_layers),
                  attention=m.attention,
                  # Valen's scored branches need the scalar head; other tasks never build it.
                  score_head=float(config.loss.weights.get("branches", 0.0)) > 0,
                  lora=lora_config(config))
    if m.init_from:
        hf_config = checkpoint_config(m.init_from)
        if hf_vl.is_vl(hf_config):
            base = _vl_model_config(config, hf_config, tokenizer, common)
        else:
            _no_tower_on_text(config, hf_config)
            base = hf.config_from_hf(hf_config, image_pad_id=token_id(tokenizer, vocabulary.IMAGE_PAD), vision=None,
                                     **common)
        # Added primitive tokens may outgrow the checkpoint's table; never shrink it.
        return dataclasses.replace(base, vocab_size=max(base.vocab_size, padded_vocab(len(tokenizer))))
    unset = [key for key in ARCHITECTURE_KEYS if m[key] is None]
    if unset:  # a :hf variant run without its checkpoint: nothing says what model to build
        raise ConfigError(f"config.model.{{{', '.join(unset)}}} are unset and config.model.init_from is not given: a "
                          ":hf variant needs --config.model.init_from=PATH (a checkpoint directory or hub name); a "
                          "model trained from scratch needs these keys")
    return _fresh_tower_trains(config, ModelConfig(
        vocab_size=padded_vocab(len(tokenizer)), dim=m.dim, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, mlp_dim=m.mlp_dim, rope_theta=float(m.rope_theta),
        tie_embeddings=bool(m.tie_embeddings), image_pad_id=token_id(tokenizer, vocabulary.IMAGE_PAD),
        vision=_fresh_vision(m.vision), **common))


def _no_tower_on_text(config: ml_collections.ConfigDict, hf_config: dict) -> None:
    """A text checkpoint gets no vision tower (seed 003: "Training on images uses a vision model's processor and
    adapts its language backbone. The base model must therefore accept images."): a tower bolted on fresh
    would be trained from nothing beside a pretrained decoder and could not be exported in any HF form.
    The :hf variants leave `config.model.vision`'s keys unset; one set here would be silently ignored, so
    it is refused (image rows are refused before this, by `training.preflight`)."""
    group = config.model.vision
    clashing = sorted(key for key in group if group[key] is not None) if group is not None else []
    if clashing:
        raise ConfigError(f"config.model.init_from={config.model.init_from!r} is a "
                          f"{hf_config.get('model_type', 'text')} text checkpoint, which gets no vision tower, so "
                          f"config.model.vision.{{{', '.join(clashing)}}} would be ignored: unset them (or "
                          "--config.model.vision=None), or start from a vision-language checkpoint")


def _fresh_tower_trains(config: ml_collections.ConfigDict, cfg: ModelConfig) -> ModelConfig:
    """`cfg` (whose vision tower, if any, starts fresh: no checkpoint holds it) with that tower training in full
    under LoRA. Frozen at its random init it would map every image to noise the adapters must learn around;
    it has nothing pretrained to keep, so it trains like the adapters and is saved with them (the
    checkpoint holds every trained leaf). Its adapters would then be redundant: `vision/` targets are
    refused (`LoraConfig.check_tower`), as is a bf16 param_dtype (the tower's master weights)."""
    if cfg.lora is None or cfg.vision is None:
        return cfg
    if cfg.param_dtype != "float32":
        raise ConfigError(f"config.model.param_dtype={cfg.param_dtype}: the vision tower is fresh (config.model."
                          "init_from is unset), so it "
                          "trains in full beside the LoRA adapters and needs float32 master weights")
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, train_vision=True))


def lora_config(config: ml_collections.ConfigDict) -> lora.LoraConfig | None:
    """config.model.lora (validated by the schema) as the model's LoraConfig, or None."""
    group = config.model.get("lora")
    if group is None:
        return None
    return lora.LoraConfig(rank=int(group.rank), alpha=float(group.alpha), targets=tuple(group.targets),
                           quantize_base=str(group.quantize_base), trainable=tuple(group.trainable),
                           dropout=float(group.dropout))


def _vl_model_config(config: ml_collections.ConfigDict, hf_config: dict, tokenizer, common: dict) -> ModelConfig:
    """The whole VLM from its config.json, with the run's dtype/remat/scan/score head."""
    m = config.model
    family = hf_config.get("model_type")
    if m.vision is not None:
        clashing = sorted(key for key in m.vision if m.vision[key] is not None)
        if clashing:
            raise ConfigError(f"config.model.init_from={m.init_from!r} is a {family} vision-language checkpoint, so "
                              f"config.model.vision.{{{', '.join(clashing)}}} come from the checkpoint; set them to "
                              "None (the :hf variants do)")
    wrong = [f"{token} is {token_id(tokenizer, token)} there but {key}={hf_config[key]} in the checkpoint"
             for token, key in _VL_TOKEN_IDS if key in hf_config and token_id(tokenizer, token) != hf_config[key]]
    if wrong:
        # Media slots would hold tokens the model never saw as slots: the images would be ignored.
        raise ConfigError(f"config.data.tokenizer={config.data.tokenizer!r} is not the tokenizer of "
                          f"config.model.init_from={m.init_from!r}: {'; '.join(wrong)}. Point config.data.tokenizer "
                          "at the checkpoint's tokenizer")
    cfg = hf_vl.config_from_hf(hf_config, **{**common, "scan_layers": False})
    if common["scan_layers"]:
        if cfg.vision.deepstack_layers:
            # Deepstack adds vision features after the first decoder layers, which one scanned block cannot
            # express (transformer.py refuses it); unrolled layers compute the same function, only the
            # compile time grows with depth.
            log.warning("config.model.scan_layers=True is turned off for this run: %s adds deepstack vision "
                        "features after decoder layers %s, which scanned layers do not implement (same numerics; "
                        "compile time grows with depth)", family, list(range(len(cfg.vision.deepstack_layers))))
        else:
            cfg = dataclasses.replace(cfg, scan_layers=True)
    log.info("%s checkpoint: decoder, vision tower (%d blocks, dim %d), M-RoPE %s imported whole",
             family, cfg.vision.num_layers, cfg.vision.dim, list(cfg.mrope_section))
    return cfg


def is_vl(model_cfg: ModelConfig) -> bool:
    """A model whose vision tower and M-RoPE come from (and export to) a Qwen-VL checkpoint."""
    return model_cfg.vision is not None and model_cfg.vision.family in hf_vl.VL_FAMILIES


def fresh_subtrees(model_cfg: ModelConfig, seed: int, shardings, names: tuple[str, ...]) -> dict:
    """The top-level subtrees `names` (those the model has) exactly as `init_params` would initialise them:
    the same trace and random streams, but only these are outputs, so XLA never materialises the rest (a
    checkpoint replaces it; a whole fresh copy of a large model would double its memory at start-up)."""
    names = tuple(name for name in names if name in shardings)
    if not names:
        return {}

    def create():
        state = nnx.to_pure_dict(nnx.split(Transformer(model_cfg, nnx.Rngs(seed)))[1])
        return {name: state[name] for name in names}

    return jax.jit(create, out_shardings={name: shardings[name] for name in names})()


def fourier_coordinate_rows(table, ids, seed: int):
    """`table` [V, D] with rows `ids` (the coordinate tokens <0>..<N-1> in value order) set to a Fourier code
    of their value: row <v> = a·Σ_k (cos(πkv/(N-1))·c_k + sin(πkv/(N-1))·s_k), k = 1..D/4, over random
    orthonormal directions c_k, s_k (half of the D dimensions), with `a` giving the rows the norm of a
    random row of the table's init (std 0.02). Logits h·row_v are then a Fourier series in v whose
    coefficients are h's projections: one hidden direction raises a band of neighbouring values (its
    narrowest period 2(N-1)/(D/4) tokens), where random rows would need every value learnt on its own."""
    vocab, dim = table.shape
    count, frequencies = len(ids), dim // 4
    basis, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(seed), (dim, 2 * frequencies), jnp.float32))
    angle = jnp.pi * jnp.arange(count, dtype=jnp.float32)[:, None] * jnp.arange(1, frequencies + 1) / (count - 1)
    code = jnp.concatenate([jnp.cos(angle), jnp.sin(angle)], axis=-1) @ basis.T  # [N, D], row norm √frequencies
    rows = code * (0.02 * (dim ** 0.5) / (frequencies ** 0.5))
    return table.at[jnp.asarray(ids)].set(rows.astype(table.dtype))


def _with_adapters(config, model_cfg: ModelConfig, tokenizer, shardings, init_adapter: str) -> dict:
    """A LoRA model's first parameters: the base exactly as a plain run would start (the HF checkpoint, or
    fresh), then `lora_init.attach` (fresh adapters, or the PEFT adapter folder `init_adapter`; NF4 under
    QLoRA)."""
    base_cfg = lora.base_config(model_cfg)
    adapters = None
    if init_adapter:  # read (and checked) before the base is loaded onto the devices
        adapters = peft_adapter.load_adapter(model_cfg, init_adapter, lora_init.adapter_shapes(model_cfg))
    base = initial_params(config, base_cfg, tokenizer, lora_init.base_shardings(model_cfg, shardings))
    return lora_init.attach(base, model_cfg, shardings, int(config.train.seed) + 1, adapters)


def initial_params(config: ml_collections.ConfigDict, model_cfg: ModelConfig, tokenizer, shardings) -> dict:
    """Fresh parameters, or the configured HF checkpoint's with added-token rows by rule (and LoRA's
    adapters when the model has them)."""
    if model_cfg.lora is not None:
        return _with_adapters(config, model_cfg, tokenizer, shardings, config.model.lora.init_adapter)
    if not config.model.init_from:
        params = init_params(model_cfg, config.train.seed, shardings)
        if config.model.get("coordinate_embeddings", "random") == "fourier":
            ids = number_token_ids(tokenizer)
            params["embed"] = jax.jit(lambda t: fourier_coordinate_rows(t, ids, int(config.train.seed)),
                                      out_shardings=shardings["embed"])(params["embed"])
            if not model_cfg.tie_embeddings:  # the head's columns too, so input and output agree
                params["lm_head"] = jax.jit(lambda h: fourier_coordinate_rows(h.T, ids, int(config.train.seed)).T,
                                            out_shardings=shardings["lm_head"])(params["lm_head"])
        return params
    directory = hf.resolve(config.model.init_from)
    base_tokenizer = AutoTokenizer.from_pretrained(str(config.data.tokenizer))
    pieces = hf.added_token_pieces(base_tokenizer, tokenizer)
    whole = is_vl(model_cfg)
    log.info("initialising from %s (%s); %d added token rows set from their pieces", directory,
             f"{model_cfg.vision.family}: decoder and vision tower" if whole else "decoder", len(pieces))
    # What the checkpoint has no counterpart for starts fresh: the score head (a text checkpoint has no tower).
    fresh = fresh_subtrees(model_cfg, config.train.seed, shardings, ("score_head",))
    load = hf_vl.load_params if whole else hf.load_params
    return load(directory, model_cfg, shardings, pieces, fresh=fresh)


def lora_base(config: ml_collections.ConfigDict, model_cfg: ModelConfig, tokenizer, shardings, seed: int) -> dict:
    """A LoRA run's base rebuilt as its start built it (`config.model.init_from`, or fresh parts drawn from
    `seed`, the run's first `config.train.seed`; NF4 under QLoRA), with fresh adapters in place: a checkpoint
    holds the trained leaves alone (`training.adapter_checkpoint`), which the caller puts in after checking
    the base. The PEFT `init_adapter` a run started from is not read again: the checkpoint's adapters replace it."""
    config = copy.deepcopy(config)
    with config.unlocked():
        config.train.seed = int(seed)
    return _with_adapters(config, model_cfg, tokenizer, shardings, init_adapter="")
