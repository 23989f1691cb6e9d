"""Qwen2-VL's multimodal positions on the host (numpy), as transformers 5 computes them.

`patch_layout` gives each vision patch its (t, h, w) in the processor's order (block-major over
merge × merge windows, `vision_utils.get_vision_position_ids`); `rope_index` gives each token its
decoder (t, h, w) position (`Qwen2VLModel.get_rope_index`): text advances all three by one; a run
of media-slot tokens is one image or video laid out on its merged grid, starting at the current
position, after which the position advances by max(h, w) / merge. Qwen2.5-VL spaces a video's
frames by tokens_per_second × second_per_grid_t (`time_intervals`), truncated to integers.
Qwen3-VL's processor puts every video frame in its own slot run after a timestamp; pass one
(1, h, w) grid per frame then, as transformers' Qwen3-VL rope index does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def patch_layout(grid_thw: Sequence[int], merge_size: int) -> np.ndarray:
    """int32 [t·h·w, 3]: (frame, row, column) of each patch of one image or video, in processor order."""
    t, h, w = (int(v) for v in grid_thw)
    if h % merge_size or w % merge_size:
        raise ValueError(f"grid {grid_thw}: h and w must be multiples of merge_size {merge_size}")
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    block = (h // merge_size, merge_size, w // merge_size, merge_size)
    rows = rows.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    frames = np.repeat(np.arange(t), h * w)
    return np.stack([frames, np.tile(rows, t), np.tile(cols, t)], axis=-1).astype(np.int32)


def vision_inputs(grids: Sequence[Sequence[int]], merge_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Patch positions [P, 3] and segments [P] (media item k → k + 1) for items in sequence order."""
    layouts = [patch_layout(grid, merge_size) for grid in grids]
    segments = [np.full(len(layout), k + 1, np.int32) for k, layout in enumerate(layouts)]
    if not layouts:
        return np.zeros((0, 3), np.int32), np.zeros((0,), np.int32)
    return np.concatenate(layouts), np.concatenate(segments)


def rope_index(tokens: Sequence[int], grids: Sequence[Sequence[int]], image_pad_id: int, video_pad_id: int,
               merge_size: int, time_intervals: Sequence[float] | None = None) -> np.ndarray:
    """int32 [T, 3] decoder positions of one unpadded row; `grids` are the (t, h, w) of the row's images and
    videos in the order their slot runs appear; `time_intervals` (default 1 each) the temporal position step of
    each (Qwen2.5-VL videos: tokens_per_second × second_per_grid_t; images: 1)."""
    tokens = np.asarray(tokens)
    kind = np.where(tokens == image_pad_id, 1, np.where(tokens == video_pad_id, 2, 0))
    edges = np.flatnonzero(np.diff(kind)) + 1
    starts, ends = np.concatenate([[0], edges]), np.concatenate([edges, [len(tokens)]])
    pieces, current, used = [], 0, 0
    for start, end in zip(starts, ends, strict=True):
        if kind[start] == 0:
            pieces.append(np.repeat(np.arange(current, current + end - start)[:, None], 3, axis=1))
            current += end - start
            continue
        if used == len(grids):
            raise ValueError(f"media slots at tokens {start}..{end - 1} have no grid (only {len(grids)} given)")
        t, h, w = (int(v) for v in grids[used])
        used += 1
        gh, gw = h // merge_size, w // merge_size
        if end - start != t * gh * gw:
            raise ValueError(f"media slots at tokens {start}..{end - 1}: {end - start} tokens, grid {(t, h, w)} "
                             f"with merge {merge_size} needs {t * gh * gw}")
        interval = 1.0 if time_intervals is None else time_intervals[used - 1]
        # torch: (arange(t) * interval).long(), the product in float32
        frames = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        tt, hh, ww = np.meshgrid(frames, np.arange(gh), np.arange(gw), indexing="ij")
        pieces.append(np.stack([tt, hh, ww], axis=-1).reshape(-1, 3) + current)
        current += max(h, w) // merge_size
    if used != len(grids):
        raise ValueError(f"{len(grids)} grids given, {used} media slot runs in the row")
    return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros((0, 3), np.int32)
