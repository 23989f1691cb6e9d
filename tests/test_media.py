"""Media decoding (images, video frames, whole videos, LMDB values), augmentation and the media log."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from fractions import Fraction
from pathlib import Path

import av
import lmdb
import numpy as np
import pytest
from PIL import Image

from data_pipeline.render.lmdb_media import LmdbMediaError, close_all, read_lmdb_value
from data_pipeline.shards import Example
from valen_jax.data.assemble import RowSpec, expand_media_slots
from valen_jax.data.augment import (
    RESCALE_RANGE,
    AugmentError,
    EntryMedia,
    SampleAug,
    augment_frames,
    draw_sample_aug,
    example_rng,
)
from valen_jax.data.media import MediaError, VideoReader, load_frames, sample_video_indices
from valen_jax.data.media_log import MediaLog, merge_media_logs, read_media_log
from valen_jax.data.visual_ops import OPS, apply_op
from valen_jax.models.config import VisionConfig

KWARGS = {"min_pixels": 16 * 16, "max_pixels": 64 * 64, "fps": 2.0, "max_frames": 8, "min_frames": 1}
RATE = 30
VISION = VisionConfig(patch_size=4, merge_size=2, temporal_patch_size=2, dim=16, num_layers=1, num_heads=2,
                      mlp_dim=32)
ALL_OPS = ["motion_blur", "gaussian_blur", "zoom_blur", "fog", "glass_blur", "light"]


def textured(width: int = 64, height: int = 48, seed: int = 0) -> Image.Image:
    """Mid-range noise over a gradient: every op visibly changes it (no saturated or flat areas)."""
    rng = np.random.default_rng(seed)
    base = np.linspace(60, 190, width)[None, :, None] + rng.uniform(-40, 40, (height, width, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def index_frame(index: int, width: int = 64, height: int = 48) -> np.ndarray:
    """A frame whose top strip writes `index` in binary, eight 8-px blocks: survives compression."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[16:] = np.linspace(40, 200, width, dtype=np.uint8)[None, :, None]
    for bit in range(8):
        if (index >> bit) & 1:
            pixels[:16, bit * 8:(bit + 1) * 8] = 255
    return pixels


def read_index(image: Image.Image) -> int:
    strip = np.asarray(image.convert("RGB"), np.float32)[:16]
    return sum(1 << bit for bit in range(8) if strip[:, bit * 8:(bit + 1) * 8].mean() > 128)


def make_mp4(path: Path, frames: int = 120, gop: int = 12) -> bytes:
    """H.264 with B-frames and a keyframe every `gop` frames: presentation order ≠ decode order,
    and a far frame needs a keyframe seek. Deterministic: fixed content and encoder options."""
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=RATE)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.gop_size = gop
        stream.codec_context.options = {"bf": "2", "preset": "ultrafast", "threads": "1"}
        for index in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(index_frame(index), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path.read_bytes()


@pytest.fixture(scope="module")
def mp4(tmp_path_factory) -> bytes:
    return make_mp4(tmp_path_factory.mktemp("video") / "clip.mp4")


def frame_header(index: int, **extra) -> dict:
    return {"kind": "video_frame", "path": "clip.mp4", "sha256": "x", "frame_index": index, "resize": None, **extra}


IMAGE_HEADER = {"kind": "path", "path": "a.png", "sha256": "x", "frame_index": None, "resize": None}


def aug_entry(ops=None, prob=1.0, severity=(1, 10), views="all", data_augment=False, zoom=None) -> EntryMedia:
    spec = {"prob": prob, "views": views, "ops": ops or ALL_OPS, "severity": list(severity), "zoom_max_severity": zoom}
    return EntryMedia.from_manifest_entry({"name": "demo", "data_augment": data_augment, "visual_aug": spec})


# --- decoding ------------------------------------------------------------------------------------

def test_png_decodes_to_rgb_without_frame_info():
    image = Image.new("RGBA", (10, 7), (10, 20, 30, 255))
    loaded = load_frames(png_bytes(image), IMAGE_HEADER, KWARGS, "a.jsonl:1")
    assert [f.mode for f in loaded.frames] == ["RGB"] and loaded.frames[0].size == (10, 7)
    assert (loaded.frame_indices, loaded.timestamps, loaded.augment) == ((), (), None)
    with pytest.raises(MediaError, match="a.jsonl:1: cannot decode a.png"):
        load_frames(b"not an image", IMAGE_HEADER, KWARGS, "a.jsonl:1")
    with pytest.raises(MediaError, match="unknown media kind 'audio'"):
        load_frames(b"", {**IMAGE_HEADER, "kind": "audio"}, KWARGS, "a.jsonl:1")


def test_resize_is_an_exact_stretch_of_every_frame(mp4):
    image = textured(40, 30)
    loaded = load_frames(png_bytes(image), {**IMAGE_HEADER, "resize": [17, 50]}, KWARGS, "w")
    assert loaded.frames[0].size == (17, 50)  # aspect not kept: an exact stretch (seed 004)
    assert np.array_equal(np.asarray(loaded.frames[0]), np.asarray(image.resize((17, 50), Image.BICUBIC)))
    video = load_frames(mp4, {"kind": "video", "path": "c", "resize": [20, 10]}, KWARGS, "w")
    assert {f.size for f in video.frames} == {(20, 10)}


@pytest.mark.parametrize("index", [0, 1, 2, 11, 12, 13, 59, 60, 61, 100, 119])
def test_video_frame_is_the_exact_frame(mp4, index):
    loaded = load_frames(mp4, frame_header(index), KWARGS, "w")
    assert len(loaded.frames) == 1 and loaded.frames[0].size == (64, 48)
    assert read_index(loaded.frames[0]) == index
    assert loaded.frame_indices == (index,)
    assert loaded.timestamps == pytest.approx((index / RATE,), abs=1e-6)


def test_far_frame_is_reached_by_a_keyframe_seek(mp4):
    with VideoReader(mp4, "w") as video:
        (frame,) = video.frames_at([110])
        assert read_index(frame.to_image()) == 110
        assert video.decoded <= 12  # from the keyframe at 108 (gop 12), not 111 frames from the start
    with VideoReader(mp4, "w") as video:
        frames = video.frames_at([3, 100, 5, 119])
    assert [read_index(f.to_image()) for f in frames] == [3, 5, 100, 119]
    with VideoReader(mp4, "w") as video:
        video.table = None  # as for packets without timestamps: decode from the start, counting
        assert [read_index(f.to_image()) for f in video.frames_at([100, 7])] == [7, 100]
        assert video.decoded == 101 and video.times()[30] == pytest.approx(1.0)


def make_mkv(path: Path, pts_of) -> bytes:
    """MPEG-4 part 2 in Matroska: the container states no frame count; `pts_of(i)` in 1/30 s."""
    with av.open(str(path), "w", format="matroska") as container:
        stream = container.add_stream("mpeg4", rate=RATE)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.gop_size, stream.codec_context.max_b_frames = 10, 2
        for index in range(150):
            frame = av.VideoFrame.from_ndarray(index_frame(index), format="rgb24")
            frame.pts, frame.time_base = pts_of(index), Fraction(1, RATE)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path.read_bytes()


def test_variable_frame_rate_indexes_by_count_and_samples_like_hf(tmp_path):
    # 50 frames at 30 fps, then one frame every 0.1 s: indices are counts, times are not i / 30.
    data = make_mkv(tmp_path / "vfr.mkv", lambda i: i if i < 50 else 50 + 3 * (i - 50))
    for index in (10, 70, 120, 149):
        loaded = load_frames(data, frame_header(index), KWARGS, "w")
        assert read_index(loaded.frames[0]) == index
        expected = index if index < 50 else 50 + 3 * (index - 50)
        assert loaded.timestamps == pytest.approx((expected / RATE,), abs=1e-3)
    whole = load_frames(data, {"kind": "video", "path": "v"}, {**KWARGS, "fps": 1.0, "max_frames": 20}, "w")
    # HF's rule: the stream's average rate (30 fps, as the container states) makes 150 frames 5 s,
    # so 5 frames spread by count; the timestamps are the frames' real presentation times.
    expected = [0, 37, 74, 112, 149]
    assert list(whole.frame_indices) == expected and [read_index(f) for f in whole.frames] == expected
    times = [(i if i < 50 else 50 + 3 * (i - 50)) / RATE for i in expected]
    assert whole.timestamps == pytest.approx(times, abs=1e-3)


def test_frame_beyond_the_video_is_an_error(mp4):
    with pytest.raises(MediaError, match="w: video has 120 frames, no frame_index 120"):
        load_frames(mp4, frame_header(120), KWARGS, "w")
    with pytest.raises(MediaError, match="negative"):
        load_frames(mp4, frame_header(-1), KWARGS, "w")
    with pytest.raises(MediaError, match="w: cannot decode the video clip.mp4"):
        load_frames(b"\x00" * 100, frame_header(0), KWARGS, "w")


def test_sample_video_indices_counts():
    # 4 s at 30 fps sampled at 2 fps: 8 frames spread from the first to the last (HF's rule).
    assert sample_video_indices(120, 30.0, 2.0, 1, 8).tolist() == [0, 17, 34, 51, 68, 85, 102, 119]
    assert sample_video_indices(120, 30.0, 1.0, 1, 8).tolist() == [0, 40, 79, 119]
    assert sample_video_indices(120, 30.0, 2.0, 1, 3).tolist() == [0, 60, 119]  # capped at max_frames
    assert sample_video_indices(45, 30.0, 2.0, 1, 8).tolist() == [0, 22, 44]  # 1.5 s → 3
    assert sample_video_indices(10, 30.0, 2.0, 1, 8).tolist() == [0]  # shorter than one interval
    assert sample_video_indices(10, 30.0, 2.0, 4, 8).tolist() == [0, 3, 6, 9]  # raised to min_frames
    assert sample_video_indices(1, 30.0, 2.0, 4, 8).tolist() == [0]  # never more than there are
    assert sample_video_indices(3, 30.0, 1000.0, 1, 8).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="no frames"):
        sample_video_indices(0, 30.0, 2.0, 1, 8)
    with pytest.raises(ValueError, match="min_frames <= max_frames"):
        sample_video_indices(10, 30.0, 2.0, 9, 8)


@pytest.mark.parametrize("fps,max_frames,expected", [(2.0, 8, [0, 17, 34, 51, 68, 85, 102, 119]),
                                                      (1.0, 8, [0, 40, 79, 119]), (2.0, 3, [0, 60, 119])])
def test_whole_video_sampled_at_fps_capped_at_max_frames(mp4, fps, max_frames, expected):
    kwargs = {**KWARGS, "fps": fps, "max_frames": max_frames}
    loaded = load_frames(mp4, {"kind": "video", "path": "clip.mp4", "sha256": "x", "resize": None}, kwargs, "w")
    assert list(loaded.frame_indices) == expected
    assert [read_index(f) for f in loaded.frames] == expected
    assert loaded.timestamps == pytest.approx([i / RATE for i in expected], abs=1e-6)


def test_lmdb_round_trip(tmp_path):
    image = textured(20, 10)
    data = png_bytes(image)
    folder, single = tmp_path / "media.lmdb", tmp_path / "single.lmdb"
    for path, subdir in ((folder, True), (single, False)):
        with lmdb.open(str(path), map_size=1 << 22, subdir=subdir) as env, env.begin(write=True) as txn:
            txn.put(b"episode_1/cam0/000042", data)
    try:
        assert read_lmdb_value(folder, "episode_1/cam0/000042") == data
        assert read_lmdb_value(single, b"episode_1/cam0/000042") == data
        with pytest.raises(LmdbMediaError, match="no key 'missing'"):
            read_lmdb_value(folder, "missing")
        with pytest.raises(LmdbMediaError, match="no LMDB environment"):
            read_lmdb_value(tmp_path / "absent.lmdb", "k")
    finally:
        close_all()
    header = {"kind": "lmdb", "path": str(folder), "sha256": hashlib.sha256(data).hexdigest(), "resize": None}
    loaded = load_frames(data, header, KWARGS, "w")
    assert np.array_equal(np.asarray(loaded.frames[0]), np.asarray(image))
    with pytest.raises(MediaError, match="LMDB value 'k1' is not an image"):
        load_frames(b"raw", {**header, "lmdb_key": "k1"}, KWARGS, "w")


def test_unavailable_video_backend_is_refused_naming_the_entry(mp4):
    for backend in ("decord", "torchvision"):
        entry = EntryMedia.from_manifest_entry({"name": "robot3d_demo", "video_reader_backend": backend})
        with pytest.raises(MediaError, match=f"recipe entry 'robot3d_demo'.*'{backend}'.*pyav"):
            load_frames(mp4, frame_header(3), KWARGS, "w", entry=entry)
        # Images never touch the video reader.
        assert load_frames(png_bytes(textured()), IMAGE_HEADER, KWARGS, "w", entry=entry).frames
    pyav = EntryMedia.from_manifest_entry({"name": "e", "video_reader_backend": "pyav"})
    assert read_index(load_frames(mp4, frame_header(3), KWARGS, "w", entry=pyav).frames[0]) == 3
    with pytest.raises(AugmentError, match="'e'.*'opencv'"):
        EntryMedia.from_manifest_entry({"name": "e", "video_reader_backend": "opencv"})


def test_manifest_entry_defaults_and_checks():
    assert EntryMedia.from_manifest_entry({"name": "x", "start": 0, "stop": 3}) == EntryMedia(name="x")
    with pytest.raises(AugmentError, match="ops"):
        aug_entry(ops=["sepia"])
    with pytest.raises(AugmentError, match="missing keys"):
        EntryMedia.from_manifest_entry({"visual_aug": {"prob": 1.0}})


# --- augmentation --------------------------------------------------------------------------------

@pytest.mark.parametrize("severity", [1, 10])
@pytest.mark.parametrize("op", ALL_OPS)
def test_each_op_changes_pixels_and_keeps_size(op, severity):
    image = textured()
    out = apply_op(image, op, severity, np.random.default_rng(0))
    assert out.size == image.size and out.mode == "RGB"
    assert not np.array_equal(np.asarray(out), np.asarray(image))
    again = apply_op(image, op, severity, np.random.default_rng(0))
    assert np.array_equal(np.asarray(out), np.asarray(again))  # deterministic given the generator


@pytest.mark.parametrize("op", ["motion_blur", "gaussian_blur", "glass_blur", "light"])
def test_ops_keep_objects_in_place(op):
    # Labels (boxes, points) stay valid only if an object's centre does not move (glass blur
    # moves pixels up to 4 px at random: a little noise, no drift).
    pixels = np.full((192, 256, 3), 20, np.uint8)  # room for severity 10's blur around the object
    pixels[78:83, 148:153] = 230  # centre (150, 80), off the image centre
    for seed in range(3):
        out = np.asarray(apply_op(Image.fromarray(pixels), op, 10, np.random.default_rng(seed)), np.float64)
        mass = np.clip(out[..., 0] - np.median(out[..., 0]), 0, None)
        rows, cols = np.indices(mass.shape)
        assert (mass * cols).sum() / mass.sum() == pytest.approx(150, abs=1.5), op
        assert (mass * rows).sum() / mass.sum() == pytest.approx(80, abs=1.5), op


def test_severity_10_is_stronger_than_1():
    image = np.asarray(textured(), np.float32)
    for op in OPS:
        change = [np.abs(np.asarray(apply_op(textured(), op, s, np.random.default_rng(1)), np.float32) - image).mean()
                  for s in (1, 10)]
        assert change[1] > change[0], op


def test_training_with_prob_1_changes_pixels_never_size(mp4):
    data = png_bytes(textured())
    plain = load_frames(data, IMAGE_HEADER, KWARGS, "w")
    for op in ALL_OPS:
        loaded = load_frames(data, IMAGE_HEADER, KWARGS, "w", training=True, rng=np.random.default_rng(3),
                             entry=aug_entry(ops=[op]))
        assert loaded.frames[0].size == plain.frames[0].size
        assert not np.array_equal(np.asarray(loaded.frames[0]), np.asarray(plain.frames[0])), op
        assert loaded.augment["op"] == op and 1 <= loaded.augment["severity"] <= 10
    video = load_frames(mp4, {"kind": "video", "path": "c"}, KWARGS, "w", training=True,
                        rng=np.random.default_rng(0), entry=aug_entry(ops=["fog"]))
    assert len(video.frames) == 8 and {f.size for f in video.frames} == {(64, 48)}


def test_evaluation_never_augments_bit_for_bit(mp4):
    entry = aug_entry(data_augment=True)
    for data, header in ((png_bytes(textured()), IMAGE_HEADER), (mp4, frame_header(61))):
        plain = load_frames(data, header, KWARGS, "w")
        rng = np.random.default_rng(5)
        state = rng.bit_generator.state
        evaluated = load_frames(data, header, KWARGS, "w", training=False, rng=rng, entry=entry)
        assert rng.bit_generator.state == state  # evaluation does not even draw
        assert evaluated.augment is None
        for a, b in zip(evaluated.frames, plain.frames, strict=True):
            assert a.size == b.size and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_prob_0_never_changes():
    data = png_bytes(textured())
    plain = np.asarray(load_frames(data, IMAGE_HEADER, KWARGS, "w").frames[0])
    entry = aug_entry(prob=0.0)
    for seed in range(20):
        loaded = load_frames(data, IMAGE_HEADER, KWARGS, "w", training=True, rng=example_rng(7, seed, 0),
                             entry=entry)
        assert loaded.augment is None and np.array_equal(np.asarray(loaded.frames[0]), plain)


def test_views_select_which_media_items_are_augmented():
    data = [png_bytes(textured(seed=s)) for s in range(3)]
    plain = [np.asarray(load_frames(d, IMAGE_HEADER, KWARGS, "w").frames[0]) for d in data]
    entry = aug_entry(ops=["gaussian_blur"], views=[1, 2])
    sample = draw_sample_aug(entry, np.random.default_rng(0), "w")
    out = [np.asarray(load_frames(d, IMAGE_HEADER, KWARGS, "w", training=True, entry=entry, view=i,
                                  sample_aug=sample).frames[0]) for i, d in enumerate(data)]
    assert np.array_equal(out[0], plain[0])
    assert not np.array_equal(out[1], plain[1]) and not np.array_equal(out[2], plain[2])


def test_video_frames_get_the_same_op_and_field():
    frame = textured()
    sample = SampleAug(op="glass_blur", severity=6, seed=99)
    out, done = augment_frames([frame, frame.copy()], 0, sample)
    assert np.array_equal(np.asarray(out[0]), np.asarray(out[1]))
    assert done == {"op": "glass_blur", "severity": 6}


def test_draws_are_per_example_epoch_and_reproducible():
    entry = aug_entry(data_augment=True)
    first = [draw_sample_aug(entry, example_rng(1, 4, epoch), "w") for epoch in range(6)]
    assert first == [draw_sample_aug(entry, example_rng(1, 4, epoch), "w") for epoch in range(6)]
    assert len({(s.op, s.severity, s.scale) for s in first}) > 1
    with pytest.raises(AugmentError, match="no random generator"):
        draw_sample_aug(entry, None, "a.jsonl:3")


def test_zoom_blur_severity_is_capped():
    entry = aug_entry(ops=["zoom_blur", "fog"], severity=(7, 10), zoom=5)
    draws = [draw_sample_aug(entry, example_rng(0, i, 0), "w") for i in range(60)]
    assert {d.severity for d in draws if d.op == "zoom_blur"} == {5}
    assert min(d.severity for d in draws if d.op == "fog") >= 7


def test_resize_augmentation_rescales_within_range_keeping_aspect():
    data = png_bytes(textured(80, 40))
    entry = EntryMedia.from_manifest_entry({"name": "r", "data_augment": True})
    sizes = set()
    for seed in range(10):
        loaded = load_frames(data, IMAGE_HEADER, KWARGS, "w", training=True, rng=example_rng(0, seed, 0), entry=entry)
        (width, height), scale = loaded.frames[0].size, loaded.augment["scale"]
        assert RESCALE_RANGE[0] <= scale <= RESCALE_RANGE[1]
        assert (width, height) == (round(80 * scale), round(40 * scale))
        sizes.add((width, height))
    assert len(sizes) > 1
    assert load_frames(data, IMAGE_HEADER, KWARGS, "w", entry=entry).frames[0].size == (80, 40)


# --- loader integration and the media log --------------------------------------------------------

def media_example(mp4: bytes) -> tuple[Example, RowSpec]:
    pad = 7
    arrays = {"input_ids": np.array([1, pad, 2, pad, 3], np.int32), "target_weights": np.ones(5, np.float32),
              "media_0": np.frombuffer(png_bytes(textured()), np.uint8), "media_1": np.frombuffer(mp4, np.uint8)}
    meta = {"source": "robot.jsonl", "line": 4, "entry": "robot3d_demo",
            "media": [{**IMAGE_HEADER, "path": "a.png", "sha256": "aa"},
                      {"kind": "video", "path": "clip.mp4", "sha256": "bb", "frame_index": None, "resize": None}]}
    spec = RowSpec(seq_len=256, max_patches=1024, image_pad_id=pad, pad_id=0, vision=VISION, media_kwargs=KWARGS)
    return Example(arrays, meta), spec


def test_expanded_media_carry_frame_info_and_augment_only_in_training(mp4):
    example, spec = media_example(mp4)
    evaluated = expand_media_slots(example, spec)
    assert [i.frame_indices for i in evaluated.media_info] == [(), (0, 17, 34, 51, 68, 85, 102, 119)]
    entry = aug_entry(ops=["light"], views=[1])
    trained = expand_media_slots(example, spec, training=True, rng=example_rng(0, 0, 0), entry=entry)
    assert np.array_equal(trained.media[0].patches, evaluated.media[0].patches)  # view 0 not listed
    assert not np.array_equal(trained.media[1].patches, evaluated.media[1].patches)
    assert [m.grid for m in trained.media] == [m.grid for m in evaluated.media]
    again = expand_media_slots(example, spec, training=True, rng=example_rng(0, 0, 0), entry=entry)
    assert np.array_equal(again.media[1].patches, trained.media[1].patches)
    assert trained.media_info[1].augment == {"op": "light", "severity": trained.media_info[1].augment["severity"]}


def test_media_log_one_file_per_process(mp4, tmp_path, monkeypatch):
    example, spec = media_example(mp4)
    expanded = expand_media_slots(example, spec)
    log = MediaLog(tmp_path / "work", process_index=3)
    log.log_expanded(example, expanded, spec)
    assert log.path.name == f"media_log.3.{os.getpid()}.jsonl"
    lines = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [(r["media"], r["path"], r["sha256"]) for r in lines] == [(0, "a.png", "aa"), (1, "clip.mp4", "bb")]
    assert lines[0]["example"] == "robot.jsonl:4" and lines[0]["entry"] == "robot3d_demo"
    assert lines[1]["grid"] == list(expanded.media[1].grid)
    assert lines[1]["vision_tokens"] == expanded.media[1].num_tokens // 4
    assert lines[1]["frame_indices"] == [0, 17, 34, 51, 68, 85, 102, 119]
    assert lines[1]["timestamps"] == pytest.approx([i / RATE for i in lines[1]["frame_indices"]])
    # A worker gets the log by pickling, without the descriptor, and writes its own file.
    worker = pickle.loads(pickle.dumps(log))
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    worker.log_expanded(example, expanded, spec)
    assert (tmp_path / "work" / "media_log.3.4242.jsonl").exists()
    monkeypatch.undo()
    assert len(read_media_log(tmp_path / "work")) == 4
    merged = merge_media_logs(tmp_path / "work")
    assert merged.name == "media_log.jsonl" and len(merged.read_text().splitlines()) == 4
    assert len(read_media_log(tmp_path / "work")) == 4  # the merged file is not read as a part
    log.close()
