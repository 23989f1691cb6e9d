"""Decode media bytes from shards into frames (PIL images) for the vision processor.

Every media form of seed 004 ("Data Format": a path, `{file}`, `{video, frame_index}`,
`{lmdb_file, lmdb_key}`) and seed 000's Valen `image_url` / `video_url` reach the loader as the
original bytes plus a header (`kind`, `path`, `sha256`, `frame_index`, `resize`; see
`data_pipeline.render.common.MediaBlob`). Kinds:

- `path`, `file`, `image`: an image file, decoded by Pillow.
- `lmdb`: the image bytes the converter read from the LMDB value (the shard never refers back to
  the LMDB, so shards train anywhere: DESIGN, "Media travels inside shards").
- `video_frame`: exactly the `frame_index`-th frame in presentation order; far frames are reached
  by seeking to the preceding keyframe instead of decoding from the start.
- `video`: a whole clip (Valen `video_url`), `media_kwargs.fps` frames a second spread evenly over
  it, between `media_kwargs.min_frames` and `max_frames`, as the Qwen-VL processors sample (see
  `sample_video_indices`).

Order of pixel operations: decode → the record's `resize` (an exact stretch, part of the data:
seed 004 "Dictionary references accept resize") → training-only augmentation (`augment.py`) →
the processor's smart_resize.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

# The one image decoder (issue 54): validate and convert run it too, so what reaches here decodes.
from data_pipeline.formats.media_decode import decode_image
from valen_jax.data.augment import EntryMedia, SampleAug, augment_frames, draw_sample_aug
from valen_jax.data.vision_processor import media_settings, to_rgb

IMAGE_KINDS = ("path", "file", "image", "lmdb")
VIDEO_KINDS = ("video_frame", "video")
# A target this many frames (or fewer) past the decoder's position is reached by decoding on;
# farther ones by a keyframe seek. One GOP of typical encoders (≤ 2 s at 30 fps) is cheaper to
# decode through than to seek and re-prime the decoder.
SEEK_GAP = 60


class MediaError(ValueError):
    """Media bytes that cannot be decoded as the example says; names the example."""


@dataclass(frozen=True)
class MediaInfo:
    """What the media log records next to the grid (seed 000, "Images and video": media logs)."""

    frame_indices: tuple[int, ...]  # presentation-order indices in the video; () for a still image
    timestamps: tuple[float, ...]  # seconds from the first frame, one per frame; () for an image
    augment: dict | None = None  # the training augmentation applied, if any
    # A whole clip's stream rate and frame count (HF's VideoMetadata fps / total_num_frames): Qwen2.5-VL's
    # video time positions and Qwen3-VL's timestamps are computed from them. 0 for anything else.
    video_fps: float = 0.0
    total_frames: int = 0


@dataclass(frozen=True)
class LoadedMedia:
    frames: list[Image.Image]  # RGB, all the same size
    frame_indices: tuple[int, ...] = ()
    timestamps: tuple[float, ...] = ()
    augment: dict | None = None
    video_fps: float = 0.0
    total_frames: int = 0

    @property
    def info(self) -> MediaInfo:
        return MediaInfo(self.frame_indices, self.timestamps, self.augment, self.video_fps, self.total_frames)


# --- still images --------------------------------------------------------------------------------

def decode_lmdb_value(data: bytes, where: str, key: str | None = None) -> Image.Image:
    """The image stored as an LMDB value (seed 004 `{"lmdb_file", "lmdb_key"}`), copied into the shard."""
    try:
        return decode_image(data)
    except (OSError, ValueError) as err:
        raise MediaError(f"{where}: LMDB value {key!r} is not an image Pillow can read: {err}") from err


# --- video ---------------------------------------------------------------------------------------

def sample_video_indices(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> np.ndarray:
    """Indices of the frames to keep, exactly as transformers' `Qwen3VLVideoProcessor.sample_frames`
    (5.24; qwen-vl-utils samples Qwen2/2.5-VL videos the same way, up to rounding the count to 2):
    int(duration × fps) frames, clamped to [min_frames, max_frames] and to the frames there are,
    spread evenly from the first frame to the last (so the whole clip is covered).

    `video_fps` is the stream's average frame rate (what HF's PyAV reader reports), so the
    duration is `total / video_fps`, also for a variable frame rate: samples are spread by count.
    """
    if total <= 0:
        raise ValueError("the video has no frames")
    if not (video_fps > 0 and fps > 0 and 0 < min_frames <= max_frames):
        raise ValueError(f"need video fps > 0, fps > 0 and 0 < min_frames <= max_frames; got {video_fps}, {fps}, "
                         f"{min_frames}, {max_frames}")
    count = min(max(int(total / video_fps * fps), min_frames), max_frames, total)
    return np.linspace(0, total - 1, count).round().astype(np.int64)


class VideoReader:
    """An opened video whose frames are addressed by presentation-order index.

    `frame_index` N is the N-th frame shown (decord's meaning, whose reader the seed's recipes
    name). The index → timestamp table is built from the packets alone (demuxing, no decoding),
    so a far frame is reached by seeking to the keyframe before it and decoding only from there,
    exactly, also at a variable frame rate. A stream whose packets carry no timestamps is decoded
    from the start, counting.
    """

    def __init__(self, data: bytes, where: str):
        import av  # imported lazily: only videos need FFmpeg

        self.where = where
        self.container = av.open(io.BytesIO(data))
        if not self.container.streams.video:
            self.container.close()
            raise MediaError(f"{where}: the file has no video stream")
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "AUTO"
        packets = [(p.pts, p.is_discard) for p in self.container.demux(self.stream) if p.size]
        self.container.seek(0)
        kept = [pts for pts, discard in packets if not discard]  # edit lists mark pre-roll packets
        self.table = sorted(kept) if kept and None not in kept else None  # stream pts of each frame
        self.count = len(kept)
        self.decoded = 0  # frames decoded so far (a test proves seeking with it)

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc) -> None:
        self.container.close()

    def times(self) -> np.ndarray:
        """Presentation time of every frame, in seconds from the first frame."""
        if self.table is not None:
            return (np.asarray(self.table, np.float64) - self.table[0]) * float(self.stream.time_base)
        rate = self.stream.average_rate or self.stream.guessed_rate
        if not rate:
            raise MediaError(f"{self.where}: the video states neither frame timestamps nor a frame rate")
        return np.arange(self.count) / float(rate)

    def rate(self) -> float:
        """Average frame rate as HF's PyAV video reader reports it (`stream.average_rate`). Where the
        container states none (HF would then sample nothing), FFmpeg's guessed rate, else the rate
        the frame times give."""
        rate = self.stream.average_rate or self.stream.guessed_rate
        if rate:
            return float(rate)
        times = self.times()
        if len(times) < 2 or times[-1] <= 0:
            raise MediaError(f"{self.where}: the video states no frame rate and its frames no duration")
        return (len(times) - 1) / float(times[-1])

    def frames_at(self, indices: Sequence[int]) -> list:
        """The frames at these indices, in ascending index order (duplicates once)."""
        targets = sorted(set(int(i) for i in indices))
        if targets and (targets[0] < 0 or targets[-1] >= self.count):
            bad = targets[0] if targets[0] < 0 else targets[-1]
            raise MediaError(f"{self.where}: video has {self.count} frames, no frame_index {bad}")
        if self.table is None:
            return self._counting(targets)
        found, position = [], -1
        frames = self.container.decode(self.stream)
        for target in targets:
            want = self.table[target]
            if target - position > SEEK_GAP:
                self.container.seek(want, stream=self.stream, backward=True, any_frame=False)
                frames = self.container.decode(self.stream)  # seek() flushed the decoder
            while True:
                frame = next(frames, None)
                if frame is None or frame.pts is None or frame.pts > want:
                    # The decoder did not return what the packets promised: count from the start.
                    return self._counting(targets)
                self.decoded += 1
                if frame.pts == want:
                    break
            found.append(frame)
            position = target
        return found

    def _counting(self, targets: list[int]) -> list:
        self.container.seek(0)
        wanted, found, count = set(targets), [], 0
        for frame in self.container.decode(self.stream):
            self.decoded += 1
            if count in wanted:
                found.append(frame)
                if len(found) == len(wanted):
                    return found
            count += 1
        raise MediaError(f"{self.where}: video has {count} frames, no frame_index {targets[len(found)]}")


def decode_video_frame(data: bytes, frame_index: int, where: str) -> LoadedMedia:
    if frame_index < 0:
        raise MediaError(f"{where}: frame_index {frame_index} is negative")
    with VideoReader(data, where) as video:
        (frame,) = video.frames_at([frame_index])
        return LoadedMedia([frame.to_image()], (frame_index,), (float(video.times()[frame_index]),))


def decode_video(data: bytes, media_kwargs: Mapping, where: str) -> LoadedMedia:
    settings = media_settings(media_kwargs)
    with VideoReader(data, where) as video:
        if video.count == 0:
            raise MediaError(f"{where}: the video has no frames")
        times = video.times()
        indices = sample_video_indices(video.count, video.rate(), float(settings["fps"]), int(settings["min_frames"]),
                                       int(settings["max_frames"]))
        frames = video.frames_at(indices.tolist())
        return LoadedMedia([f.to_image() for f in frames], tuple(int(i) for i in indices),
                           tuple(float(times[i]) for i in indices), video_fps=video.rate(), total_frames=video.count)


# --- the loader's entry point --------------------------------------------------------------------

def _decode(data: bytes, header: Mapping, media_kwargs: Mapping, where: str, backend: str | None,
            entry_name: str) -> LoadedMedia:
    kind = header.get("kind")
    if kind in IMAGE_KINDS:
        if kind == "lmdb":
            return LoadedMedia([decode_lmdb_value(data, where, header.get("lmdb_key"))])
        return LoadedMedia([decode_image(data)])
    if kind not in VIDEO_KINDS:
        raise MediaError(f"{where}: unknown media kind {kind!r}; known: {', '.join(IMAGE_KINDS + VIDEO_KINDS)}")
    if backend not in (None, "pyav"):
        # Seed 004 lets an entry choose decord, pyav or torchvision; only PyAV is installed. Decoding
        # with another reader than the one asked for would be a silent fallback (DESIGN).
        raise MediaError(f"{where}: recipe entry {entry_name or '?'!r} asks for video_reader_backend "
                         f"{backend!r}, which this installation does not provide; set it to \"pyav\" in the recipe")
    import av

    try:
        if kind == "video_frame":
            if header.get("frame_index") is None:
                raise MediaError(f"{where}: a video_frame media item without frame_index")
            return decode_video_frame(data, int(header["frame_index"]), where)
        return decode_video(data, media_kwargs, where)
    except av.FFmpegError as err:
        raise MediaError(f"{where}: cannot decode the video {header.get('path')}: {err}") from err


def load_frames(data: bytes, header: Mapping, media_kwargs: Mapping, where: str, *, training: bool = False,
                rng: np.random.Generator | None = None, entry: EntryMedia | None = None, view: int = 0,
                sample_aug: SampleAug | None = None) -> LoadedMedia:
    """Original bytes → the frames the processor patches, with their frame indices and timestamps.

    `view` is the media item's index in its record (what `visual_aug.views` lists). `sample_aug`
    is the per-sample augmentation draw (seed 004: "for each sample, with probability prob, one
    op"); a caller loading several media items of one sample draws it once and passes it to each.
    When it is absent and `training` is set, it is drawn here from `rng`. Evaluation
    (`training=False`) never augments and never reads `rng`.
    """
    entry = entry or EntryMedia()
    try:
        loaded = _decode(data, header, media_kwargs, where, entry.video_reader_backend, entry.name)
    except MediaError:
        raise
    except (OSError, ValueError) as err:
        raise MediaError(f"{where}: cannot decode {header.get('path')}: {err}") from err
    frames = [to_rgb(frame) for frame in loaded.frames]  # before `resize`/augmentation, as HF converts first
    if header.get("resize"):
        width, height = (int(v) for v in header["resize"])
        frames = [frame.resize((width, height), Image.BICUBIC) for frame in frames]
    augment = None
    if training:
        if sample_aug is None:
            sample_aug = draw_sample_aug(entry, rng, where)
        frames, augment = augment_frames(frames, view, sample_aug)
    return LoadedMedia(frames, loaded.frame_indices, loaded.timestamps, augment, loaded.video_fps, loaded.total_frames)
