"""Example → fixed-length training row: media slots expanded, inputs shifted, padding marked.

Row fields: `tokens`, `targets`, `target_weights`, `positions` ([seq_len], or [seq_len, 3] for an
M-RoPE model: `positions.py`), `segment_ids` (1 for the example, 0 for padding), and the vision
inputs `patches` [max_patches, patch_dim], `patch_positions` [max_patches, 3] (t, h, w) and
`patch_segments` [max_patches] (k for the row's k-th media item, 0 for padding). Media slot k of
the text is expanded to exactly the number of merged vision tokens media item k yields.

A shard holds one `<|image_pad|>` per media slot whatever the item is; the loader decides from the
media header. For a model with a video pad id (Qwen-VL), a whole clip (`kind` "video") is expanded
with `<|video_pad|>`, as the HF processors do; Qwen3-VL's processor also writes, per temporal patch,
the timestamp text `<{t:.1f} seconds>` then `<|vision_start|>` + that frame's pads + `<|vision_end|>`
(`Qwen3VLProcessor.replace_video_token`, which replaces the pad only and keeps the template's outer
`<|vision_start|>` … `<|vision_end|>`), so the loader does too (`VideoSlots`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline import vocabulary
from data_pipeline.primitives import BlockError, rendered_blocks
from data_pipeline.shards import Example
from data_pipeline.tokenizer import filler_id, token_id
from valen_jax.data.augment import EntryMedia, draw_sample_aug
from valen_jax.data.media import MediaInfo, load_frames
from valen_jax.data.positions import PositionScheme, SlotRun, piece_positions, slot_runs
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


@functools.lru_cache(maxsize=4)
def _backend_tokenizer(tokenizer_json: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


@dataclass(frozen=True)
class TextIds:
    """Plain text → token ids as the tokenizer encodes it between `<|vision_end|>` and `<|vision_start|>`,
    where the processor puts a timestamp: encoded inside those special tokens and cut out, so a tokenizer
    that treats the start of a text differently (a prefix space) still gives the in-context ids. Holds the
    backend tokenizer as its JSON, so a RowSpec pickles to Grain workers; each process rebuilds it once."""

    tokenizer_json: str = field(repr=False)

    @classmethod
    def of(cls, tokenizer) -> TextIds:
        return cls(tokenizer.backend_tokenizer.to_str())

    def __call__(self, text: str) -> list[int]:
        backend = _backend_tokenizer(self.tokenizer_json)
        ids = backend.encode(f"{vocabulary.VISION_END}{text}{vocabulary.VISION_START}", add_special_tokens=False).ids
        if ids[0] != backend.token_to_id(vocabulary.VISION_END) or ids[-1] != backend.token_to_id(vocabulary.VISION_START):
            raise AssemblyError(f"the tokenizer merges {text!r} with the vision tokens around it")
        return ids[1:-1]


@dataclass(frozen=True)
class VideoSlots:
    """How a whole clip's slot is expanded for a model with a video pad token; `timestamps` (Qwen3-VL) adds
    each temporal patch's timestamp text and its own vision start/end tokens."""

    video_pad_id: int
    temporal_patch_size: int
    timestamps: TextIds | None = None
    vision_start_id: int = -1
    vision_end_id: int = -1

    @classmethod
    def of(cls, tokenizer, model_cfg) -> VideoSlots | None:
        if model_cfg.video_pad_id < 0 or model_cfg.vision is None:
            return None
        vision = model_cfg.vision
        if vision.family != "qwen3_vl":
            return cls(int(model_cfg.video_pad_id), vision.temporal_patch_size)
        return cls(int(model_cfg.video_pad_id), vision.temporal_patch_size, TextIds.of(tokenizer),
                   token_id(tokenizer, vocabulary.VISION_START), token_id(tokenizer, vocabulary.VISION_END))

    def tokens(self, item: ProcessedMedia, info: MediaInfo, merge_size: int, where: str) -> np.ndarray:
        t, h, w = item.grid
        per_frame = h * w // merge_size ** 2
        if self.timestamps is None:
            return np.full(t * per_frame, self.video_pad_id, np.int64)
        stamps = qwen3_timestamps(info, self.temporal_patch_size, where)
        if len(stamps) != t:
            raise AssemblyError(f"{where}: {len(stamps)} Qwen3-VL video timestamps for {t} temporal patches")
        frame = [self.vision_start_id, *[self.video_pad_id] * per_frame, self.vision_end_id]
        return np.asarray([i for stamp in stamps for i in [*self.timestamps(f"<{stamp:.1f} seconds>"), *frame]],
                          np.int64)


def qwen3_timestamps(info: MediaInfo, temporal_patch_size: int, where: str) -> list[float]:
    """Seconds of each temporal patch as `Qwen3VLProcessor._calculate_timestamps` computes them: the sampled
    frame indices over the stream fps, the last index repeated to fill a patch, first and last frame averaged."""
    if not (info.frame_indices and info.video_fps > 0):
        raise AssemblyError(f"{where}: a Qwen3-VL video needs its frame indices and stream fps for its timestamps")
    indices = list(info.frame_indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [index / info.video_fps for index in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]


@dataclass(frozen=True)
class RowSpec:
    seq_len: int
    max_patches: int
    image_pad_id: int
    pad_id: int
    vision: VisionConfig | None
    media_kwargs: Mapping
    positions: PositionScheme = PositionScheme()  # 1-D unless the model has mrope_section
    video: VideoSlots | None = None  # None: every media item fills image pads (models without a video token)
    # Rows also carry `draft_block` (VFlash drafter training, train.mode=vflash): see `draft_block_of`.
    draft_blocks: bool = False

    @classmethod
    def of(cls, seq_len: int, max_patches: int, tokenizer, model_cfg, media_kwargs: Mapping) -> RowSpec:
        """The row layout of a model (`ModelConfig`) and tokenizer; unknown media_kwargs fail here, at start-up."""
        media_settings(media_kwargs)  # an unknown key is an error now, not mid-epoch
        return cls(seq_len=int(seq_len), max_patches=int(max_patches), image_pad_id=model_cfg.image_pad_id,
                   pad_id=filler_id(tokenizer), vision=model_cfg.vision, media_kwargs=dict(media_kwargs),
                   positions=PositionScheme.of(model_cfg), video=VideoSlots.of(tokenizer, model_cfg))

    @classmethod
    def from_config(cls, config, tokenizer, model_cfg, media_kwargs: Mapping | None = None) -> RowSpec:
        """`config.data.seq_len/max_patches` with `media_kwargs` (default: `config.media_kwargs` over the
        base model's processor settings, `vision_processor.media_kwargs_of`)."""
        media = media_kwargs_of(config)[0] if media_kwargs is None else media_kwargs
        return cls.of(config.data.seq_len, config.data.max_patches, tokenizer, model_cfg, media)

    @property
    def patch_dim(self) -> int:
        return self.vision.patch_dim if self.vision else 0

    def positions_of(self, ids: np.ndarray, runs: Sequence[SlotRun]) -> np.ndarray:
        """Positions of one unpadded expanded sequence ([L] or [L, 3])."""
        return piece_positions(ids, runs, self.positions)


@dataclass(frozen=True)
class ExpandedExample:
    ids: np.ndarray  # int32 [T] with every media slot expanded
    weights: np.ndarray  # float32 [T], weight of each token as a target
    media: list[ProcessedMedia]
    media_info: tuple[MediaInfo, ...] = ()  # per media item: frame indices, timestamps, augmentation
    runs: tuple[SlotRun, ...] = ()  # the media-slot runs in order, for M-RoPE positions
    draft_block: np.ndarray | None = None  # int32 [T] (`draft_block_of`, expanded), with spec.draft_blocks

    def positions(self, spec: RowSpec) -> np.ndarray:
        """Positions of `ids` as one separate sequence: [T] or [T, 3]."""
        return spec.positions_of(self.ids, self.runs)


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


def videos_of(example: Example) -> list[bool]:
    """Per media item: is it a whole clip (header kind "video")?"""
    return [header.get("kind") == "video" for header in contract.media_headers(example)]


def expand_slots(ids: np.ndarray, weights: np.ndarray, media: list[ProcessedMedia], spec: RowSpec,
                 where: str, infos: Sequence[MediaInfo] = (), videos: Sequence[bool] = ()
                 ) -> tuple[np.ndarray, np.ndarray, tuple[SlotRun, ...]]:
    """Each media slot token replaced by its item's tokens (weight 0): image pads, one per merged vision token,
    or for a clip `spec.video`'s expansion; with the slot runs that M-RoPE positions read."""
    slots = np.flatnonzero(ids == spec.image_pad_id)
    if len(slots) != len(media):
        raise AssemblyError(f"{where}: {len(slots)} media slots for {len(media)} media items")
    videos = list(videos) or [False] * len(media)
    infos = list(infos) or [MediaInfo((), ())] * len(media)
    out_ids, out_weights, runs, last = [], [], [], 0
    for slot, item, video, info in zip(slots, media, videos, infos, strict=True):
        as_video = video and spec.video is not None
        if as_video:
            filled = spec.video.tokens(item, info, spec.vision.merge_size, where).astype(ids.dtype)
        else:
            filled = np.full(tokens_of(item, spec.vision), spec.image_pad_id, ids.dtype)
        try:
            runs += slot_runs(item, as_video, info, spec.vision, where)
        except ValueError as error:
            raise AssemblyError(str(error)) from None
        out_ids += [ids[last:slot], filled]
        out_weights += [weights[last:slot], np.zeros(len(filled))]
        last = slot + 1
    out_ids.append(ids[last:])
    out_weights.append(weights[last:])
    return np.concatenate(out_ids), np.concatenate(out_weights).astype(np.float32), tuple(runs)


def expand_media_slots(example: Example, spec: RowSpec, *, training: bool = False,
                       rng: np.random.Generator | None = None, entry: EntryMedia | None = None) -> ExpandedExample:
    media, info = load_media(example, spec, training=training, rng=rng, entry=entry)
    ids, weights, runs = expand_slots(example.arrays["input_ids"], example.arrays["target_weights"], media, spec,
                                      _where(example), info, videos_of(example))
    blocks = None
    if spec.draft_blocks:
        # The same expansion as the weights: media tokens are in no block.
        blocks = expand_slots(example.arrays["input_ids"], draft_block_of(example).astype(np.float32), media, spec,
                              _where(example), info, videos_of(example))[1].astype(np.int32)
    return ExpandedExample(ids, weights, media, info, runs, blocks)


def draft_block_of(example: Example) -> np.ndarray:
    """int32 [T] over `input_ids`: k where the token is the k-th of a primitive block that an `atomic_decoding`
    call announces (seed 004: `block_size` counts every token of the primitive, start and end tags
    included), 0 elsewhere; what the VFlash drafter is trained to propose.

    The blocks are `data_pipeline.primitives.rendered_blocks` of the example's `primitive_spans` /
    `primitive_blocks`: a dual-arm pair's two adjacent atoms make one block, each of a dense call's
    `count` trajectories its own, points and boxes none. Primitives whose lengths do not add up to the
    announced size are an error naming the record.
    """
    arrays = example.arrays
    blocks = np.zeros(len(arrays["input_ids"]), np.int32)
    if "primitive_blocks" not in arrays:
        return blocks
    try:
        spans = rendered_blocks(arrays["primitive_spans"], arrays["primitive_blocks"])
    except BlockError as err:
        raise AssemblyError(f"{_where(example)}: {err}") from None
    for start, stop in spans:
        blocks[start:stop] = np.arange(1, stop - start + 1, dtype=np.int32)
    return blocks


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
    positions = expanded.positions(spec)[:-1]  # of the full sequence, as HF gives them; the last is no input
    return {
        "tokens": np.pad(ids[:-1], (0, pad), constant_values=spec.pad_id).astype(np.int32),
        "targets": np.pad(ids[1:], (0, pad), constant_values=spec.pad_id).astype(np.int32),
        "target_weights": np.pad(expanded.weights[1:], (0, pad)).astype(np.float32),
        "positions": pad_positions(positions, spec.seq_len),
        "segment_ids": np.pad(np.ones(length, np.int32), (0, pad)),
        **vision_arrays(expanded.media, spec, _where(example)),
        **({"draft_block": np.pad(expanded.draft_block[1:], (0, pad))} if spec.draft_blocks else {}),
    }


def pad_positions(positions: np.ndarray, seq_len: int) -> np.ndarray:
    """Positions of a row's tokens padded with 0 to `seq_len` ([L] → [seq_len], [L, 3] → [seq_len, 3])."""
    pad = [(0, seq_len - len(positions))] + [(0, 0)] * (positions.ndim - 1)
    return np.pad(positions.astype(np.int32), pad)


def batch_shapes_of(spec: RowSpec, global_batch: int) -> dict:
    """Abstract shapes of a global batch, for compiling the step before the first batch."""
    row = {"tokens": ((spec.seq_len,), jnp.int32), "targets": ((spec.seq_len,), jnp.int32),
           "target_weights": ((spec.seq_len,), jnp.float32),
           "positions": (spec.positions.shape(spec.seq_len), jnp.int32),
           "segment_ids": ((spec.seq_len,), jnp.int32),
           "patches": ((spec.max_patches, spec.patch_dim), jnp.float32),
           "patch_positions": ((spec.max_patches, 3), jnp.int32),
           "patch_segments": ((spec.max_patches,), jnp.int32)}
    if spec.draft_blocks:
        row["draft_block"] = ((spec.seq_len,), jnp.int32)
    return {k: jax.ShapeDtypeStruct((global_batch, *shape), dtype) for k, (shape, dtype) in row.items()}
