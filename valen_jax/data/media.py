"""Decode media bytes from shards into frames (PIL images) for the vision processor."""

from __future__ import annotations

import io
from collections.abc import Mapping

from PIL import Image


class MediaError(ValueError):
    """Media bytes that cannot be decoded as the example says; names the example."""


def decode_video_frame(data: bytes, frame_index: int, where: str) -> Image.Image:
    import av  # imported lazily: only video references need FFmpeg

    with av.open(io.BytesIO(data)) as container:
        for index, frame in enumerate(container.decode(video=0)):
            if index == frame_index:
                return frame.to_image()
    raise MediaError(f"{where}: video has no frame {frame_index}")


def load_frames(data: bytes, header: Mapping, media_kwargs: Mapping, where: str) -> list[Image.Image]:
    """Original bytes → the frames the processor patches; `resize` from the record is an exact stretch."""
    try:
        if header["kind"] == "video_frame":
            image = decode_video_frame(data, int(header["frame_index"]), where)
        else:
            image = Image.open(io.BytesIO(data))
            image.load()
    except (OSError, ValueError) as err:
        raise MediaError(f"{where}: cannot decode {header['path']}: {err}") from err
    image = image.convert("RGB")
    if header.get("resize"):
        image = image.resize(tuple(header["resize"]), Image.BICUBIC)
    return [image]
