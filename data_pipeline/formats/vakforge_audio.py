"""What an audio file of a vakforge dataset really holds, by decoding it (seed 002, "Validation rules").

The duration is counted from decoded samples, not taken from the container header: a truncated or
re-muxed file keeps its header, and turns are cut from the samples that actually exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av


class AudioError(ValueError):
    """The file is not audio PyAV can decode; the message says why in a few words."""


@dataclass(frozen=True)
class AudioInfo:
    sample_rate: int
    channels: int
    duration_s: float


def probe_audio(path: Path) -> AudioInfo:
    """Sample rate, channel count and decoded duration of the first audio stream of `path`."""
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise AudioError("no audio stream")
            stream = container.streams.audio[0]
            samples = sum(frame.samples for frame in container.decode(stream))
            rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
    except AudioError:
        raise
    except Exception as err:  # noqa: BLE001 — FFmpeg reports bad bytes with many error types
        raise AudioError(f"{type(err).__name__}: {getattr(err, 'strerror', None) or err}"[:200]) from None
    if not rate or not samples:
        raise AudioError("no decodable samples")
    return AudioInfo(rate, channels, samples / rate)
