"""What train and evaluate share: config checks, model config, shards for a run, row layout."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import ml_collections
from jax.experimental import multihost_utils
from transformers import AutoTokenizer

from data_pipeline import convert as converter
from data_pipeline import vocabulary
from data_pipeline.shards import Manifest, ShardError, sha256_file
from data_pipeline.tokenizer import token_id
from valen_jax import losses, optim
from valen_jax.data.assemble import RowSpec
from valen_jax.data.packing import PackingSpec
from valen_jax.data.sources import ShardSet
from valen_jax.data.valen_rows import QuestionSpec
from valen_jax.data.vision_processor import media_settings
from valen_jax.models import hf
from valen_jax.models.config import ModelConfig, VisionConfig, padded_vocab
from valen_jax.models.transformer import init_params

log = logging.getLogger(__name__)

REQUIRED = {
    "data": ("format", "train", "eval", "eval_format", "train_options", "eval_options", "tokenizer",
             "template_family", "seq_len", "max_patches", "global_batch", "workers", "shuffle", "packing",
             "max_segments", "overlong", "pack_buffer", "valen_mode", "max_questions", "max_candidates"),
    "model": ("init_from", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "rope_theta",
              "tie_embeddings", "dtype", "param_dtype", "remat", "scan_layers", "vision"),
    "train": ("steps", "checkpoint_every", "keep_checkpoints", "checkpoint_compression", "seed", "log_every",
              "learning_rate", "warmup_steps", "decay", "end_learning_rate_fraction", "weight_decay", "adam_b1",
              "adam_b2", "grad_clip_norm", "grad_accum_steps", "param_groups", "peak_flops", "debug_pause_in_save_s"),
    "loss": ("weights", "z_loss", "loss_reduction"),
    "mesh": ("data", "fsdp", "tensor"),
    "eval": ("at_end", "every", "batch_size", "max_examples", "max_new_tokens"),
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
    if config.train.keep_checkpoints is not None and int(config.train.keep_checkpoints) < 1:
        raise ConfigError("config.train.keep_checkpoints must be ≥ 1 (None keeps all)")
    _validate_optimisation(config)
    _validate_loss(config.loss)
    if int(config.eval.every) < 0:
        raise ConfigError(f"config.eval.every must be ≥ 0 (0: no evaluation during training), got {config.eval.every}")
    if config.model.init_from:
        # The checkpoint fixes the architecture; a value here too would be silently ignored.
        clashing = [k for k in ARCHITECTURE_KEYS if config.model[k] is not None]
        if clashing:
            raise ConfigError(f"config.model.init_from is set, so {', '.join(clashing)} come from the checkpoint; "
                              "set them to None (the :hf variants do)")


def _validate_optimisation(config: ml_collections.ConfigDict) -> None:
    train = config.train
    if train.decay not in optim.DECAYS:
        raise ConfigError(f"config.train.decay={train.decay!r}; choose one of {', '.join(optim.DECAYS)}")
    accum = int(train.grad_accum_steps)
    if accum < 1 or int(config.data.global_batch) % accum:
        raise ConfigError(f"config.train.grad_accum_steps={train.grad_accum_steps} must be ≥ 1 and divide "
                          f"config.data.global_batch={config.data.global_batch}")
    try:
        optim.check_groups(list(train.param_groups))
    except optim.ParamGroupError as error:
        raise ConfigError(str(error)) from None
    if train.peak_flops is not None and not float(train.peak_flops) >= 0:
        raise ConfigError(f"config.train.peak_flops must be None/0 (from the device) or > 0, got {train.peak_flops}")
    if not float(train.debug_pause_in_save_s) >= 0:
        raise ConfigError(f"config.train.debug_pause_in_save_s must be ≥ 0, got {train.debug_pause_in_save_s}")
    for key in ("dtype", "param_dtype"):
        if config.model[key] not in DTYPES:
            raise ConfigError(f"config.model.{key}={config.model[key]!r}; choose one of {', '.join(DTYPES)}")
    if config.model.param_dtype != "float32":
        # Adam's updates are ~1e-3 of a weight: below bf16's resolution they would round away.
        raise ConfigError("config.model.param_dtype must be float32 (master weights); "
                          "use config.model.dtype=bfloat16 for bf16 compute")


def _validate_loss(loss: ml_collections.ConfigDict) -> None:
    weights = dict(loss.weights)
    if set(weights) != set(losses.OBJECTIVES):
        raise ConfigError(f"config.loss.weights must name exactly {', '.join(losses.OBJECTIVES)}; "
                          f"got {', '.join(sorted(weights))}")
    for name, value in weights.items():
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"config.loss.weights.{name} must be a finite number ≥ 0, got {value!r}")
    if not any(value > 0 for value in weights.values()):
        raise ConfigError("config.loss.weights: every weight is 0, nothing would be trained")
    if not (math.isfinite(float(loss.z_loss)) and float(loss.z_loss) >= 0):
        raise ConfigError(f"config.loss.z_loss must be ≥ 0, got {loss.z_loss}")
    if loss.loss_reduction not in losses.LOSS_REDUCTIONS:
        raise ConfigError(f"config.loss.loss_reduction={loss.loss_reduction!r}; choose one of "
                          f"{', '.join(losses.LOSS_REDUCTIONS)} (seed 000)")


def check_batch_split(config: ml_collections.ConfigDict, mesh) -> None:
    """Each micro-batch must split evenly over the batch-sharded devices (`data` × `fsdp`)."""
    devices = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = int(config.data.global_batch) // int(config.train.grad_accum_steps)
    if micro % devices:
        raise ConfigError(f"config.data.global_batch={config.data.global_batch} / train.grad_accum_steps="
                          f"{config.train.grad_accum_steps} = {micro} rows per micro-batch do not split over "
                          f"{devices} batch-sharded devices (mesh data × fsdp)")


DTYPES = ("float32", "bfloat16")
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
                  image_pad_id=token_id(tokenizer, vocabulary.IMAGE_PAD), vision=vision,
                  # Valen's scored branches need the scalar head; other tasks never build it.
                  score_head=float(config.loss.weights.get("branches", 0.0)) > 0)
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


def _input_key(fmt: str, path: Path, fingerprint: dict[str, str], options: dict) -> str:
    digest = hashlib.sha256()
    digest.update(f"{fmt}\n{path.resolve()}\n{sorted(fingerprint.items())}\n{sorted(options.items())}\n".encode())
    digest.update(sha256_file(path).encode())
    return digest.hexdigest()[:16]


def ensure_shards(fmt: str, source: str | Path, cache_dir: Path, tokenizer_path: str | Path,
                  fingerprint: dict[str, str], options: Mapping[str, Any] | None = None) -> ShardSet:
    """Shards for `source`: a shard directory as is, or a JSONL/recipe converted once into the cache.

    The cache key covers the input's bytes, the tokenizer fingerprint and the converter
    `options` (e.g. vakforge's `split`), so edited data, another tokenizer or another split
    converts anew instead of silently reusing stale shards. A shard directory made with another
    tokenizer is refused (ShardError naming both fingerprints).
    """
    source = Path(source)
    options = dict(options or {})
    if source.is_dir():
        if options:
            raise ConfigError(f"{source}: converter options {options} given for a directory of ready shards")
        return ShardSet.open(source, fingerprint)
    target = cache_dir / f"{source.stem}-{_input_key(fmt, source, fingerprint, options)}"
    # Processes sharing a workdir must not convert into the same folder at once: process 0
    # converts, the others wait at a barrier, then everyone opens the same shards.
    if jax.process_index() == 0 and not _cached(target, source, fingerprint):
        log.info("converting %s → %s", source, target)
        converter.convert(fmt, source, target, tokenizer_path, overwrite=True, progress=False, options=options)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"shards ready: {target.name}")
    return ShardSet.open(target, fingerprint)


def _cached(target: Path, source: Path, fingerprint: dict[str, str]) -> bool:
    try:
        cached = ShardSet.open(target, fingerprint)
    except ShardError:
        return False
    if _sources_current(cached.manifest, source):
        return True
    log.info("%s: annotation files changed since conversion; converting again", source)
    return False


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


def packing_spec(config: ml_collections.ConfigDict) -> PackingSpec:
    return PackingSpec(config.data.packing, int(config.data.max_segments), config.data.overlong,
                       int(config.data.pack_buffer))


def question_spec(config: ml_collections.ConfigDict, training: bool) -> QuestionSpec:
    return QuestionSpec(config.data.valen_mode, int(config.data.max_questions), int(config.data.max_candidates),
                        training)
