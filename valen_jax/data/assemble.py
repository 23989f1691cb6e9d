"""Example → fixed-length training row: media slots expanded, inputs shifted, padding marked.

Row fields: `tokens`, `targets`, `target_weights`, `positions`, `segment_ids` (1 for the
example, 0 for padding), and the vision inputs `patches` [max_patches, patch_dim],
`patch_positions` [max_patches, 3] (t, h, w) and `patch_segments` [max_patches] (k for the
row's k-th media item, 0 for padding). Media slot k of the text is expanded to exactly the
number of merged vision tokens media item k yields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline.shards import Example
from valen_jax.data.augment import EntryMedia, draw_sample_aug
from valen_jax.data.media import MediaInfo, load_frames
from valen_jax.data.vision_processor import (
    ProcessedMedia,
    media_kwargs_of,
    media_settings,
    process_frames,
    tokens_of,
)
from valen_jax.models.config import VisionConfig


class AssemblyError(ValueError):
    """A row that cannot be built without cutting it; names the example's source line."""


@dataclass(frozen=True)
class RowSpec:
    seq_len: int
    max_patches: int
    image_pad_id: int
    pad_id: int
    vision: VisionConfig | None
    media_kwargs: Mapping

    @classmethod
    def of(cls, seq_len: int, max_patches: int, tokenizer, model_cfg, media_kwargs: Mapping) -> RowSpec:
        """The row layout of a model (`ModelConfig`) and tokenizer; unknown media_kwargs fail here, at start-up."""
        media_settings(media_kwargs)  # an unknown key is an error now, not mid-epoch
        return cls(seq_len=int(seq_len), max_patches=int(max_patches), image_pad_id=model_cfg.image_pad_id,
                   pad_id=int(tokenizer.pad_token_id), vision=model_cfg.vision, media_kwargs=dict(media_kwargs))

    @classmethod
    def from_config(cls, config, tokenizer, model_cfg, media_kwargs: Mapping | None = None) -> RowSpec:
        """`config.data.seq_len/max_patches` with `media_kwargs` (default: `config.media_kwargs` over the
        base model's processor settings, `vision_processor.media_kwargs_of`)."""
        media = media_kwargs_of(config)[0] if media_kwargs is None else media_kwargs
        return cls.of(config.data.seq_len, config.data.max_patches, tokenizer, model_cfg, media)

    @property
    def patch_dim(self) -> int:
        return self.vision.patch_dim if self.vision else 0


@dataclass(frozen=True)
class ExpandedExample:
    ids: np.ndarray  # int32 [T] with every media slot expanded
    weights: np.ndarray  # float32 [T], weight of each token as a target
    media: list[ProcessedMedia]
    media_info: tuple[MediaInfo, ...] = ()  # per media item: frame indices, timestamps, augmentation


def _where(example: Example) -> str:
    return contract.where(example)


def load_media(example: Example, spec: RowSpec, *, training: bool = False, rng: np.random.Generator | None = None,
               entry: EntryMedia | None = None) -> tuple[list[ProcessedMedia], tuple[MediaInfo, ...]]:
    """Processed media items and what the media log records of each (frame indices, timestamps).

    Augmentation runs only with `training` (seed 004: visual_aug "applies only in training"); its
    op is drawn once per sample and shared by the sample's views, so it is drawn here.
    """
    headers = contract.media_headers(example)
    if headers and spec.vision is None:
        raise AssemblyError(f"{_where(example)}: has media but the model has no vision encoder")
    sample_aug = draw_sample_aug(entry, rng, _where(example)) if training and entry is not None else None
    loaded = [load_frames(contract.media_bytes(example, i), header, spec.media_kwargs, _where(example),
                          training=training, rng=rng, entry=entry, view=i, sample_aug=sample_aug)
              for i, header in enumerate(headers)]
    return ([process_frames(item.frames, spec.vision, spec.media_kwargs, video=header.get("kind") == "video")
             for item, header in zip(loaded, headers, strict=True)],
            tuple(item.info for item in loaded))


def process_media(example: Example, spec: RowSpec, **augment) -> list[ProcessedMedia]:
    return load_media(example, spec, **augment)[0]


def expand_slots(ids: np.ndarray, weights: np.ndarray, media: list[ProcessedMedia], spec: RowSpec,
                 where: str) -> tuple[np.ndarray, np.ndarray]:
    """Each media slot token repeated to its item's merged vision-token count (weight 0)."""
    slots = ids == spec.image_pad_id
    if int(slots.sum()) != len(media):
        raise AssemblyError(f"{where}: {int(slots.sum())} media slots for {len(media)} media items")
    repeat = np.ones(len(ids), np.int64)
    repeat[np.flatnonzero(slots)] = [tokens_of(m, spec.vision) for m in media]
    return np.repeat(ids, repeat), np.repeat(np.where(slots, 0.0, weights), repeat).astype(np.float32)


def expand_media_slots(example: Example, spec: RowSpec, *, training: bool = False,
                       rng: np.random.Generator | None = None, entry: EntryMedia | None = None) -> ExpandedExample:
    media, info = load_media(example, spec, training=training, rng=rng, entry=entry)
    ids, weights = expand_slots(example.arrays["input_ids"], example.arrays["target_weights"], media, spec,
                                _where(example))
    return ExpandedExample(ids, weights, media, info)


def vision_arrays(media: list[ProcessedMedia], spec: RowSpec, where: str) -> dict[str, np.ndarray]:
    patches = np.zeros((spec.max_patches, spec.patch_dim), np.float32)
    positions = np.zeros((spec.max_patches, 3), np.int32)
    segments = np.zeros((spec.max_patches,), np.int32)
    total = sum(m.num_tokens for m in media)
    if total > spec.max_patches:
        raise AssemblyError(f"{where}: {total} vision patches exceed data.max_patches={spec.max_patches}; "
                            "raise it or lower media_kwargs.max_pixels")
    start = 0
    for index, item in enumerate(media, start=1):
        stop = start + item.num_tokens
        patches[start:stop], positions[start:stop], segments[start:stop] = item.patches, item.positions, index
        start = stop
    return {"patches": patches, "patch_positions": positions, "patch_segments": segments}


def assemble(example: Example, spec: RowSpec, *, training: bool = False, rng: np.random.Generator | None = None,
             entry: EntryMedia | None = None) -> dict[str, np.ndarray]:
    expanded = expand_media_slots(example, spec, training=training, rng=rng, entry=entry)
    ids = expanded.ids
    length = len(ids) - 1
    if length > spec.seq_len:
        # Cutting could split a media placeholder or drop every target (DESIGN); refuse instead.
        raise AssemblyError(f"{_where(example)}: {length} tokens after media expansion exceed "
                            f"data.seq_len={spec.seq_len}; raise seq_len or shorten the record")
    pad = spec.seq_len - length
    return {
        "tokens": np.pad(ids[:-1], (0, pad), constant_values=spec.pad_id).astype(np.int32),
        "targets": np.pad(ids[1:], (0, pad), constant_values=spec.pad_id).astype(np.int32),
        "target_weights": np.pad(expanded.weights[1:], (0, pad)).astype(np.float32),
        "positions": np.pad(np.arange(length, dtype=np.int32), (0, pad)),
        "segment_ids": np.pad(np.ones(length, np.int32), (0, pad)),
        **vision_arrays(expanded.media, spec, _where(example)),
    }


def batch_shapes_of(spec: RowSpec, global_batch: int) -> dict:
    """Abstract shapes of a global batch, for compiling the step before the first batch."""
    row = {"tokens": ((spec.seq_len,), jnp.int32), "targets": ((spec.seq_len,), jnp.int32),
           "target_weights": ((spec.seq_len,), jnp.float32), "positions": ((spec.seq_len,), jnp.int32),
           "segment_ids": ((spec.seq_len,), jnp.int32),
           "patches": ((spec.max_patches, spec.patch_dim), jnp.float32),
           "patch_positions": ((spec.max_patches, 3), jnp.int32),
           "patch_segments": ((spec.max_patches,), jnp.int32)}
    return {k: jax.ShapeDtypeStruct((global_batch, *shape), dtype) for k, (shape, dtype) in row.items()}
