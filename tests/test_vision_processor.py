"""Variable-grid vision processing and the encoder that consumes it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from valen_jax.data.vision_processor import (
    ProcessorError,
    media_settings,
    process_frames,
    smart_resize,
    tokens_of,
)
from valen_jax.models.config import VisionConfig
from valen_jax.models.vision import VisionEncoder

VISION = VisionConfig(patch_size=4, merge_size=2, temporal_patch_size=2, dim=16, num_layers=1, num_heads=2,
                      mlp_dim=32)


def test_smart_resize_keeps_aspect_within_pixel_bounds():
    assert smart_resize(128, 128, 16, 32 * 32, 64 * 64) == (64, 64)
    assert smart_resize(100, 200, 16, 32 * 32, 64 * 64) == (32, 80)
    h, w = smart_resize(10, 10, 16, 32 * 32, 64 * 64)
    assert (h, w) == (32, 32)
    for height, width in ((480, 640), (37, 333), (1000, 90)):
        h, w = smart_resize(height, width, 16, 32 * 32, 96 * 96)
        assert h % 16 == 0 and w % 16 == 0 and 32 * 32 <= h * w <= 96 * 96
    with pytest.raises(ProcessorError, match="aspect ratio"):
        smart_resize(1, 500, 16, 32 * 32, 64 * 64)


def test_patches_are_ordered_in_merge_windows():
    pixels = np.zeros((16, 24, 3), np.uint8)
    pixels[:, :, 0] = np.arange(24)[None, :] * 10  # red encodes the column
    pixels[:, :, 1] = np.arange(16)[:, None] * 10  # green encodes the row
    media = process_frames([Image.fromarray(pixels)], VISION, {"min_pixels": 16, "max_pixels": 16 * 24})
    assert media.grid == (1, 4, 6) and tokens_of(media, VISION) == 6
    # The first merge window holds the patches at (0,0), (0,1), (1,0), (1,1).
    assert media.positions[:4].tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    assert media.positions[4:8].tolist() == [[0, 0, 2], [0, 0, 3], [0, 1, 2], [0, 1, 3]]
    # Patch content, flattened (C, t, p, p) like HF's: first pixel of the patch at (h=1, w=1) is
    # row 4, column 4; the smoke mean/std 0.5 map [0, 255] to [-1, 1].
    first = media.patches[3].reshape(3, 2, 4, 4)[:, 0, 0, 0]
    np.testing.assert_allclose((first + 1) * 127.5, [40, 40, 0], atol=1e-3)


def test_a_clip_pads_its_last_temporal_patch_and_an_image_fills_one():
    frames = [Image.new("RGB", (16, 16), (i * 40, 0, 0)) for i in range(3)]
    clip = process_frames(frames, VISION, {"min_pixels": 16, "max_pixels": 16 * 16})
    assert clip.grid == (2, 4, 4) and clip.positions[:, 0].max() == 1
    image = process_frames(frames[:1], VISION, {"min_pixels": 16, "max_pixels": 16 * 16})
    assert image.grid == (1, 4, 4)
    with pytest.raises(ProcessorError, match="unknown keys"):
        process_frames(frames[:1], VISION, {"image_size": 64})


@pytest.mark.slow
def test_encoder_keeps_media_items_apart_and_merges_windows():
    encoder = VisionEncoder(VISION, 24, "float32", "float32", nnx.Rngs(0))
    a = process_frames([Image.new("RGB", (16, 16), (200, 10, 10))], VISION, {"min_pixels": 16, "max_pixels": 256})
    b = process_frames([Image.new("RGB", (16, 8), (10, 200, 10))], VISION, {"min_pixels": 16, "max_pixels": 256})
    patches = np.concatenate([a.patches, b.patches])[None]
    positions = np.concatenate([a.positions, b.positions])[None]
    segments = np.concatenate([np.full(len(a.patches), 1), np.full(len(b.patches), 2)])[None]
    together = np.asarray(encoder(jnp.asarray(patches), jnp.asarray(positions), jnp.asarray(segments)))
    alone = np.asarray(encoder(jnp.asarray(a.patches[None]), jnp.asarray(a.positions[None]),
                               jnp.ones((1, len(a.patches)), jnp.int32)))
    assert together.shape == (1, (len(a.patches) + len(b.patches)) // 4, 24)
    np.testing.assert_allclose(together[:, : alone.shape[1]], alone, atol=1e-5)


# --- media_kwargs defaults: the base model's processor files, else the smoke defaults (seed 000) ---

def _write_processor(directory, image: dict | None = None, video: dict | None = None):
    import json

    directory.mkdir(parents=True, exist_ok=True)
    if image is not None:
        (directory / "preprocessor_config.json").write_text(json.dumps(image))
    if video is not None:
        (directory / "video_preprocessor_config.json").write_text(json.dumps(video))
    return directory


def test_base_model_processor_files_give_the_media_defaults(tmp_path):
    from valen_jax.data.vision_processor import processor_media_kwargs, resolve_media_kwargs

    # Qwen2-VL writes min/max_pixels; newer processors the same areas as size.shortest/longest_edge.
    qwen2 = _write_processor(tmp_path / "qwen2", {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14})
    qwen3 = _write_processor(tmp_path / "qwen3", {"size": {"shortest_edge": 65536, "longest_edge": 16777216},
                                                  "image_mean": [0.5, 0.5, 0.5]},
                             {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 2,
                              "max_frames": 768, "min_frames": 4, "image_std": [0.25, 0.5, 0.5]})
    # No video processor file: transformers builds the video processor from the image one, bounds included.
    assert processor_media_kwargs(qwen2) == {"min_pixels": (3136, "preprocessor_config.json"),
                                             "max_pixels": (12845056, "preprocessor_config.json"),
                                             "video_min_pixels": (3136, "preprocessor_config.json"),
                                             "video_max_pixels": (12845056, "preprocessor_config.json")}
    values, sources = resolve_media_kwargs({"min_pixels": None, "max_pixels": None, "fps": None, "max_frames": 5},
                                           qwen3)
    # Images take the image file's pixel bounds, whole clips the video file's; the config wins over both.
    # mean/std likewise: the video file fills what the image file does not state.
    assert values == {"min_pixels": 65536, "max_pixels": 16777216, "fps": 2.0, "max_frames": 5, "min_frames": 4,
                      "image_mean": (0.5, 0.5, 0.5), "image_std": (0.25, 0.5, 0.5), "video_min_pixels": 4096,
                      "video_max_pixels": 25165824, "video_pixels_per": "frame"}
    assert sources == {"min_pixels": "preprocessor_config.json", "max_pixels": "preprocessor_config.json",
                       "fps": "video_preprocessor_config.json", "max_frames": "config",
                       "min_frames": "video_preprocessor_config.json", "image_mean": "preprocessor_config.json",
                       "video_min_pixels": "video_preprocessor_config.json",
                       "video_max_pixels": "video_preprocessor_config.json", "video_pixels_per": "smoke default",
                       "image_std": "video_preprocessor_config.json"}
    # What the base model does not state (Qwen2-VL has no video file) keeps the smoke default, said so.
    values, sources = resolve_media_kwargs({}, qwen2)
    assert (values["fps"], sources["fps"], values["max_frames"]) == (2.0, "smoke default", 8)


def test_from_scratch_the_smoke_defaults_and_refusals(tmp_path):
    from valen_jax.data.vision_processor import MEDIA_DEFAULTS, resolve_media_kwargs

    values, sources = resolve_media_kwargs({"max_pixels": None}, None)
    assert values == MEDIA_DEFAULTS and set(sources.values()) == {"smoke default"}
    with pytest.raises(ProcessorError, match="unknown keys"):
        resolve_media_kwargs({"pixels": 3}, None)
    with pytest.raises(ProcessorError, match="min_pixels=9000 .config. exceeds max_pixels=4096"):
        resolve_media_kwargs({"min_pixels": 9000}, None)
    with pytest.raises(ProcessorError, match="min_frames=9 .config. exceeds max_frames=8 .smoke default."):
        resolve_media_kwargs({"min_frames": 9}, None)
    bad = _write_processor(tmp_path / "bad", {"max_pixels": "many"})
    with pytest.raises(ProcessorError, match="preprocessor_config.json: max_pixels must be a positive number"):
        resolve_media_kwargs({}, bad)
    zero_std = _write_processor(tmp_path / "std", {"image_std": [0.5, 0, 0.5]})
    with pytest.raises(ProcessorError, match="std/preprocessor_config.json: image_std must be three numbers .RGB., all > 0"):
        resolve_media_kwargs({}, zero_std)
    with pytest.raises(ProcessorError, match="media_kwargs: image_mean must be three numbers"):
        media_settings({"image_mean": (0.5, 0.5)})


def test_training_config_media_kwargs_resolve_against_init_from(tmp_path):
    from configs import vflash
    from valen_jax.data.vision_processor import MEDIA_DEFAULTS, media_kwargs_of

    config = vflash.get_config("tiny")
    assert set(config.media_kwargs.to_dict().values()) == {None}  # nothing decided before start-up
    assert media_kwargs_of(config)[0] == MEDIA_DEFAULTS
    config.model.init_from = str(_write_processor(tmp_path / "base", {"min_pixels": 256, "max_pixels": 1024},
                                                  {"fps": 1.5, "max_frames": 6}))
    config.media_kwargs.max_frames = 3
    assert media_kwargs_of(config) == ({"min_pixels": 256, "max_pixels": 1024, "fps": 1.5, "max_frames": 3,
                                        "min_frames": 1, "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5),
                                        "video_min_pixels": 1024, "video_max_pixels": 4096,
                                        "video_pixels_per": "frame"}, {
        "min_pixels": "preprocessor_config.json", "max_pixels": "preprocessor_config.json",
        "fps": "video_preprocessor_config.json", "max_frames": "config", "min_frames": "smoke default",
        "image_mean": "smoke default", "image_std": "smoke default", "video_min_pixels": "smoke default",
        "video_max_pixels": "smoke default", "video_pixels_per": "smoke default"})
    # The run's vision tower must read patches as the base model's processor cuts them.
    from valen_jax.models.config import VisionConfig

    vision = VisionConfig(**{**config.model.vision.to_dict(), "patch_size": 14})
    config.model.init_from = str(_write_processor(tmp_path / "p16", {"patch_size": 16}))
    with pytest.raises(ProcessorError, match="p16/preprocessor_config.json: patch_size=16 but the model's vision"):
        media_kwargs_of(config, vision)
    assert media_kwargs_of(config)[1]["min_pixels"] == "smoke default"  # without a vision config: not checked
