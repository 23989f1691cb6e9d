"""Frames → vision patches, the way Qwen2-VL's processor does it, driven by `media_kwargs`.

An image or a run of video frames is resized so both sides are multiples of
patch_size × merge_size and the area lies within [min_pixels, max_pixels] (aspect kept:
`smart_resize`), cut into patches of temporal_patch_size frames × patch_size², and ordered
window by window so each merge_size² run of patches merges into one text token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from PIL import Image

from valen_jax.models.config import VisionConfig

# media_kwargs keys and their defaults (the base model's processor settings when it has one).
MEDIA_DEFAULTS = {"min_pixels": 32 * 32, "max_pixels": 64 * 64, "fps": 2.0, "max_frames": 8}


class ProcessorError(ValueError):
    pass


@dataclass(frozen=True)
class ProcessedMedia:
    patches: np.ndarray  # float32 [N, temporal × patch² × 3]
    positions: np.ndarray  # int32 [N, 3]: (t, h, w) patch coordinates
    grid: tuple[int, int, int]  # (t, h, w) in patches

    @property
    def num_tokens(self) -> int:
        return len(self.patches)


def media_settings(media_kwargs: Mapping) -> dict:
    unknown = set(media_kwargs) - set(MEDIA_DEFAULTS)
    if unknown:
        raise ProcessorError(f"media_kwargs: unknown keys {sorted(unknown)}; known: {sorted(MEDIA_DEFAULTS)}")
    return {**MEDIA_DEFAULTS, **dict(media_kwargs)}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    if min(height, width) <= 0 or max(height, width) / min(height, width) > 200:
        raise ProcessorError(f"image {width}x{height}: aspect ratio beyond 200 or empty")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def process_frames(frames: list[Image.Image], vision: VisionConfig, media_kwargs: Mapping) -> ProcessedMedia:
    settings = media_settings(media_kwargs)
    p, m, tp = vision.patch_size, vision.merge_size, vision.temporal_patch_size
    width, height = frames[0].size
    h, w = smart_resize(height, width, p * m, int(settings["min_pixels"]), int(settings["max_pixels"]))
    pixels = np.stack([np.asarray(f.convert("RGB").resize((w, h), Image.BICUBIC), np.float32) for f in frames])
    pixels = pixels / 127.5 - 1.0
    # An image is repeated to fill one temporal patch; a video's last frame pads its final one.
    pad = (-len(pixels)) % tp
    pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)]) if pad else pixels
    gt, gh, gw = len(pixels) // tp, h // p, w // p
    # [gt, tp, gh/m, m, p, gw/m, m, p, 3] → windows of m×m patches in row-major window order.
    grid = pixels.reshape(gt, tp, gh // m, m, p, gw // m, m, p, 3)
    patches = grid.transpose(0, 2, 5, 3, 6, 1, 4, 7, 8).reshape(gt * gh * gw, tp * p * p * 3)
    t, bh, bw, ih, iw = np.meshgrid(np.arange(gt), np.arange(gh // m), np.arange(gw // m), np.arange(m),
                                    np.arange(m), indexing="ij")
    positions = np.stack([t, bh * m + ih, bw * m + iw], axis=-1).reshape(-1, 3).astype(np.int32)
    return ProcessedMedia(patches.astype(np.float32), positions, (gt, gh, gw))


def tokens_of(media: ProcessedMedia, vision: VisionConfig) -> int:
    """Text tokens the media fills after the merger."""
    return media.num_tokens // (vision.merge_size ** 2)
