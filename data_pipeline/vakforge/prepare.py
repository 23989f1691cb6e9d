"""`vakforge prepare`: raw uploads → a canonical vakforge dataset (seed 002, issue 18).

Example:

    python -m data_pipeline.vakforge prepare data/smoke/vakforge \\
        --manifest=data/smoke/vakforge/vakforge.jsonl --out=/tmp/vakforge_prepared
    python -m data_pipeline.validate --format=vakforge /tmp/vakforge_prepared/vakforge.jsonl

RAW_DIR holds the uploads; the input manifest's `audio.path` and `meta.redaction_log` are relative
to it. Nothing in RAW_DIR is written. DATA_DIR receives, all at once (see `dataset`):
- `audio/ID.wav`: the recording decoded (any format FFmpeg reads) and resampled to 24 kHz PCM16
  with exactly round(n · 24000 / rate) samples; mono stays mono, stereo stays stereo. The declared
  sample rate, channel count and duration (±0.5 s) must match the file, and two channels need a
  channel map with one user and one agent channel.
- `vakforge.jsonl`: every row, in order, with `audio` rewritten, `turns[].lang` set by the locale
  pack's `detect_lang` (on the text as written, after redaction; a turn without letters keeps its
  lang, or takes `language.primary`, and is counted), and, for `meta.source: real`, redacted.
- `redactions/ID.json` per real row: the previous log's spans (when the input names one) followed by
  this run's, each text span with `audio: {start_s, end_s, method: "tone"}`.
- `splits.json`, copied from beside the input manifest.

Where the tone goes. Transcripts time turns, not words, so the tone covers the whole time range of
the turn that said the value, widened by `TONE_MARGIN_S` each side for diarization's imprecise
boundaries (clamped to the recording), on the speaker's own channel of a dual-stream recording
(the other channel is the other party's leg of the call, and toning it would erase their overlapping
speech) or on the one channel of a mono recording. Placing a span by its share of the turn's
characters was measured and rejected: spoken numbers and e-mail addresses take far longer than their
characters suggest (a 10-digit phone number is read digit by digit), and on eSpeak NG speech the
proportional estimate misses the words' true times by up to seconds (benchmarks/vakforge_prepare.py
prints the figures). A whole turn holds the value as far as its times are right; the cost is the
turn's other words.
Known limit: acoustic echo of the speaker on the other channel is not toned.

`--skip-redaction` leaves real rows unredacted, prints a warning on stderr, and marks them
`meta.pii_redacted: false` with `meta.redaction_skipped: true`; such rows still validate, and the
mark tells every later tool they hold personal data.

Re-running prepare on its own output changes nothing: the same rows, bytes and audio samples.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.cli_flags import add_flag
from data_pipeline.formats.errors import FormatError
from data_pipeline.vakforge.audio import (
    TARGET_RATE,
    AudioDecodeError,
    Recording,
    decode,
    lay_tone,
    resample,
    write_wav,
)
from data_pipeline.vakforge.dataset import (
    Row,
    check_out,
    copy_splits,
    read_rows,
    source_file,
    staged_dataset,
    validate_staged,
    write_json,
    write_manifest,
)

TONE_MARGIN_S = 0.25
# Seed 002: declared audio matches the file "±0.5 s".
DURATION_TOLERANCE_S = 0.5

SKIP_WARNING = """\
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
!! vakforge prepare --skip-redaction: {count} real conversation(s) are NOT redacted.
!! Their text, tool JSON and audio still hold whatever personal data they had. They are
!! marked meta.pii_redacted: false, meta.redaction_skipped: true. Do not publish them.
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"""


@dataclass
class Summary:
    rows: int = 0
    audio_files: int = 0
    audio_seconds: float = 0.0
    langs_set: int = 0
    langs_without_letters: int = 0
    redacted_rows: int = 0
    spans: int = 0
    toned_spans: int = 0
    skipped_redaction: list[str] = field(default_factory=list)


def _spoken(turn: dict) -> bool:
    return turn.get("speaker") in ("user", "agent") and "tool_call" not in turn and isinstance(turn.get("text"), str)


def tone_range(turn: dict, duration_s: float) -> tuple[float, float]:
    """[start_s, end_s) of the tone over a turn that said a redacted value (see the module docstring)."""
    start = max(float(turn["start"]) - TONE_MARGIN_S, 0.0)
    end = min(float(turn["end"]) + TONE_MARGIN_S, duration_s)
    return round(start, 3), round(end, 3)


def speaker_channel(record: dict, speaker: str) -> int | None:
    """The channel index of `speaker` in a dual-stream recording; None (every channel) for mono."""
    cmap = record["audio"].get("channel_map")
    if not cmap:
        return None
    return int(next(channel for channel, who in cmap.items() if who == speaker))


class Preparer:
    def __init__(self, raw_dir: Path, stage: Path, skip_redaction: bool):
        self.raw_dir, self.stage, self.skip_redaction = raw_dir, stage, skip_redaction
        self.summary = Summary()

    def row(self, row: Row) -> dict:
        record = copy.deepcopy(row.record)
        if not isinstance(record.get("locale"), str):
            raise FormatError([row.problem("locale", "required: the id of a locale pack, e.g. en-US")])
        recording = self.audio(row, record)
        record_meta = record.get("meta")
        if not isinstance(record_meta, dict):
            raise FormatError([row.problem("meta", "required: an object with source, consent, pii_redacted")])
        if record_meta.get("source") == "real":
            record = self.redact(row, record, recording)
        self.languages(row, record)
        if recording is not None:
            write_wav(self.stage / record["audio"]["path"], recording)
        self.summary.rows += 1
        return record

    # -- audio ---------------------------------------------------------------------------------

    def audio(self, row: Row, record: dict) -> Recording | None:
        audio = record.get("audio")
        if audio is None:
            return None
        if not isinstance(audio, dict):
            raise FormatError([row.problem("audio", "must be an object")])
        path = source_file(self.raw_dir, audio.get("path"), row, "audio.path")
        try:
            recording = decode(path)
        except AudioDecodeError as err:
            raise FormatError([row.problem("audio.path", str(err))]) from None
        problems = []
        if audio.get("channels") != recording.channels:
            problems.append(row.problem("audio.channels", f"declared {audio.get('channels')!r}, "
                                        f"{audio['path']} has {recording.channels}"))
        if audio.get("sample_rate") != recording.sample_rate:
            problems.append(row.problem("audio.sample_rate", f"declared {audio.get('sample_rate')!r}, "
                                        f"{audio['path']} has {recording.sample_rate}"))
        declared = audio.get("duration_s")
        if not isinstance(declared, (int, float)) or abs(declared - recording.duration_s) > DURATION_TOLERANCE_S:
            problems.append(row.problem("audio.duration_s", f"declared {declared!r}, {audio['path']} decodes to "
                                        f"{recording.duration_s:.3f} s (tolerance ±{DURATION_TOLERANCE_S} s)"))
        cmap = audio.get("channel_map")
        if recording.channels == 2 and (not isinstance(cmap, dict) or sorted(cmap.items()) not in (
                [("0", "agent"), ("1", "user")], [("0", "user"), ("1", "agent")])):
            problems.append(row.problem("audio.channel_map", 'a 2-channel file needs one user and one agent channel, '
                                        'e.g. {"0": "user", "1": "agent"}'))
        if recording.channels == 1 and cmap is not None:
            problems.append(row.problem("audio.channel_map", "a mono file has no channel map"))
        if recording.channels > 2:
            problems.append(row.problem("audio.channels", f"{recording.channels} channels: vakforge audio is "
                                        "mono (mixed) or stereo (user and agent)"))
        if problems:
            raise FormatError(problems)
        recording = resample(recording, TARGET_RATE)
        out = {"path": f"audio/{row.id}.wav", "sample_rate": TARGET_RATE, "channels": recording.channels}
        if cmap is not None:
            out["channel_map"] = cmap
        out["duration_s"] = round(recording.duration_s, 6)
        if "condition" in audio:
            out["condition"] = audio["condition"]
        record["audio"] = out
        (self.stage / "audio").mkdir(exist_ok=True)
        self.summary.audio_files += 1
        self.summary.audio_seconds += recording.duration_s
        return recording

    # -- redaction -----------------------------------------------------------------------------

    def redact(self, row: Row, record: dict, recording: Recording | None) -> dict:
        record_meta = record["meta"]
        if self.skip_redaction:
            record_meta["pii_redacted"] = False
            record_meta.pop("redaction_log", None)
            record_meta["redaction_skipped"] = True
            self.summary.skipped_redaction.append(row.id)
            return record
        from data_pipeline.vakforge.redact import redact_record

        earlier = self.earlier_spans(row, record_meta)
        try:
            redacted, spans = redact_record(record, record["locale"])
        except ValueError as err:  # RedactionError or an unknown locale: field, type and range, never a value
            raise FormatError([row.problem("locale" if "locale" in str(err)[:7] else "record", str(err))]) from None
        for span in spans:
            turn_index = span.get("turn")
            if span.get("field") == "text" and turn_index is not None and recording is not None:
                turn = record["turns"][turn_index]
                start_s, end_s = tone_range(turn, recording.duration_s)
                lay_tone(recording, start_s, end_s, channel=speaker_channel(record, turn["speaker"]))
                span["audio"] = {"start_s": start_s, "end_s": end_s, "method": "tone"}
                self.summary.toned_spans += 1
        log_name = f"redactions/{row.id}.json"
        write_json(self.stage / log_name, {"conversation_id": row.id, "spans": earlier + spans})
        redacted["meta"]["pii_redacted"] = True
        redacted["meta"]["redaction_log"] = log_name
        redacted["meta"].pop("redaction_skipped", None)
        self.summary.redacted_rows += 1
        self.summary.spans += len(spans)
        return redacted

    def earlier_spans(self, row: Row, record_meta: dict) -> list[dict]:
        """Spans of the log the input names (an earlier redaction), so a re-run keeps them."""
        if record_meta.get("redaction_log") is None:
            return []
        path = source_file(self.raw_dir, record_meta["redaction_log"], row, "meta.redaction_log")
        try:
            log = json.loads(path.read_text(encoding="utf-8"))
            spans = log["spans"]
            if not isinstance(spans, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise FormatError([row.problem("meta.redaction_log",
                                           f"{record_meta['redaction_log']} is not a JSON object with a spans list")]) from None
        return spans

    # -- languages -----------------------------------------------------------------------------

    def languages(self, row: Row, record: dict) -> None:
        from data_pipeline.vakforge.language import UndeterminedLanguage, detect_lang

        locale = record.get("locale")
        for i, turn in enumerate(record.get("turns") or ()):
            if not isinstance(turn, dict) or not _spoken(turn):
                continue
            try:
                turn["lang"] = detect_lang(turn["text"], locale)
                self.summary.langs_set += 1
            except UndeterminedLanguage:
                # No letters to judge ("4821."): keep what the transcript said, else the primary language.
                if turn.get("lang") is None:
                    primary = (record.get("language") or {}).get("primary")
                    if primary is None:
                        raise FormatError([row.problem(f"turns[{i}].lang", "has no letters to detect a language "
                                                       "from, and language.primary is missing")]) from None
                    turn["lang"] = primary
                self.summary.langs_without_letters += 1
            except ValueError as err:  # an unknown locale; the message names the registered packs
                raise FormatError([row.problem("locale", str(err))]) from None


def prepare(raw_dir: Path, manifest: Path, out: Path, skip_redaction: bool = False,
            allow_unconsented: bool = False) -> Summary:
    rows = read_rows(manifest)
    check_out(out, [raw_dir])
    with staged_dataset(out) as stage:
        preparer = Preparer(raw_dir, stage, skip_redaction)
        records = [preparer.row(row) for row in rows]
        write_manifest(stage, records)
        has_splits = copy_splits(manifest, stage, "prepare")
        validate_staged(stage, rows, has_splits, allow_unconsented)
    return preparer.summary


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: multi-word flags through `cli_flags.add_flag` (hyphens, or underscores)."""
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.vakforge prepare",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("raw_dir", metavar="RAW_DIR", type=Path, help="the uploads; never modified")
    parser.add_argument("--manifest", required=True, type=Path, metavar="IN",
                        help="input manifest; its paths are relative to RAW_DIR")
    parser.add_argument("--out", required=True, type=Path, metavar="DATA_DIR", help="a new folder for the dataset")
    add_flag(parser, "--skip-redaction", action="store_true",
             help="do not redact real rows (a loud warning; rows are marked redaction_skipped)")
    add_flag(parser, "--allow-unconsented", action="store_true",
             help='accept meta.consent "none" (excluded from any published artifact)')
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = prepare(args.raw_dir, args.manifest, args.out, args.skip_redaction, args.allow_unconsented)
    except FormatError as err:
        for problem in err.problems:
            print(problem, file=sys.stderr)
        print(f"prepare: nothing written to {args.out}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"prepare: {err}; nothing written to {args.out}", file=sys.stderr)
        return 1
    if summary.skipped_redaction:
        print(SKIP_WARNING.format(count=len(summary.skipped_redaction)), file=sys.stderr)
    print(f"prepare: {summary.rows} rows, {summary.audio_files} audio files ({summary.audio_seconds:.1f} s) at "
          f"24 kHz, {summary.langs_set} turn languages detected ({summary.langs_without_letters} turns without "
          f"letters kept their lang or took language.primary), {summary.redacted_rows} rows redacted ({summary.spans} spans, "
          f"{summary.toned_spans} toned), {len(summary.skipped_redaction)} rows with redaction skipped → {args.out}")
    return 0
