"""What train and evaluate share: config checks, model config, shards for a run, row layout."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import ml_collections
from transformers import AutoTokenizer

from data_pipeline import convert as converter
from data_pipeline import vocabulary
from data_pipeline.shards import Manifest, ShardError, sha256_file
from data_pipeline.tokenizer import token_id
from valen_jax.data.assemble import RowSpec
from valen_jax.data.sources import ShardSet
from valen_jax.data.vision_processor import media_settings
from valen_jax.models import hf
from valen_jax.models.config import ModelConfig, VisionConfig, padded_vocab
from valen_jax.models.transformer import init_params

log = logging.getLogger(__name__)

REQUIRED = {
    "data": ("format", "train", "eval", "tokenizer", "template_family", "seq_len", "max_patches",
             "global_batch", "workers", "shuffle"),
    "model": ("init_from", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "rope_theta",
              "tie_embeddings", "dtype", "param_dtype", "remat", "scan_layers", "vision"),
    "train": ("steps", "checkpoint_every", "keep_checkpoints", "seed", "log_every", "learning_rate",
              "warmup_steps", "end_learning_rate_fraction", "weight_decay", "adam_b1", "adam_b2",
              "grad_clip_norm"),
    "mesh": ("data", "fsdp", "tensor"),
    "eval": ("at_end", "batch_size", "max_examples", "max_new_tokens"),
}


class ConfigError(ValueError):
    """A config missing a field or holding an impossible value; checked once at start-up."""


def validate_config(config: ml_collections.ConfigDict) -> None:
    for group, keys in REQUIRED.items():
        if group not in config:
            raise ConfigError(f"config has no group {group!r}")
        missing = [k for k in keys if k not in config[group]]
        if missing:
            raise ConfigError(f"config.{group} lacks {', '.join(missing)}")
    for path in ("data.seq_len", "data.global_batch", "train.steps", "train.checkpoint_every",
                 "train.log_every", "eval.batch_size"):
        group, key = path.split(".")
        if int(config[group][key]) <= 0:
            raise ConfigError(f"config.{path} must be positive, got {config[group][key]}")
    if config.data.workers < 0:
        raise ConfigError("config.data.workers must be ≥ 0")
    if config.model.init_from:
        # The checkpoint fixes the architecture; a value here too would be silently ignored.
        clashing = [k for k in ARCHITECTURE_KEYS if config.model[k] is not None]
        if clashing:
            raise ConfigError(f"config.model.init_from is set, so {', '.join(clashing)} come from the checkpoint; "
                              "set them to None (the :hf variants do)")


ARCHITECTURE_KEYS = ("dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "rope_theta",
                     "tie_embeddings")


def model_config(config: ml_collections.ConfigDict, tokenizer) -> ModelConfig:
    m = config.model
    vision = None
    if m.vision is not None:
        vision = VisionConfig(patch_size=m.vision.patch_size, merge_size=m.vision.merge_size,
                              temporal_patch_size=m.vision.temporal_patch_size, dim=m.vision.dim,
                              num_layers=m.vision.num_layers, num_heads=m.vision.num_heads, mlp_dim=m.vision.mlp_dim)
    common = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=bool(m.remat), scan_layers=bool(m.scan_layers),
                  image_pad_id=token_id(tokenizer, vocabulary.IMAGE_PAD), vision=vision)
    if m.init_from:
        hf_config = json.loads((hf.resolve(m.init_from) / "config.json").read_text())
        base = hf.config_from_hf(hf_config, **common)
        # Added primitive tokens may outgrow the checkpoint's table; never shrink it.
        return dataclasses.replace(base, vocab_size=max(base.vocab_size, padded_vocab(len(tokenizer))))
    return ModelConfig(
        vocab_size=padded_vocab(len(tokenizer)), dim=m.dim, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, mlp_dim=m.mlp_dim, rope_theta=float(m.rope_theta),
        tie_embeddings=bool(m.tie_embeddings), **common)


def initial_params(config: ml_collections.ConfigDict, model_cfg: ModelConfig, tokenizer, shardings) -> dict:
    """Fresh parameters, or the configured HF checkpoint's with added-token rows by rule."""
    params = init_params(model_cfg, config.train.seed, shardings)
    if not config.model.init_from:
        return params
    directory = hf.resolve(config.model.init_from)
    base_tokenizer = AutoTokenizer.from_pretrained(str(config.data.tokenizer))
    pieces = hf.added_token_pieces(base_tokenizer, tokenizer)
    log.info("initialising from %s; %d added token rows set from their pieces", directory, len(pieces))
    return hf.load_params(directory, model_cfg, shardings, pieces, fresh=params)


def row_spec(seq_len: int, max_patches: int, tokenizer, model_cfg: ModelConfig, media_kwargs: dict) -> RowSpec:
    media_settings(media_kwargs)  # unknown keys are an error at start-up, not mid-epoch
    return RowSpec(seq_len=seq_len, max_patches=max_patches, image_pad_id=model_cfg.image_pad_id,
                   pad_id=int(tokenizer.pad_token_id), vision=model_cfg.vision, media_kwargs=dict(media_kwargs))


def _input_key(fmt: str, path: Path, fingerprint: dict[str, str]) -> str:
    digest = hashlib.sha256()
    digest.update(f"{fmt}\n{path.resolve()}\n{sorted(fingerprint.items())}\n".encode())
    digest.update(sha256_file(path).encode())
    return digest.hexdigest()[:16]


def ensure_shards(fmt: str, source: str | Path, cache_dir: Path, tokenizer_path: str | Path,
                  fingerprint: dict[str, str]) -> ShardSet:
    """Shards for `source`: a shard directory as is, or a JSONL/recipe converted once into the cache.

    The cache key covers the input's bytes and the tokenizer fingerprint, so edited data or
    another tokenizer converts anew instead of silently reusing stale shards.
    """
    source = Path(source)
    if source.is_dir():
        return ShardSet.open(source, fingerprint)
    target = cache_dir / f"{source.stem}-{_input_key(fmt, source, fingerprint)}"
    try:
        cached = ShardSet.open(target, fingerprint)
        if _sources_current(cached.manifest, source):
            return cached
        log.info("%s: annotation files changed since conversion; converting again", source)
    except ShardError:
        pass
    log.info("converting %s → %s", source, target)
    converter.convert(fmt, source, target, tokenizer_path, overwrite=True, progress=False)
    return ShardSet.open(target, fingerprint)


def _sources_current(manifest: Manifest, source: Path) -> bool:
    """The recipe's annotation files (listed with digests in the manifest) are unchanged."""
    for entry in manifest.data["sources"]:
        path = Path(entry["path"])
        path = path if path.is_absolute() else source.parent / path
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            return False
    return True


def summary(shard_set: ShardSet) -> dict[str, Any]:
    counts = dict(shard_set.manifest.data["counts"])
    return {"dir": str(shard_set.directory), **counts}
