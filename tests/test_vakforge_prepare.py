"""`vakforge prepare` on raw uploads made here: eSpeak NG speech plus noise at 44.1, 48, 16 and 22.05 kHz,
as WAV, FLAC, Ogg Vorbis and MP3, one real conversation carrying a phone number and an e-mail address."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile

from data_pipeline import validate
from data_pipeline.vakforge import prepare
from data_pipeline.vakforge.audio import Recording, decode, read_wav_pcm16, resample, to_pcm16, tone
from data_pipeline.vakforge.espeak import ESpeak, Voice

PHONE, EMAIL = "98765 43210", "asha.k@example.com"
# Every spelling of the personal data that must not reach an output file, stdout, stderr or a log.
PII_VALUES = (PHONE, PHONE.replace(" ", ""), EMAIL, "asha.k")

REAL_TURNS = [
    ("agent", "Hello, this is Kaveri Bank support. How can I help you today?"),
    ("user", f"Please update my details. My number is {PHONE} and my email is {EMAIL}."),
    ("agent", "Thank you, I have updated both of them."),
]
SYNTH_TURNS = [("agent", "Good morning, your parcel is on its way."), ("user", "Great, thanks a lot.")]
# (id, sample rate, channels, file name, soundfile format/subtype)
UPLOADS = [
    ("conv_real_0001", 44100, 2, "call_0001.wav", ("WAV", "PCM_16")),
    ("conv_syn_0002", 48000, 1, "call_0002.flac", ("FLAC", "PCM_24")),
    ("conv_syn_0003", 16000, 2, "call_0003.ogg", ("OGG", "VORBIS")),
    ("conv_syn_0004", 22050, 1, "call_0004.mp3", ("MP3", "MPEG_LAYER_III")),
]


def _render(turns, rate: int, channels: int, seed: int) -> tuple[np.ndarray, list[dict]]:
    """Speech of each turn on its speaker's channel (or the one channel), noise under it, and the turn times."""
    engine = ESpeak.engine()
    clips, timed, clock = [], [], 0.3
    for speaker, text in turns:
        voice = Voice("en", "f2" if speaker == "agent" else "m3", 65 if speaker == "agent" else 35)
        speech = resample(Recording(engine.speak(text, voice)[:, None], engine.sample_rate), rate).samples[:, 0]
        first = round(clock * rate)
        clips.append((0 if speaker == "user" or channels == 1 else 1, first, speech))
        end = round((first + len(speech)) / rate, 3)
        timed.append({"speaker": speaker, "start": round(clock, 3), "end": end, "text": text})
        clock = end + 0.2
    length = round((clock + 0.3) * rate)
    samples = np.random.default_rng(seed).standard_normal((length, channels)).astype(np.float32) * 0.003
    for channel, first, speech in clips:
        samples[first:first + len(speech), channel] += speech * 0.8
    return samples, timed


def _record(cid: str, rate: int, channels: int, name: str, turns: list[dict], real: bool) -> dict:
    audio = {"path": f"uploads/{name}", "sample_rate": rate, "channels": channels}
    if channels == 2:
        audio["channel_map"] = {"0": "user", "1": "agent"}
    record = {"id": cid, "schema_version": "0.1", "audio": audio, "locale": "en-IN",
              "language": {"primary": "en-IN", "mix": ["en", "hi"]}, "turns": turns}
    if real:
        user = turns[1]
        user["entities"] = [{"type": "phone", "text": PHONE, "start_char": user["text"].index(PHONE),
                             "end_char": user["text"].index(PHONE) + len(PHONE)}]
        record["tools"] = [{"name": "update_contact", "parameters": {
            "type": "object", "properties": {"phone": {"type": "string"}, "email": {"type": "string"}}}}]
        at = turns[1]["end"]
        turns[2:2] = [
            {"speaker": "agent", "start": at, "end": at,
             "tool_call": {"id": "call_1", "name": "update_contact", "arguments": {"phone": PHONE, "email": EMAIL}}},
            {"speaker": "tool", "start": at, "end": at, "tool_result": {"id": "call_1", "content": {"ok": True}}},
        ]
        record["meta"] = {"source": "real", "consent": "recorded_verbal", "consent_ref": "policy-v3-2026",
                          "voice_consent_ref": "voice-consent-v1-2026", "pii_redacted": False}
    else:
        record["meta"] = {"source": "synthetic", "consent": "synthetic", "pii_redacted": False}
    return record


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("raw")
    (folder / "uploads").mkdir()
    records = []
    for k, (cid, rate, channels, name, (fmt, subtype)) in enumerate(UPLOADS):
        real = cid.startswith("conv_real")
        samples, turns = _render(REAL_TURNS if real else SYNTH_TURNS, rate, channels, seed=k)
        soundfile.write(folder / "uploads" / name, samples, rate, format=fmt, subtype=subtype)
        record = _record(cid, rate, channels, name, turns, real)
        record["audio"]["duration_s"] = round(decode(folder / "uploads" / name).duration_s, 3)
        records.append(record)
    (folder / "vakforge.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    splits = {"seed": 7, "splits": {"train": [r["id"] for r in records[:3]], "test": [records[3]["id"]]}}
    (folder / "splits.json").write_text(json.dumps(splits))
    return folder


class _Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


def _run(*argv: str) -> tuple[int, str]:
    """prepare's exit status and everything it printed or logged (stdout, stderr, any logger)."""
    out, err, handler = io.StringIO(), io.StringIO(), _Captured()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = prepare.main(list(argv))
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    return status, out.getvalue() + err.getvalue() + "\n".join(handler.lines)


@pytest.fixture(scope="module")
def prepared(raw, tmp_path_factory) -> dict:
    before = _tree(raw)
    base = tmp_path_factory.mktemp("prepared")
    first, again, skipped = base / "data", base / "again", base / "skipped"
    runs = {
        "first": _run(str(raw), f"--manifest={raw / 'vakforge.jsonl'}", f"--out={first}"),
        "again": _run(str(first), f"--manifest={first / 'vakforge.jsonl'}", f"--out={again}"),
        "skipped": _run(str(raw), f"--manifest={raw / 'vakforge.jsonl'}", f"--out={skipped}", "--skip-redaction"),
    }
    assert {name: status for name, (status, _) in runs.items()} == {"first": 0, "again": 0, "skipped": 0}, runs
    return {"raw_before": before, "first": first, "again": again, "skipped": skipped,
            "printed": {name: text for name, (_, text) in runs.items()}}


def _rows(folder: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (folder / "vakforge.jsonl").read_text(encoding="utf-8").splitlines())}


def test_outputs_validate_with_the_validate_cli(prepared, capsys):
    # validate.main is `python -m data_pipeline.validate` without a second interpreter's imports
    # (tests/test_vakforge_synth.py runs the CLI as a process).
    manifests = [str(prepared[k] / "vakforge.jsonl") for k in ("first", "again", "skipped")]
    assert validate.main(["--format=vakforge", *manifests]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.count("4 conversations OK") == 3


def test_a_skipped_row_cannot_also_claim_redaction(prepared, tmp_path, capsys):
    folder = tmp_path / "data"
    shutil.copytree(prepared["skipped"], folder)
    rows = (folder / "vakforge.jsonl").read_text(encoding="utf-8").splitlines()
    rows[0] = rows[0].replace('"pii_redacted": false', '"pii_redacted": true')
    (folder / "vakforge.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert validate.main(["--format=vakforge", str(folder / "vakforge.jsonl")]) == 1
    assert "id=conv_real_0001: meta.pii_redacted: must be false when redaction_skipped is true" in capsys.readouterr().err


def test_resampling_to_24k_is_exact_in_length_and_keeps_channels(raw, prepared):
    rows = _rows(prepared["first"])
    for cid, rate, channels, name, _ in UPLOADS:
        source = decode(raw / "uploads" / name)
        pcm, out_rate = read_wav_pcm16(prepared["first"] / f"audio/{cid}.wav")
        expected = source.samples.shape[0] * 24000 / rate
        # Within 1 sample per second of audio (the bound); soxr gives round(expected) exactly.
        assert abs(pcm.shape[0] - expected) <= max(1.0, source.duration_s), (name, pcm.shape[0], expected)
        assert pcm.shape[0] == round(expected)
        assert out_rate == 24000 and pcm.shape[1] == channels
        audio = rows[cid]["audio"]
        assert audio == {**audio, "path": f"audio/{cid}.wav", "sample_rate": 24000, "channels": channels}
        assert audio["duration_s"] == pytest.approx(pcm.shape[0] / 24000, abs=1e-6)


def test_raw_dir_is_untouched(raw, prepared):
    assert _tree(raw) == prepared["raw_before"]


def test_turn_languages_are_detected(prepared):
    for row in _rows(prepared["first"]).values():
        for turn in row["turns"]:
            if "text" in turn:
                assert turn["lang"] == "en-IN"


def test_real_row_is_redacted_and_the_values_appear_nowhere(prepared):
    row = _rows(prepared["first"])["conv_real_0001"]
    meta = row["meta"]
    assert meta["pii_redacted"] is True and meta["redaction_log"] == "redactions/conv_real_0001.json"
    user = row["turns"][1]
    assert "<PHONE_1>" in user["text"] and "<EMAIL_1>" in user["text"]
    assert row["turns"][2]["tool_call"]["arguments"] == {"phone": "<PHONE_1>", "email": "<EMAIL_1>"}
    for folder in ("first", "again"):
        for name, data in _tree(prepared[folder]).items():
            for value in PII_VALUES:
                assert value.encode() not in data, (folder, name)
    for name in ("first", "again"):
        for value in PII_VALUES:
            assert value not in prepared["printed"][name]


def test_the_tone_covers_the_turn_that_said_the_value_on_its_speakers_channel_only(raw, prepared):
    row = _rows(prepared["first"])["conv_real_0001"]
    log = json.loads((prepared["first"] / row["meta"]["redaction_log"]).read_text())
    spoken = [s for s in log["spans"] if s["field"] == "text"]
    assert sorted(s["type"] for s in spoken) == ["email", "phone"]
    turn = _rows(raw)["conv_real_0001"]["turns"][1]
    margin = prepare.TONE_MARGIN_S
    for s in spoken:
        assert s["turn"] == 1
        assert s["audio"] == {"start_s": round(turn["start"] - margin, 3), "end_s": round(turn["end"] + margin, 3),
                              "method": "tone"}
    pcm, rate = read_wav_pcm16(prepared["first"] / "audio/conv_real_0001.wav")
    reference = to_pcm16(resample(decode(raw / "uploads/call_0001.wav")).samples)
    audio = spoken[0]["audio"]
    first, last = int(np.floor(audio["start_s"] * rate)), int(np.ceil(audio["end_s"] * rate))
    user = 0  # channel_map {"0": "user", "1": "agent"}
    assert np.array_equal(pcm[first:last, user], to_pcm16(tone(last - first, rate, first)))
    untouched = np.ones(len(pcm), bool)
    untouched[first:last] = False
    assert np.array_equal(pcm[untouched], reference[untouched])
    assert np.array_equal(pcm[:, 1], reference[:, 1])  # the agent's leg keeps every sample


def test_rerunning_prepare_on_its_output_changes_nothing(prepared):
    assert _tree(prepared["first"]) == _tree(prepared["again"])


def test_skip_redaction_warns_loudly_and_marks_the_rows(prepared):
    assert "NOT redacted" in prepared["printed"]["skipped"]
    rows = _rows(prepared["skipped"])
    meta = rows["conv_real_0001"]["meta"]
    assert meta["pii_redacted"] is False and meta["redaction_skipped"] is True and "redaction_log" not in meta
    assert PHONE in rows["conv_real_0001"]["turns"][1]["text"]  # left as it was, as asked
    assert all("redaction_skipped" not in r["meta"] for cid, r in rows.items() if cid != "conv_real_0001")


def _broken_raw(raw: Path, tmp_path: Path, change) -> Path:
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "uploads").symlink_to(raw / "uploads")
    rows = [json.loads(line) for line in (raw / "vakforge.jsonl").read_text().splitlines()]
    change(rows)
    (folder / "vakforge.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.parametrize(("change", "expected"), [
    (lambda rows: rows[1]["audio"].update(channels=2, channel_map={"0": "user", "1": "agent"}),
     ":2: id=conv_syn_0002: audio.channels: declared 2, uploads/call_0002.flac has 1"),
    (lambda rows: rows[2]["audio"].update(channel_map={"0": "agent", "1": "agent"}),
     ":3: id=conv_syn_0003: audio.channel_map: a 2-channel file needs one user and one agent channel"),
    (lambda rows: rows[3]["audio"].update(path="uploads/missing.wav"),
     ":4: id=conv_syn_0004: audio.path: file not found: uploads/missing.wav"),
    (lambda rows: rows[0]["audio"].update(path="../outside.wav"),
     ":1: id=conv_real_0001: audio.path: must not contain a .. segment"),
])
def test_bad_input_names_file_line_and_field_and_writes_nothing(raw, tmp_path, change, expected):
    folder = _broken_raw(raw, tmp_path, change)
    out = tmp_path / "out"
    status, printed = _run(str(folder), f"--manifest={folder / 'vakforge.jsonl'}", f"--out={out}")
    assert status == 1
    assert f"{folder / 'vakforge.jsonl'}{expected}" in printed
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def test_an_upload_that_does_not_decode_is_named(raw, tmp_path):
    folder = _broken_raw(raw, tmp_path, lambda rows: rows[1]["audio"].update(path="notes.wav"))
    (folder / "notes.wav").write_text("not audio")
    status, printed = _run(str(folder), f"--manifest={folder / 'vakforge.jsonl'}", "--out=" + str(tmp_path / "o"))
    assert status == 1 and f":2: id=conv_syn_0002: audio.path: {folder / 'notes.wav'}: does not decode" in printed


def test_out_inside_the_raw_dir_is_refused(raw):
    with pytest.raises(SystemExit, match="overlaps the input folder"):
        prepare.main([str(raw), f"--manifest={raw / 'vakforge.jsonl'}", f"--out={raw / 'prepared'}"])
    assert not (raw / "prepared").exists()
