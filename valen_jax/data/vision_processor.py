"""Frames → vision patches, the way Qwen2-VL's processor does it, driven by `media_kwargs`.

An image or a run of video frames is resized so both sides are multiples of
patch_size × merge_size and the area lies within [min_pixels, max_pixels] (aspect kept:
`smart_resize`), cut into patches of temporal_patch_size frames × patch_size², and ordered
window by window so each merge_size² run of patches merges into one text token.

The numerics are those of transformers' `Qwen2VLImageProcessorPil` (5.24), which Qwen2-VL,
Qwen2.5-VL and Qwen3-VL checkpoints name: Pillow bicubic resize of the uint8 RGB frame,
× 1/255 in float64 then float32, (x − image_mean) / image_std in float32, and each patch
flattened channel-first as (C, t, p, p) — the layout of the HF vision tower's Conv3d weight
[dim, C, t, p, p], so an imported patch embedding is a plain reshape.
tests/test_processor_parity.py holds us to it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from valen_jax.data.media_defaults import MEDIA_DEFAULTS
from valen_jax.models import hf_common  # the checkpoint resolver, without the importers
from valen_jax.models.config import VisionConfig

VIDEO_PIXELS_PER = {"Qwen2VLVideoProcessor": "frame", "Qwen3VLVideoProcessor": "clip"}
RESCALE_FACTOR = 1 / 255
PIL_BICUBIC = 3  # PILImageResampling.BICUBIC, the `resample` the Qwen-VL processors use
# Processor settings we do not honour in any other value than this: a checkpoint stating another is refused.
FIXED_SETTINGS = {"do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                  "resample": PIL_BICUBIC}
GEOMETRY_KEYS = ("patch_size", "temporal_patch_size", "merge_size")
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"  # transformers 5 nests both processors' settings here
SMOKE_DEFAULT = "smoke default"


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
    unset = sorted(key for key, value in media_kwargs.items() if value is None)
    if unset:
        raise ProcessorError(f"media_kwargs: {', '.join(unset)} not resolved (None); resolve_media_kwargs "
                             "fills them from the base model's processor or the smoke defaults")
    settings = {**MEDIA_DEFAULTS, **dict(media_kwargs)}
    for key in ("image_mean", "image_std"):
        _check_channels(key, settings[key], "media_kwargs")
    if settings["video_pixels_per"] not in ("frame", "clip"):
        raise ProcessorError(f"media_kwargs: video_pixels_per must be 'frame' or 'clip', got {settings['video_pixels_per']!r}")
    return settings


def _check_channels(key: str, value, where: str) -> tuple[float, float, float]:
    """One number per RGB channel; a std must be positive (it divides)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = (value,) * 3
    ok = (isinstance(value, list | tuple) and len(value) == 3
          and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value))
    if not ok or (key == "image_std" and min(value) <= 0):
        raise ProcessorError(f"{where}: {key} must be three numbers (RGB){', all > 0' if key == 'image_std' else ''}, "
                             f"got {value!r}")
    return tuple(float(v) for v in value)


def processor_media_kwargs(directory: str | Path) -> dict[str, tuple[object, str]]:
    """The media_kwargs an HF checkpoint's processor files state, each with the file it came from
    (`processor_configs`: transformers 5's nested `processor_config.json`, else the legacy files).

    The image processor (`preprocessor_config.json`) gives the pixel bounds: `min_pixels`/`max_pixels`, or
    `size.shortest_edge`/`size.longest_edge`, which Qwen2-VL-family processors define as the same
    pixel AREAS, and `image_mean`/`image_std`. The video processor gives `fps`, `min_frames`,
    `max_frames`, its own pixel bounds as `video_min_pixels`/`video_max_pixels` (the image ones
    where there is no video processor, as transformers then builds it from the image file), whether
    they bound each frame or the whole clip (`video_pixels_per`, by `video_processor_type`), and
    mean/std where the image processor states none. Keys neither file states are absent from
    the result. A setting we cannot honour (no resize, another resampling filter or rescale factor,
    no normalisation) is refused, naming the file and the field."""
    found: dict[str, tuple[object, str]] = {}
    configs = processor_configs(directory)
    for role, data, name, path in configs:
        _refuse_unhonoured(data, path)
        size = data.get("size") if isinstance(data.get("size"), dict) else {}
        stated = {"min_pixels": data.get("min_pixels", size.get("shortest_edge")),
                  "max_pixels": data.get("max_pixels", size.get("longest_edge"))}
        if role == "video":
            stated.update(fps=data.get("fps"), max_frames=data.get("max_frames"), min_frames=data.get("min_frames"),
                          video_min_pixels=stated["min_pixels"], video_max_pixels=stated["max_pixels"])
            kind = data.get("video_processor_type")
            if kind is not None:
                if kind not in VIDEO_PIXELS_PER:
                    raise ProcessorError(f"{path}: video_processor_type {kind!r} is not supported; known: "
                                         f"{', '.join(VIDEO_PIXELS_PER)}")
                found["video_pixels_per"] = (VIDEO_PIXELS_PER[kind], name)
        for key in ("image_mean", "image_std"):
            if data.get(key) is not None and key not in found:
                found[key] = (_check_channels(key, data[key], path), name)
        for key, value in stated.items():
            if value is None or key in found:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ProcessorError(f"{path}: {key} must be a positive number, got {value!r}")
            found[key] = (float(value) if key == "fps" else int(value), name)
    if not any(role == "video" for role, *_ in configs):
        # No video processor: transformers builds it from the image processor's file, bounds included.
        for key in ("min_pixels", "max_pixels"):
            if key in found:
                found[f"video_{key}"] = found[key]
    return found


def processor_configs(directory: str | Path) -> list[tuple[str, dict, str, str]]:
    """(role, settings, source name, path for messages) of the checkpoint's image then video processor,
    found where transformers looks: the `image_processor`/`video_processor` entry of
    `processor_config.json` (what transformers 5 saves), else the legacy `preprocessor_config.json`
    / `video_preprocessor_config.json` (what hub checkpoints ship)."""
    directory = Path(directory)
    nested = _read_json(directory / PROCESSOR_FILE) if (directory / PROCESSOR_FILE).is_file() else {}
    found = []
    for role, legacy in (("image", IMAGE_PROCESSOR_FILE), ("video", VIDEO_PROCESSOR_FILE)):
        entry = f"{role}_processor"
        if isinstance(nested.get(entry), dict):
            found.append((role, nested[entry], f"{PROCESSOR_FILE} ({entry})", f"{directory / PROCESSOR_FILE} ({entry})"))
        elif (directory / legacy).is_file():
            found.append((role, _read_json(directory / legacy), legacy, str(directory / legacy)))
    return found


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProcessorError(f"{path}: not a JSON processor config ({error})") from None
    if not isinstance(data, dict):
        raise ProcessorError(f"{path}: a processor config is a JSON object, got {type(data).__name__}")
    return data


def resolve_media_kwargs(config_values: Mapping, base_model_dir: str | Path | None) -> tuple[dict, dict[str, str]]:
    """Every media_kwargs key with where its value came from ("config", a processor file of the base
    model, or SMOKE_DEFAULT). A value set in the config (not None) wins; then, with a base model, its
    processor files; the smoke default fills what a model trained from scratch, or a base model
    without those settings (e.g. a text model), leaves open: the sources say which, and the run logs them."""
    unknown = set(config_values) - set(MEDIA_DEFAULTS)
    if unknown:
        raise ProcessorError(f"media_kwargs: unknown keys {sorted(unknown)}; known: {sorted(MEDIA_DEFAULTS)}")
    stated = processor_media_kwargs(base_model_dir) if base_model_dir is not None else {}
    values, sources = {}, {}
    for key, default in MEDIA_DEFAULTS.items():
        if config_values.get(key) is not None:
            values[key], sources[key] = config_values[key], "config"
        elif key in stated:
            values[key], sources[key] = stated[key]
        else:
            values[key], sources[key] = default, SMOKE_DEFAULT
    for low, high in (("min_pixels", "max_pixels"), ("min_frames", "max_frames"),
                      ("video_min_pixels", "video_max_pixels")):
        if values[low] > values[high]:
            raise ProcessorError(f"media_kwargs: {low}={values[low]} ({sources[low]}) exceeds "
                                 f"{high}={values[high]} ({sources[high]})")
    return values, sources


def _refuse_unhonoured(data: Mapping, path: str) -> None:
    for key, wanted in FIXED_SETTINGS.items():
        if data.get(key) is not None and data[key] != wanted:  # null: the class default, which is this
            raise ProcessorError(f"{path}: {key}={data[key]!r} is not supported (this processor always uses "
                                 f"{key}={wanted!r}, as the Qwen-VL processors do)")
    factor = data.get("rescale_factor")
    if factor is not None and not math.isclose(factor, RESCALE_FACTOR, rel_tol=1e-9):
        raise ProcessorError(f"{path}: rescale_factor={factor!r} is not supported (only 1/255)")
    if data.get("cap_pixels_per_frame"):
        # transformers' per-frame cap (an even share of max_video_tokens) is not implemented here.
        raise ProcessorError(f"{path}: cap_pixels_per_frame=true is not supported; set it false or remove it")
    size = data.get("size")
    if size is not None and (not isinstance(size, dict) or set(size) - {"shortest_edge", "longest_edge", "min_pixels", "max_pixels"}):
        # (size.min/max_pixels: older Qwen2-VL files; transformers drops them for the top-level keys)
        raise ProcessorError(f"{path}: size={size!r} is not supported; the Qwen-VL processors state pixel areas "
                             "as size.shortest_edge / size.longest_edge (or min_pixels / max_pixels)")


def processor_geometry(directory: str | Path) -> dict[str, tuple[int, str]]:
    """patch_size, temporal_patch_size and merge_size as the checkpoint's processor files state them
    (image file first), each with its file. They belong to the model, not to media_kwargs."""
    found: dict[str, tuple[int, str]] = {}
    for _, data, name, path in processor_configs(directory):
        for key in GEOMETRY_KEYS:
            value = data.get(key)
            if value is None or key in found:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ProcessorError(f"{path}: {key} must be a positive integer, got {value!r}")
            found[key] = (value, name)
    return found


def check_processor_geometry(vision: VisionConfig, directory: str | Path) -> None:
    """Refuse a checkpoint whose processor cuts patches other than its vision tower reads them."""
    for key, (value, name) in processor_geometry(directory).items():
        if getattr(vision, key) != value:
            raise ProcessorError(f"{Path(directory) / name}: {key}={value} but the model's vision config has "
                                 f"{key}={getattr(vision, key)}; the processor and the vision tower must agree")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    if min(height, width) <= 0 or max(height, width) / min(height, width) > 200:
        raise ProcessorError(f"image {width}x{height}: aspect ratio beyond 200 or empty")
    # No floor at `factor` here (HF has none): a side rounding to 0 sends the image to the min_pixels
    # branch below, which sizes both sides from the original aspect.
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def smart_resize_clip(frames: int, height: int, width: int, factor: int, temporal_factor: int, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video smart_resize: the bounds hold frames × height × width (frames rounded to
    temporal_factor), and a side shorter than `factor` is first scaled up to it."""
    if frames < temporal_factor:
        raise ProcessorError(f"a clip of {frames} frame(s) is shorter than temporal_patch_size {temporal_factor} "
                             "(Qwen3-VL's video processor refuses it too): raise media_kwargs.min_frames")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ProcessorError(f"video {width}x{height}: aspect ratio beyond 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / temporal_factor) * temporal_factor
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as HF's `convert_to_rgb`: transparency is composited onto white (a plain convert("RGB")
    would drop alpha and show whatever colour the transparent pixels hold)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def process_frames(frames: list[Image.Image], vision: VisionConfig, media_kwargs: Mapping,
                   video: bool = False) -> ProcessedMedia:
    """`video`: the frames are a whole clip (a `video` item), sized by the video_* bounds, as HF's
    video processor sizes them; otherwise an image (or one frame of a video) with the image bounds."""
    settings = media_settings(media_kwargs)
    p, m, tp = vision.patch_size, vision.merge_size, vision.temporal_patch_size
    width, height = frames[0].size
    if not video:
        h, w = smart_resize(height, width, p * m, int(settings["min_pixels"]), int(settings["max_pixels"]))
    elif settings["video_pixels_per"] == "clip":
        h, w = smart_resize_clip(len(frames), height, width, p * m, tp, int(settings["video_min_pixels"]),
                                 int(settings["video_max_pixels"]))
    else:
        h, w = smart_resize(height, width, p * m, int(settings["video_min_pixels"]), int(settings["video_max_pixels"]))
    # Exactly HF's PIL backend: uint8 resize, rescale in float64 → float32, normalise in float32.
    pixels = np.stack([np.asarray(to_rgb(f).resize((w, h), Image.BICUBIC)) for f in frames])
    pixels = (pixels.astype(np.float64) * RESCALE_FACTOR).astype(np.float32)
    pixels = (pixels - np.asarray(settings["image_mean"], np.float32)) / np.asarray(settings["image_std"], np.float32)
    # An image is repeated to fill one temporal patch; a video's last frame pads its final one.
    pad = (-len(pixels)) % tp
    pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)]) if pad else pixels
    gt, gh, gw = len(pixels) // tp, h // p, w // p
    # [gt, tp, gh/m, m, p, gw/m, m, p, C] → windows of m×m patches in row-major window order, each
    # patch flattened as (C, t, p, p) like HF's.
    grid = pixels.reshape(gt, tp, gh // m, m, p, gw // m, m, p, 3)
    patches = grid.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7).reshape(gt * gh * gw, 3 * tp * p * p)
    t, bh, bw, ih, iw = np.meshgrid(np.arange(gt), np.arange(gh // m), np.arange(gw // m), np.arange(m),
                                    np.arange(m), indexing="ij")
    positions = np.stack([t, bh * m + ih, bw * m + iw], axis=-1).reshape(-1, 3).astype(np.int32)
    return ProcessedMedia(patches.astype(np.float32), positions, (gt, gh, gw))


def tokens_of(media: ProcessedMedia, vision: VisionConfig) -> int:
    """Text tokens the media fills after the merger."""
    return media.num_tokens // (vision.merge_size ** 2)


def media_kwargs_of(config, vision: VisionConfig | None = None) -> tuple[dict, dict[str, str]]:
    """`resolve_media_kwargs` for a training config: `config.media_kwargs` over the processor
    settings of `config.model.init_from` (a directory or hub name), when the run starts from one.
    With the run's `vision` config, the base model's processor must also cut patches as it reads them."""
    base = None
    if config.model.init_from:
        base = hf_common.resolve(config.model.init_from)
        if vision is not None:
            check_processor_geometry(vision, base)
    return resolve_media_kwargs(config.media_kwargs.to_dict(), base)
