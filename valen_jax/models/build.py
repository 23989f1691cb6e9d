"""The run's model: its ModelConfig from the config (or the HF checkpoint it starts from) and first parameters."""

from __future__ import annotations

import dataclasses
import json
import logging

import ml_collections
from transformers import AutoTokenizer

from data_pipeline import vocabulary
from data_pipeline.tokenizer import token_id
from valen_jax.models import hf
from valen_jax.models.config import ModelConfig, VisionConfig, padded_vocab
from valen_jax.models.transformer import init_params

log = logging.getLogger(__name__)


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
