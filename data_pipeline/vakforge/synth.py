"""`vakforge synth`: speech for rows that have no recording (seed 002, "audio — optional"; issue 18).

Example:

    python -m data_pipeline.vakforge synth --manifest=data/smoke/vakforge/vakforge.jsonl --out=/tmp/vakforge_synth
    python -m data_pipeline.validate --format=vakforge /tmp/vakforge_synth/vakforge.jsonl

Rows built from documents, tables or chat logs get a recording rendered offline by eSpeak NG
(`espeak`: the library and voices inside the espeakng-loader wheel; nothing downloaded):
- one voice per speaker: the user speaks with eSpeak's `m3` variant at pitch 35, the agent with
  `f2` at pitch 65, in the language voice of each turn's `lang` (en-US → en-us, other English → en,
  hi/hi-Latn → hi, zh → cmn, es → es, else the language subtag);
- stereo 24 kHz PCM16, user on channel 0 and agent on channel 1 (`channel_map`), so the row is
  dual-stream as duplex adapters need;
- turns one after another with `GAP_S` of silence between them; a turn the input marks `overlap`
  starts `OVERLAP_S` before the previous one ends (the two channels hold both); tool turns take no
  time; `start`/`end` are the rendered times, rounded to the millisecond (the samples are placed at
  the rounded times);
- `meta.source: synthetic` (the recording is); consent, licence, redaction flag and log are kept,
  because the text's provenance is unchanged. A `source: real` row must already be redacted
  (`pii_redacted: true`, e.g. by `prepare`): synthetic rows are exempt from the redaction rules, and
  rendering would otherwise launder a real person's data into a synthetic row.
- a spoken turn without `lang` gets the locale pack's `detect_lang`.

Rows that have audio are copied with their files; redaction logs and splits.json are copied. The
output is written all at once and validated before it appears (see `dataset`).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_pipeline.cli_flags import add_flag
from data_pipeline.formats.errors import FormatError, Problem
from data_pipeline.vakforge.audio import TARGET_RATE, Recording, resample, write_wav
from data_pipeline.vakforge.dataset import (
    Row,
    check_out,
    copy_splits,
    read_rows,
    source_file,
    staged_dataset,
    validate_staged,
    write_manifest,
)
from data_pipeline.vakforge.espeak import ESpeak, Voice

CHANNEL_MAP = {"0": "user", "1": "agent"}
VARIANTS = {"user": ("m3", 35), "agent": ("f2", 65)}
GAP_S = 0.25
OVERLAP_S = 0.3
LEAD_S = 0.2


def voice_for(lang: str, speaker: str) -> Voice:
    parts = lang.split("-")
    base = parts[0]
    if base == "en":
        name = "en-us" if "US" in parts[1:] else "en"
    else:
        name = {"zh": "cmn"}.get(base, base)
    variant, pitch = VARIANTS[speaker]
    return Voice(name, variant, pitch)


def _spoken(turn: dict) -> bool:
    return turn.get("speaker") in ("user", "agent") and "tool_call" not in turn and isinstance(turn.get("text"), str)


class Synthesizer:
    def __init__(self, base: Path, stage: Path):
        self.base, self.stage = base, stage
        self.engine = ESpeak.engine()
        self.rendered = 0
        self.copied = 0

    def row(self, row: Row) -> dict:
        record = copy.deepcopy(row.record)
        record_meta = record.get("meta")
        if not isinstance(record_meta, dict):
            raise FormatError([row.problem("meta", "required: an object with source, consent, pii_redacted")])
        log = record_meta.get("redaction_log")
        if log is not None:
            self.copy(source_file(self.base, log, row, "meta.redaction_log"), log)
        if record.get("audio") is not None:
            self.copy(source_file(self.base, record["audio"].get("path"), row, "audio.path"), record["audio"]["path"])
            self.copied += 1
            return record
        if record_meta.get("source") == "real" and record_meta.get("pii_redacted") is not True:
            raise FormatError([row.problem("meta.pii_redacted", "a real row must be redacted before synth renders it "
                                           "(run prepare); rendered rows become synthetic, which are exempt from "
                                           "redaction")])
        self.render(row, record)
        record_meta["source"] = "synthetic"
        self.rendered += 1
        return record

    def copy(self, source: Path, written: str) -> None:
        target = self.stage / written
        if target.exists():
            # Two rows naming one file, or a copied file at a rendered row's audio/ID.wav.
            raise FormatError([Problem(str(source), 0, "file", f"{written} is written twice; give each row its own file")])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)

    def render(self, row: Row, record: dict) -> None:
        placed: list[tuple[int, int, np.ndarray]] = []  # (channel, first sample, samples)
        clock = LEAD_S
        previous_spoken: dict | None = None
        for i, turn in enumerate(record.get("turns") or ()):
            if not isinstance(turn, dict) or not _spoken(turn):
                if isinstance(turn, dict):
                    turn["start"] = turn["end"] = round(clock, 3)
                continue
            if turn.get("lang") is None:
                from data_pipeline.vakforge.language import detect_lang

                turn["lang"] = detect_lang(turn["text"], record.get("locale"))
            try:
                voice = voice_for(turn["lang"], turn["speaker"])
                speech = self.engine.speak(turn["text"], voice)
            except ValueError as err:
                raise FormatError([row.problem(f"turns[{i}].lang", str(err))]) from None
            speech = resample(Recording(speech[:, None], self.engine.sample_rate), TARGET_RATE).samples[:, 0]
            start = clock
            if turn.get("overlap") and previous_spoken is not None:
                start = max(previous_spoken["end"] - OVERLAP_S, previous_spoken["start"])
            start = round(start, 3)
            end = round(start + len(speech) / TARGET_RATE, 3)
            turn["start"], turn["end"] = start, end
            placed.append((0 if turn["speaker"] == "user" else 1, round(start * TARGET_RATE), speech))
            clock = max(clock, end + GAP_S)
            previous_spoken = turn
        if not placed:
            raise FormatError([row.problem("turns", "no spoken turn to render")])
        length = max(first + len(s) for _, first, s in placed) + round(LEAD_S * TARGET_RATE)
        samples = np.zeros((length, 2), np.float32)
        for channel, first, speech in placed:
            samples[first:first + len(speech), channel] += speech
        path = f"audio/{row.id}.wav"
        if (self.stage / path).exists():
            raise FormatError([row.problem("audio", f"{path} is already taken by a copied row's audio")])
        (self.stage / "audio").mkdir(exist_ok=True)
        write_wav(self.stage / path, Recording(samples, TARGET_RATE))
        record["audio"] = {"path": path, "sample_rate": TARGET_RATE, "channels": 2, "channel_map": dict(CHANNEL_MAP),
                           "duration_s": round(length / TARGET_RATE, 6), "condition": "studio"}
        # Keep the record's key order readable: audio after schema_version, as the seed writes it.
        keys = list(record)
        keys.remove("audio")
        keys.insert(keys.index("schema_version") + 1 if "schema_version" in keys else 0, "audio")
        reordered = {k: record[k] for k in keys}
        record.clear()
        record.update(reordered)


def synth(manifest: Path, out: Path, allow_unconsented: bool = False) -> tuple[int, int]:
    rows = read_rows(manifest)
    check_out(out, [manifest.parent])
    with staged_dataset(out) as stage:
        synthesizer = Synthesizer(manifest.parent, stage)
        write_manifest(stage, [synthesizer.row(row) for row in rows])
        has_splits = copy_splits(manifest, stage, "synth")
        validate_staged(stage, rows, has_splits, allow_unconsented)
    return synthesizer.rendered, synthesizer.copied


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: multi-word flags through `cli_flags.add_flag` (hyphens, or underscores)."""
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.vakforge synth", description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", required=True, type=Path, metavar="IN")
    parser.add_argument("--out", required=True, type=Path, metavar="DATA_DIR", help="a new folder for the dataset")
    add_flag(parser, "--allow-unconsented", action="store_true",
             help='accept meta.consent "none" (excluded from any published artifact)')
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rendered, copied = synth(args.manifest, args.out, args.allow_unconsented)
    except FormatError as err:
        for problem in err.problems:
            print(problem, file=sys.stderr)
        print(f"synth: nothing written to {args.out}", file=sys.stderr)
        return 1
    print(f"synth: {rendered} rows rendered with eSpeak NG, {copied} rows with audio copied → {args.out}")
    return 0
