"""Audio of vakforge datasets: decode any common file, resample to 24 kHz, write WAV, lay a tone.

Seed 002 ("Layout on disk"): `prepare` produces normalised 24 kHz WAVs. Decoding goes through
PyAV (FFmpeg: WAV, FLAC, MP3, Ogg/Opus, M4A/AAC …), resampling through soxr (the SoX resampler,
"HQ" quality) with an output of exactly round(n · 24000 / rate) samples, so a turn's time stamps
stay where they were. WAVs are written as PCM16 by libsndfile (soundfile); the channel count is
kept (mono stays mono, dual-stream stays stereo).

Signals are float32 arrays shaped [samples, channels] in [-1, 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

TARGET_RATE = 24000
EXTRA = "pip install 'valen-jax[vakforge]'"
# The redaction tone (seed 002's redaction_log `method: "tone"`): a 1 kHz sine at -20 dBFS, the
# telephone "bleep" listeners recognise, quiet enough never to clip when written as PCM16.
TONE_HZ = 1000.0
TONE_AMPLITUDE = 0.1


def missing_extra(package: str) -> ImportError:
    return ImportError(f"vakforge audio tools need {package}: {EXTRA}")


class AudioDecodeError(ValueError):
    """A file that is not audio PyAV can decode; the message names the file."""


@dataclass
class Recording:
    samples: np.ndarray  # float32 [n, channels]
    sample_rate: int

    @property
    def channels(self) -> int:
        return self.samples.shape[1]

    @property
    def duration_s(self) -> float:
        return self.samples.shape[0] / self.sample_rate


def decode(path: Path) -> Recording:
    """All samples of the first audio stream of `path`, as float32 [n, channels] at the file's rate."""
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise AudioDecodeError(f"{path}: no audio stream")
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate
            channels = stream.codec_context.channels
            # Planar float keeps every channel apart whatever the codec's own sample format.
            converter = av.AudioResampler(format="fltp", layout=stream.codec_context.layout, rate=rate)
            planes = []
            for frame in container.decode(stream):
                for out in converter.resample(frame):
                    planes.append(out.to_ndarray())
            for out in converter.resample(None):
                planes.append(out.to_ndarray())
    except AudioDecodeError:
        raise
    except Exception as err:  # noqa: BLE001 — FFmpeg reports bad bytes with many error types
        detail = getattr(err, "strerror", None) or err
        raise AudioDecodeError(f"{path}: does not decode: {type(err).__name__}: {detail}"[:300]) from None
    if not rate or not planes:
        raise AudioDecodeError(f"{path}: no decodable samples")
    samples = np.concatenate(planes, axis=1).T.astype(np.float32, copy=False)
    if samples.shape[1] != channels:
        raise AudioDecodeError(f"{path}: decoded {samples.shape[1]} channels, the stream declares {channels}")
    return Recording(np.ascontiguousarray(samples), rate)


def resample(recording: Recording, rate: int = TARGET_RATE) -> Recording:
    """`recording` at `rate`, exactly round(n · rate / source rate) samples long (soxr HQ)."""
    if recording.sample_rate == rate:
        return recording
    try:
        import soxr
    except ImportError:
        raise missing_extra("soxr") from None
    # soxr.resample returns the exact output length for a whole signal given at once.
    out = soxr.resample(recording.samples, recording.sample_rate, rate, quality="HQ")
    return Recording(np.ascontiguousarray(out, dtype=np.float32), rate)


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples as int16, rounded and clipped: the exact values a PCM16 WAV will hold.

    The scale is 32768, the one FFmpeg decodes PCM16 with (x / 32768), so decoding a WAV this wrote
    and writing it again gives the same integers (prepare is idempotent).
    """
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)


def write_wav(path: Path, recording: Recording) -> None:
    """A PCM16 WAV; identical samples give identical bytes (libsndfile writes no time stamp)."""
    try:
        import soundfile
    except ImportError:
        raise missing_extra("soundfile") from None
    soundfile.write(str(path), to_pcm16(recording.samples), recording.sample_rate, subtype="PCM_16", format="WAV")


def read_wav_pcm16(path: Path) -> tuple[np.ndarray, int]:
    """int16 [n, channels] and the rate of a WAV, read without conversion (for exact comparisons)."""
    import soundfile

    data, rate = soundfile.read(str(path), dtype="int16", always_2d=True)
    return data, rate


def tone(length: int, rate: int, offset: int = 0) -> np.ndarray:
    """`length` samples of the redaction tone, phase-continuous from sample `offset` of the file."""
    t = (np.arange(length) + offset) / rate
    return (TONE_AMPLITUDE * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)


def lay_tone(recording: Recording, start_s: float, end_s: float, channel: int | None) -> tuple[int, int]:
    """Replace samples [start_s, end_s) of one channel (every channel if None) by the tone.

    The range is clamped to the recording; returns the sample range replaced. The tone depends only
    on sample positions, so laying it again over the same range changes nothing (prepare re-runs are
    byte-identical).
    """
    rate = recording.sample_rate
    n = recording.samples.shape[0]
    first = min(max(int(np.floor(start_s * rate)), 0), n)
    last = min(max(int(np.ceil(end_s * rate)), first), n)
    wave = tone(last - first, rate, first)
    columns = range(recording.channels) if channel is None else (channel,)
    for c in columns:
        recording.samples[first:last, c] = wave
    return first, last
