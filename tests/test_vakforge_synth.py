"""`vakforge synth` on the smoke manifest: eSpeak NG speech for rows without audio, validated output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.vakforge import synth
from data_pipeline.vakforge.audio import decode

SMOKE = Path(__file__).resolve().parents[1] / "data" / "smoke" / "vakforge"


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "data"
    assert synth.main([f"--manifest={SMOKE / 'vakforge.jsonl'}", f"--out={out}"]) == 0
    return out


def _rows(manifest: Path) -> dict[str, dict]:
    return {row["id"]: row for row in map(json.loads, manifest.read_text(encoding="utf-8").splitlines())}


def test_output_validates_with_the_validate_cli(synthesized):
    result = subprocess.run(
        [sys.executable, "-m", "data_pipeline.validate", "--format=vakforge", str(synthesized / "vakforge.jsonl")],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "5 conversations OK" in result.stdout


def test_rows_without_audio_get_stereo_speech_with_rendered_turn_times(synthesized):
    before, after = _rows(SMOKE / "vakforge.jsonl"), _rows(synthesized / "vakforge.jsonl")
    rendered = [cid for cid, row in before.items() if "audio" not in row]
    assert rendered == ["conv_en_gb_0003", "conv_en_in_0005"]
    for cid in rendered:
        row = after[cid]
        audio = row["audio"]
        assert audio["channels"] == 2 and audio["channel_map"] == {"0": "user", "1": "agent"}
        assert row["meta"]["source"] == "synthetic"
        assert row["meta"]["consent"] == before[cid]["meta"]["consent"]  # the text's consent travels
        recording = decode(synthesized / audio["path"])
        assert recording.sample_rate == 24000 and recording.channels == 2
        assert recording.duration_s == pytest.approx(audio["duration_s"], abs=1e-6)
        spoken = [t for t in row["turns"] if "text" in t]
        assert [t["text"] for t in spoken] == [t["text"] for t in before[cid]["turns"] if "text" in t]
        for turn in spoken:
            assert turn["end"] - turn["start"] > 0.3  # rendered speech, not the input's times
            first, last = round(turn["start"] * 24000), round(turn["end"] * 24000)
            own = 0 if turn["speaker"] == "user" else 1
            segment = recording.samples[first:last]
            # The speaker's own channel carries the speech; the other is silent unless another turn overlaps.
            assert np.sqrt(np.mean(segment[:, own] ** 2)) > 0.02
            if not any(t is not turn and t["start"] < turn["end"] and t["end"] > turn["start"] for t in spoken):
                assert np.abs(segment[:, 1 - own]).max() == 0


def test_rows_with_audio_are_copied_unchanged(synthesized):
    before, after = _rows(SMOKE / "vakforge.jsonl"), _rows(synthesized / "vakforge.jsonl")
    for cid, row in before.items():
        if "audio" in row:
            assert after[cid] == row
            assert (synthesized / row["audio"]["path"]).read_bytes() == (SMOKE / row["audio"]["path"]).read_bytes()


def test_user_and_agent_voices_differ():
    assert synth.voice_for("en-IN", "user") != synth.voice_for("en-IN", "agent")
    assert synth.voice_for("en-US", "agent").name == "en-us" and synth.voice_for("zh-CN", "user").name == "cmn"


def test_an_unredacted_real_row_is_refused_and_nothing_is_written(tmp_path, capsys):
    rows = _rows(SMOKE / "vakforge.jsonl")
    row = rows["conv_en_in_0005"]
    row["meta"] = {**row["meta"], "pii_redacted": False}
    manifest = tmp_path / "in" / "vakforge.jsonl"
    manifest.parent.mkdir()
    manifest.write_text(json.dumps(row) + "\n", encoding="utf-8")
    (manifest.parent / "redactions").mkdir()
    (manifest.parent / "redactions" / "conv_en_in_0005.json").write_text('{"spans": []}')
    out = tmp_path / "out"
    assert synth.main([f"--manifest={manifest}", f"--out={out}"]) == 1
    err = capsys.readouterr().err
    assert f"{manifest}:1: id=conv_en_in_0005: meta.pii_redacted: a real row must be redacted" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_an_overlapping_turn_stays_overlapping_in_its_own_language_voice(tmp_path):
    # conv_en_us_0001 without its recording: its last turn (Spanish) overlaps the agent's.
    row = _rows(SMOKE / "vakforge.jsonl")["conv_en_us_0001"]
    del row["audio"]
    manifest = tmp_path / "in" / "vakforge.jsonl"
    manifest.parent.mkdir()
    manifest.write_text(json.dumps(row) + "\n", encoding="utf-8")
    (manifest.parent / "splits.json").write_text(json.dumps({"seed": 1, "splits": {"train": [row["id"]]}}))
    assert synth.main([f"--manifest={manifest}", f"--out={tmp_path / 'out'}"]) == 0
    turns = _rows(tmp_path / "out" / "vakforge.jsonl")["conv_en_us_0001"]["turns"]
    last, agent = turns[-1], turns[-2]
    assert last["overlap"] is True and last["lang"] == "es-US" and agent["start"] < last["start"] < agent["end"]
    assert synth.voice_for(last["lang"], "user").name == "es"
