"""The media_kwargs keys and their smoke defaults, in a leaf the config schema reads without PIL.

`config_schema` builds the `media_kwargs` group from these keys, and `vision_processor` (which
needs PIL and the model's vision config) resolves and applies them; neither imports the other.
"""

from __future__ import annotations

# media_kwargs keys and the SMOKE defaults: the settings of a model trained from scratch (the tiny
# ViTs of configs/*.py, CPU runs on 64-pixel smoke images). A run from an HF base model takes
# each key from the base model's own processor files instead (`vision_processor.resolve_media_kwargs`, seed 000:
# "the defaults are the base model's processor settings"); a key the config sets wins over both.
# image_mean/std 0.5 map pixels to [-1, 1] (what the smoke models have always been trained on);
# min_frames 1 keeps one frame of a clip shorter than 1/fps (Qwen3-VL's processor file states 4).
# video_* are the pixel bounds of a whole-clip `video` item, per frame ("frame": Qwen2/2.5-VL) or
# over frames × height × width ("clip": Qwen3-VL), as the checkpoint's video processor sets them.
MEDIA_DEFAULTS = {"min_pixels": 32 * 32, "max_pixels": 64 * 64, "fps": 2.0, "max_frames": 8, "min_frames": 1,
                  "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5),
                  "video_min_pixels": 32 * 32, "video_max_pixels": 64 * 64, "video_pixels_per": "frame"}
