"""Example → fixed-length training row: media slots expanded, inputs shifted, padding marked.

Row fields: `tokens`, `targets`, `target_weights`, `positions`, `segment_ids` (1 for the
example, 0 for padding), `images` [max_images, S, S, 3] and `image_mask`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from data_pipeline.shards import Example
from valen_jax.data.media import load_image


class AssemblyError(ValueError):
    """A row that cannot be built without cutting it; names the example's source line."""


@dataclass(frozen=True)
class RowSpec:
    seq_len: int
    max_images: int
    image_pad_id: int
    pad_id: int
    tokens_per_image: int
    media_kwargs: Mapping


def _where(example: Example) -> str:
    return f"{example.meta.get('source', '?')}:{example.meta.get('line', '?')}"


def expand_media_slots(example: Example, spec: RowSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each media slot becomes the processor's number of vision tokens; images decoded.

    Returns (ids, target weights, images [max_images, S, S, 3]).
    """
    ids = example.arrays["input_ids"]
    weights = example.arrays["target_weights"]
    slots = ids == spec.image_pad_id
    repeat = np.where(slots, spec.tokens_per_image, 1)
    media = example.meta.get("media", [])
    if len(media) > spec.max_images:
        raise AssemblyError(f"{_where(example)}: {len(media)} images exceed data.max_images={spec.max_images}")
    size = int(spec.media_kwargs["image_size"])
    images = np.zeros((spec.max_images, size, size, 3), np.float32)
    for index, header in enumerate(media):
        images[index] = load_image(example.arrays[f"media_{index}"].tobytes(), header, spec.media_kwargs,
                                   _where(example))
    return np.repeat(ids, repeat), np.repeat(np.where(slots, 0.0, weights).astype(np.float32), repeat), images


def assemble(example: Example, spec: RowSpec) -> dict[str, np.ndarray]:
    ids, weights, images = expand_media_slots(example, spec)
    length = len(ids) - 1
    if length > spec.seq_len:
        # Cutting could split a media placeholder or drop every target (DESIGN); refuse instead.
        raise AssemblyError(f"{_where(example)}: {length} tokens after media expansion exceed "
                            f"data.seq_len={spec.seq_len}; raise seq_len or shorten the record")
    pad = spec.seq_len - length
    return {
        "tokens": np.pad(ids[:-1], (0, pad), constant_values=spec.pad_id).astype(np.int32),
        "targets": np.pad(ids[1:], (0, pad), constant_values=spec.pad_id).astype(np.int32),
        "target_weights": np.pad(weights[1:], (0, pad)).astype(np.float32),
        "positions": np.pad(np.arange(length, dtype=np.int32), (0, pad)),
        "segment_ids": np.pad(np.ones(length, np.int32), (0, pad)),
        "images": images,
        "image_mask": np.arange(spec.max_images) < len(example.meta.get("media", [])),
    }


def batch_shapes_of(spec: RowSpec, global_batch: int) -> dict:
    """Abstract shapes of a global batch, for compiling the step before the first batch."""
    import jax
    import jax.numpy as jnp

    size = int(spec.media_kwargs["image_size"])
    row = {"tokens": ((spec.seq_len,), jnp.int32), "targets": ((spec.seq_len,), jnp.int32),
           "target_weights": ((spec.seq_len,), jnp.float32), "positions": ((spec.seq_len,), jnp.int32),
           "segment_ids": ((spec.seq_len,), jnp.int32),
           "images": ((spec.max_images, size, size, 3), jnp.float32),
           "image_mask": ((spec.max_images,), jnp.bool_)}
    return {k: jax.ShapeDtypeStruct((global_batch, *shape), dtype) for k, (shape, dtype) in row.items()}
