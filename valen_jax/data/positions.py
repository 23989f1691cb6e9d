"""Decoder positions of a row piece: 1-D, or M-RoPE (t, h, w) as the HF processor + get_rope_index give them.

A model without `mrope_section` takes 1-D positions (0, 1, 2, … per sequence). A Qwen-VL model
(`mrope_section` set) takes [L, 3]: `models.mrope.rope_index` over the expanded ids, with each media
item's slot runs in order (`SlotRun`). Each media family lays a video out differently
(transformers 5.24, `get_rope_index` and the processors):
- Qwen2-VL: one run with grid (t, h, w), frames at time positions 0, 1, 2, …
- Qwen2.5-VL: one run, frame k at int(k × tokens_per_second × second_per_grid_t), where
  second_per_grid_t = temporal_patch_size / sampled_fps and sampled_fps = frames sampled / frames
  in the stream × stream fps (`Qwen2_5_VLProcessor._process_videos`, `VideoMetadata.sampled_fps`);
  the product is float32 as torch forms it from the processor's float32 `second_per_grid_ts`.
- Qwen3-VL: one run of grid (1, h, w) per temporal patch, each after its own timestamp text
  (`assemble.VideoSlots`), as `Qwen3VLModel.get_rope_index` splits the video grid.
Images are one run (t, h, w) with interval 1 in every family.

Text after a prefix whose positions are known continues from the prefix's largest position + 1 on
all three axes: exactly what rope_index gives a text token that follows the prefix (and, in 1-D,
the plain continuation of the arange).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from valen_jax.data.media import MediaInfo
from valen_jax.data.vision_processor import ProcessedMedia
from valen_jax.models import mrope
from valen_jax.models.config import VisionConfig


@dataclass(frozen=True)
class SlotRun:
    """One run of media-slot tokens as rope_index reads it: its grid (t, h, w) in patches and the time step
    between its temporal patches."""

    grid: tuple[int, int, int]
    interval: float = 1.0


@dataclass(frozen=True)
class PositionScheme:
    """1-D (`mrope` False: text and from-scratch models) or the M-RoPE layout of an imported Qwen-VL model."""

    mrope: bool = False
    image_pad_id: int = -1
    video_pad_id: int = -1
    merge_size: int = 1

    @classmethod
    def of(cls, model_cfg) -> PositionScheme:
        if model_cfg.mrope_section is None:
            return cls()
        if model_cfg.vision is None:
            # The M-RoPE models we import are all Qwen-VL ones; without a tower the slot layout is unknown.
            raise ValueError("a model with mrope_section needs its vision config (merge_size) to lay out positions")
        return cls(True, int(model_cfg.image_pad_id), int(model_cfg.video_pad_id), int(model_cfg.vision.merge_size))

    def shape(self, length: int) -> tuple[int, ...]:
        """Shape of the positions of `length` tokens: (length,) or (length, 3)."""
        return (length, 3) if self.mrope else (length,)


def slot_runs(item: ProcessedMedia, video: bool, info: MediaInfo, vision: VisionConfig, where: str) -> list[SlotRun]:
    """The slot runs of one media item (`video`: a whole clip expanded with the video pad)."""
    if not video:
        return [SlotRun(tuple(int(v) for v in item.grid))]
    t, h, w = (int(v) for v in item.grid)
    if vision.family == "qwen3_vl":
        return [SlotRun((1, h, w))] * t
    if vision.family == "qwen2_5_vl":
        return [SlotRun((t, h, w), qwen2_5_time_interval(info, vision, where))]
    return [SlotRun((t, h, w))]


def qwen2_5_time_interval(info: MediaInfo, vision: VisionConfig, where: str) -> float:
    """tokens_per_second × second_per_grid_t, in float32 as transformers multiplies them."""
    if not (info.video_fps > 0 and info.total_frames > 0 and info.frame_indices):
        raise ValueError(f"{where}: a Qwen2.5-VL video needs its stream fps and frame count for time positions")
    sampled_fps = len(info.frame_indices) / info.total_frames * info.video_fps
    second_per_grid = np.float32(vision.temporal_patch_size / sampled_fps)
    return float(np.float32(vision.tokens_per_second) * second_per_grid)


def piece_positions(ids: np.ndarray, runs: Sequence[SlotRun], scheme: PositionScheme) -> np.ndarray:
    """int32 positions of one unpadded sequence (a separate HF sequence): [L] or [L, 3]."""
    if not scheme.mrope:
        return np.arange(len(ids), dtype=np.int32)
    return mrope.rope_index(ids, [run.grid for run in runs], scheme.image_pad_id, scheme.video_pad_id,
                            scheme.merge_size, [run.interval for run in runs])


def text_after(prefix: np.ndarray, offsets: np.ndarray, scheme: PositionScheme) -> np.ndarray:
    """Positions of text tokens at 0-based `offsets` after a prefix with positions `prefix`: max + 1 + offset,
    on every axis with M-RoPE (what rope_index gives text that follows the prefix)."""
    start = int(prefix.max()) + 1 if len(prefix) else 0
    flat = (start + np.asarray(offsets)).astype(np.int32)
    return np.repeat(flat[:, None], 3, axis=1) if scheme.mrope else flat


def next_position(previous: np.ndarray) -> np.ndarray:
    """The position of a token generated after a sequence with positions `previous` ([L] or [L, 3])."""
    return np.full(previous.shape[1:], previous.max() + 1, np.int32)
