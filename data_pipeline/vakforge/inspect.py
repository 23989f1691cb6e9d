"""`vakforge inspect`: what a recording is, per file and per channel (issue 18).

Example:

    python -m data_pipeline.vakforge inspect data/smoke/vakforge/audio/*.flac
    python -m data_pipeline.vakforge inspect --json data/smoke/vakforge/audio/conv_hi_0002.wav

For every channel it reports:
- silence fraction: the share of 30 ms frames that WebRTC's voice-activity detector (aggressiveness
  2) calls non-speech. The VAD runs at 16 kHz, one of the rates it supports, on a soxr-resampled
  copy made for analysis only; a trailing part frame is not counted.
- clipping fraction: the share of samples whose magnitude is at least 0.999 of full scale (within
  0.009 dB of it; a PCM16 sample of ±32735 or beyond), where a clipped waveform flattens.
- loudness: integrated loudness in LUFS (ITU-R BS.1770-4, pyloudnorm) of that channel alone;
  `null` when the channel is shorter than one 400 ms gating block or silent throughout.

It never guesses `audio.condition` (studio | clean | phone | noisy). Seed 002: whoever prepares the
data sets it; inspect reports rate, silence and clipping, because unbroken energy is what dense
speech looks like as much as noise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data_pipeline.vakforge.audio import (
    AudioDecodeError,
    Recording,
    decode,
    missing_extra,
    resample,
    to_pcm16,
)

VAD_RATE = 16000
VAD_FRAME_MS = 30
VAD_AGGRESSIVENESS = 2
CLIP_LEVEL = 0.999


@dataclass(frozen=True)
class ChannelReport:
    channel: int
    silence_fraction: float
    clipping_fraction: float
    loudness_lufs: float | None


@dataclass(frozen=True)
class FileReport:
    path: str
    sample_rate: int
    channels: int
    duration_s: float
    per_channel: list[ChannelReport]


def silence_fraction(mono: np.ndarray, rate: int) -> float:
    """Share of 30 ms frames the WebRTC VAD calls non-speech (1.0 for audio shorter than a frame)."""
    try:
        import webrtcvad
    except ImportError:
        raise missing_extra("webrtcvad-wheels") from None
    pcm = to_pcm16(resample(Recording(mono[:, None], rate), VAD_RATE).samples[:, 0])
    frame = VAD_RATE * VAD_FRAME_MS // 1000
    count = len(pcm) // frame
    if count == 0:
        return 1.0
    vad = webrtcvad.Vad(VAD_AGGRESSIVENESS)
    frames = pcm[: count * frame].reshape(count, frame)
    speech = sum(vad.is_speech(f.tobytes(), VAD_RATE) for f in frames)
    return 1.0 - speech / count


def clipping_fraction(mono: np.ndarray) -> float:
    return float(np.mean(np.abs(mono) >= CLIP_LEVEL)) if len(mono) else 0.0


def loudness_lufs(mono: np.ndarray, rate: int) -> float | None:
    try:
        import pyloudnorm
    except ImportError:
        raise missing_extra("pyloudnorm") from None
    meter = pyloudnorm.Meter(rate)
    if len(mono) < int(meter.block_size * rate):
        return None
    value = meter.integrated_loudness(mono.astype(np.float64))
    return None if not math.isfinite(value) else round(float(value), 2)


def inspect_recording(path: str, recording: Recording) -> FileReport:
    per_channel = []
    for c in range(recording.channels):
        mono = recording.samples[:, c]
        per_channel.append(ChannelReport(
            channel=c,
            silence_fraction=round(silence_fraction(mono, recording.sample_rate), 4),
            clipping_fraction=round(clipping_fraction(mono), 6),
            loudness_lufs=loudness_lufs(mono, recording.sample_rate),
        ))
    return FileReport(path, recording.sample_rate, recording.channels, round(recording.duration_s, 3), per_channel)


def inspect_file(path: Path) -> FileReport:
    return inspect_recording(str(path), decode(path))


def table(reports: Sequence[FileReport]) -> str:
    header = ("file", "ch", "rate", "channels", "duration_s", "silence", "clipping", "LUFS")
    rows = [header]
    for r in reports:
        for c in r.per_channel:
            lufs = "-" if c.loudness_lufs is None else f"{c.loudness_lufs:.1f}"
            rows.append((r.path, str(c.channel), str(r.sample_rate), str(r.channels), f"{r.duration_s:.3f}",
                         f"{c.silence_fraction:.1%}", f"{c.clipping_fraction:.2%}", lufs))
    widths = [max(len(row[k]) for row in rows) for k in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: one-word flags only (a multi-word one goes through `cli_flags.add_flag`)."""
    parser = argparse.ArgumentParser(
        prog="python -m data_pipeline.vakforge inspect",
        description=__doc__.split("\n")[0],
        epilog="inspect never guesses audio.condition: set it yourself (seed 002); dense speech and "
               "noise both look like unbroken energy.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="audio files (any format FFmpeg decodes)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of reports on stdout")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    reports, failed = [], 0
    for path in args.paths:
        try:
            reports.append(inspect_file(Path(path)))
        except (AudioDecodeError, OSError) as err:
            print(f"inspect: {err}", file=sys.stderr)
            failed += 1
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
    elif reports:
        print(table(reports))
    return 1 if failed else 0
