"""Our image/video preprocessing equals the HF processor of the checkpoint (issue 13, "Processor parity").

Reference: transformers 5.24's `Qwen2VLImageProcessorPil`, built locally from explicit kwargs and
saved with `save_pretrained`, so our side is driven by the checkpoint's own
`preprocessor_config.json`. It is the Pillow backend; the `Qwen2VLImageProcessor` class (and every
Qwen-VL video processor) is the torchvision backend, and torchvision is not installed here (no
wheel matching torch 2.13.0+cpu): AutoImageProcessor gives the Pillow one in this environment.
Qwen2.5-VL has no processor of its own (it uses Qwen2-VL's), Qwen3-VL uses the same class with
patch_size 16 and mean/std 0.5. Media are random uint8 pixels, so resampling errors would show.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from valen_jax.data.vision_processor import (
    ProcessorError,
    check_processor_geometry,
    process_frames,
    processor_media_kwargs,
    resolve_media_kwargs,
)
from valen_jax.models.config import VisionConfig

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# (name, HF processor kwargs as the family's checkpoint states them, small pixel bounds to keep it quick)
FAMILIES = {
    "qwen2_vl": dict(patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                     min_pixels=56 * 56, max_pixels=28 * 28 * 64),
    "qwen3_vl": dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                     size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 64}),
}
# height × width: tiny (upscaled to min_pixels), very wide, very tall, one far above max_pixels,
# and an ordinary one inside the bounds.
SIZES = [(7, 5), (40, 900), (700, 33), (1200, 1600), (150, 220)]


def _image(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8))


def _checkpoint(family: str, tmp_path, **overrides):
    processor = Qwen2VLImageProcessorPil(**{**FAMILIES[family], **overrides})
    processor.save_pretrained(tmp_path)
    media_kwargs, _ = resolve_media_kwargs({}, tmp_path)
    vision = VisionConfig(patch_size=processor.patch_size, merge_size=processor.merge_size,
                          temporal_patch_size=processor.temporal_patch_size, dim=8, num_layers=1, num_heads=1,
                          mlp_dim=8)
    check_processor_geometry(vision, tmp_path)
    return processor, vision, media_kwargs


def test_smart_resize_equals_hf_over_sizes_factors_and_bounds():
    """Grid sizes equal HF's `smart_resize` on 1,512 cases: sides 1..3000 (aspect <= 200), factors
    8, 28, 32, tiny and real pixel bounds (small images hit the min_pixels branch from a side that
    rounds to 0)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    from valen_jax.data.vision_processor import smart_resize

    checked = 0
    sides = (1, 3, 7, 13, 20, 28, 50, 99, 224, 640, 1000, 3000)
    for height in sides:
        for width in sides:
            if max(height, width) / min(height, width) > 200:
                continue
            for factor in (8, 28, 32):
                for low, high in ((16, 256), (56 * 56, 28 * 28 * 1280), (1024, 4096), (factor ** 2, factor ** 2 * 4)):
                    args = (height, width, factor, low, high)
                    assert smart_resize(*args) == hf_smart_resize(*args), args
                    checked += 1
    assert checked == 1512


def test_clip_smart_resize_equals_qwen3_vl_over_sizes_and_bounds():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_clip_resize

    from valen_jax.data.vision_processor import smart_resize_clip

    checked = 0
    sides = (1, 7, 20, 33, 99, 640, 3000)
    for frames in (2, 3, 8, 31):
        for height in sides:
            for width in sides:
                if max(height, width) / min(height, width) > 100:
                    continue
                for low, high in ((4 * 32 * 32, 32 * 32 * 40), (128 * 32 * 32, 32 * 32 * 768)):
                    ours = smart_resize_clip(frames, height, width, 32, 2, low, high)
                    theirs = hf_clip_resize(frames, height, width, temporal_factor=2, factor=32, min_pixels=low,
                                            max_pixels=high)
                    assert ours == theirs, (frames, height, width, low, high)
                    checked += 1
    assert checked > 300


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_images_equal_the_hf_processor(family, tmp_path):
    processor, vision, media_kwargs = _checkpoint(family, tmp_path)
    for i, (height, width) in enumerate(SIZES):
        image = _image(height, width, i)
        theirs = processor(images=[image], return_tensors="np")
        ours = process_frames([image], vision, media_kwargs)
        assert ours.grid == tuple(theirs["image_grid_thw"][0]), (height, width)
        assert ours.patches.shape == theirs["pixel_values"].shape
        np.testing.assert_allclose(ours.patches, theirs["pixel_values"], rtol=0, atol=1e-6, err_msg=f"{height}x{width}")


def test_min_max_pixels_overrides_equal_the_hf_processor(tmp_path):
    # The checkpoint's bounds replaced by media_kwargs on our side and by the same kwargs on theirs.
    processor, vision, media_kwargs = _checkpoint("qwen2_vl", tmp_path)
    override = {"min_pixels": 28 * 28 * 9, "max_pixels": 28 * 28 * 20}
    theirs_processor = Qwen2VLImageProcessorPil(**{**FAMILIES["qwen2_vl"], **override})
    mine = {**media_kwargs, **override}
    for i, (height, width) in enumerate(SIZES):
        image = _image(height, width, 10 + i)
        theirs = theirs_processor(images=[image], return_tensors="np")
        ours = process_frames([image], vision, mine)
        assert ours.grid == tuple(theirs["image_grid_thw"][0])
        np.testing.assert_allclose(ours.patches, theirs["pixel_values"], rtol=0, atol=1e-6)
    # The override really changed the grid of the big image.
    big = _image(1200, 1600, 0)
    assert process_frames([big], vision, mine).grid != process_frames([big], vision, media_kwargs).grid


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_short_video_equals_hf_per_frame_numerics_in_hf_temporal_layout(family, tmp_path):
    """Five frames → three temporal patches, the last padded with the last frame (HF's video patchify).

    The video processors need torchvision, absent here, so the reference is assembled from HF's
    image processor: each frame processed alone gives its (C, t, p, p) patches with the frame
    repeated over t; the clip's patch takes frame 2k at t=0 and frame 2k+1 at t=1, exactly the
    `view(gt, tp, C, …).permute(…)` of `Qwen2VLVideoProcessor.patchify`."""
    processor, vision, media_kwargs = _checkpoint(family, tmp_path)
    frames = [_image(90, 160, 100 + i) for i in range(5)]
    # No video processor saved: video bounds are the image ones, per frame (Qwen2-VL's video rule).
    assert media_kwargs["video_pixels_per"] == "frame"
    ours = process_frames(frames, vision, media_kwargs, video=True)
    per_frame = [processor(images=[f], return_tensors="np") for f in frames + frames[-1:]]
    tp, p = vision.temporal_patch_size, vision.patch_size
    grid = tuple(per_frame[0]["image_grid_thw"][0])
    slots = [r["pixel_values"].reshape(-1, 3, tp, p, p)[:, :, 0] for r in per_frame]  # [N, C, p, p] per frame
    clip = np.stack([np.stack(slots[k * tp:(k + 1) * tp], axis=2) for k in range(len(slots) // tp)])
    expected = clip.reshape(-1, 3 * tp * p * p)
    assert ours.grid == (3, grid[1], grid[2])
    np.testing.assert_allclose(ours.patches, expected, rtol=0, atol=1e-6)


def test_transparency_is_composited_on_white_like_hf(tmp_path):
    processor, vision, media_kwargs = _checkpoint("qwen2_vl", tmp_path)
    rgba = np.random.default_rng(7).integers(0, 256, (60, 80, 4), np.uint8)
    rgba[:20, :, 3] = 0  # fully transparent band over coloured pixels
    palette = Image.fromarray(rgba[..., :3]).convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = 0
    for image in (Image.fromarray(rgba, "RGBA"), palette, Image.fromarray(rgba[..., 0], "L")):
        theirs = processor(images=[image], return_tensors="np")
        ours = process_frames([image], vision, media_kwargs)
        np.testing.assert_allclose(ours.patches, theirs["pixel_values"], rtol=0, atol=1e-6, err_msg=image.mode)


@pytest.mark.parametrize("frames,height,width", [(6, 90, 160), (4, 12, 300), (9, 720, 1280), (2, 33, 33)])
def test_qwen3_vl_clip_bounds_equal_its_video_processor(frames, height, width, tmp_path):
    """Qwen3-VL bounds frames × height × width: the grid equals `Qwen3VLVideoProcessor`'s own
    `get_num_of_video_patches` and its `smart_resize`; pixels are HF's PIL resize, rescale and
    normalise at that size, stacked over t as its patchify does (its torch resize needs torchvision)."""
    import json

    from transformers.image_transforms import normalize, rescale, resize
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

    hf = Qwen3VLVideoProcessor(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 32 * 32 * 40})
    processor, vision, _ = _checkpoint("qwen3_vl", tmp_path)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(hf.to_dict()))
    media_kwargs, sources = resolve_media_kwargs({}, tmp_path)
    assert (media_kwargs["video_pixels_per"], media_kwargs["video_max_pixels"]) == ("clip", 32 * 32 * 40)
    clip = [_image(height, width, 200 + i) for i in range(frames)]
    ours = process_frames(clip, vision, media_kwargs, video=True)
    h, w = smart_resize(frames, height, width, temporal_factor=2, factor=32, min_pixels=4 * 32 * 32,
                        max_pixels=32 * 32 * 40)
    assert ours.grid == (-(-frames // 2), h // 16, w // 16)
    assert len(ours.patches) == hf.get_num_of_video_patches(frames, height, width)
    mean, std = hf.image_mean, hf.image_std
    planes = [normalize(rescale(resize(np.asarray(f).transpose(2, 0, 1), (h, w), resample=3), 1 / 255), mean, std)
              for f in clip + clip[-1:] * (frames % 2)]  # [C, h, w] per frame, the last repeated to fill t
    video = np.stack(planes).reshape(-1, 2, 3, h // 32, 2, 16, w // 32, 2, 16)
    expected = video.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(len(ours.patches), -1)  # HF's permute
    np.testing.assert_allclose(ours.patches, expected, rtol=0, atol=1e-6)


def test_frame_sampling_equals_qwen3_vl_video_processor():
    """`sample_video_indices` against `Qwen3VLVideoProcessor.sample_frames` itself (numpy only: it
    runs without torchvision), over clip lengths, source rates and settings, including clips too
    short for fps (min_frames) and too long (max_frames)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from valen_jax.data.media import sample_video_indices

    checked = 0
    for min_frames, max_frames in ((4, 768), (1, 8), (2, 3)):
        hf = Qwen3VLVideoProcessor(min_frames=min_frames, max_frames=max_frames)
        for total in (1, 2, 3, 7, 45, 120, 301, 2000):
            for video_fps in (23.976, 25.0, 30.0, 60.0):
                for fps in (0.5, 1.0, 2.0, 4.0):
                    theirs = hf.sample_frames(VideoMetadata(total_num_frames=total, fps=video_fps), fps=fps)
                    ours = sample_video_indices(total, video_fps, fps, min_frames, max_frames)
                    assert ours.tolist() == np.asarray(theirs).tolist(), (total, video_fps, fps, min_frames, max_frames)
                    checked += 1
    assert checked == 384


def test_transformers_5_nested_processor_config_is_read_first(tmp_path):
    """transformers 5 saves a processor's settings nested in processor_config.json and reads them
    before the legacy files; so do we (a stale legacy file beside it is ignored, as there)."""
    import json

    processor = Qwen2VLImageProcessorPil(**FAMILIES["qwen3_vl"])
    nested = {"image_processor": processor.to_dict(),
              "video_processor": {"fps": 1.0, "min_frames": 2, "max_frames": 6, "patch_size": 16, "resample": 3}}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 1, "max_pixels": 2, "patch_size": 14}))
    values, sources = resolve_media_kwargs({}, tmp_path)
    assert values == {"min_pixels": 64 * 64, "max_pixels": 32 * 32 * 64, "fps": 1.0, "max_frames": 6, "min_frames": 2,
                      "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5), "video_min_pixels": 32 * 32,
                      "video_max_pixels": 64 * 64, "video_pixels_per": "frame"}  # the video entry states no bounds
    assert sources["min_pixels"] == "processor_config.json (image_processor)"
    assert sources["fps"] == "processor_config.json (video_processor)"
    vision = VisionConfig(patch_size=16, merge_size=2, temporal_patch_size=2, dim=8, num_layers=1, num_heads=1, mlp_dim=8)
    check_processor_geometry(vision, tmp_path)
    image = _image(300, 200, 5)
    ours = process_frames([image], vision, values)
    np.testing.assert_array_equal(ours.patches, processor(images=[image], return_tensors="np")["pixel_values"])
    nested["video_processor"]["do_rescale"] = False
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    with pytest.raises(ProcessorError, match=r"processor_config.json \(video_processor\): do_rescale=False is not"):
        resolve_media_kwargs({}, tmp_path)


def test_checkpoint_settings_we_cannot_honour_are_refused(tmp_path):
    import json

    _checkpoint("qwen2_vl", tmp_path / "ok")
    Qwen2VLImageProcessorPil(**FAMILIES["qwen2_vl"], resample=2).save_pretrained(tmp_path / "bilinear")
    with pytest.raises(ProcessorError, match="preprocessor_config.json: resample=2 is not supported"):
        processor_media_kwargs(tmp_path / "bilinear")
    Qwen2VLImageProcessorPil(**FAMILIES["qwen2_vl"], do_normalize=False).save_pretrained(tmp_path / "raw")
    with pytest.raises(ProcessorError, match="do_normalize=False is not supported"):
        processor_media_kwargs(tmp_path / "raw")
    for name, setting, message in (("cap", {"cap_pixels_per_frame": True}, "cap_pixels_per_frame=true is not"),
                                   ("fixed", {"size": {"height": 224, "width": 224}}, "size=.*is not supported")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "video_preprocessor_config.json").write_text(json.dumps(setting))
        with pytest.raises(ProcessorError, match=f"{name}/video_preprocessor_config.json: {message}"):
            processor_media_kwargs(tmp_path / name)
    wrong = VisionConfig(patch_size=16, merge_size=2, temporal_patch_size=2, dim=8, num_layers=1, num_heads=1,
                         mlp_dim=8)
    with pytest.raises(ProcessorError, match="patch_size=14 but the model's vision config has patch_size=16"):
        check_processor_geometry(wrong, tmp_path / "ok")
