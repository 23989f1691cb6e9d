"""`python -m data_pipeline.vakforge split`: speaker-disjoint, seeded splits.json the reader accepts."""

import copy
import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from data_pipeline.formats.errors import FormatError
from data_pipeline.formats.vakforge import read_vakforge
from data_pipeline.formats.vakforge_splits import check_splits
from data_pipeline.split import SplitError
from data_pipeline.vakforge.__main__ import main as vakforge_main
from data_pipeline.vakforge.split import split_manifest

SMOKE = Path(__file__).resolve().parents[1] / "data" / "smoke" / "vakforge"
FRACTIONS = {"train": 0.6, "dev": 0.2, "test": 0.2}


def _smoke_records() -> list[dict]:
    return [json.loads(line) for line in (SMOKE / "vakforge.jsonl").read_text(encoding="utf-8").splitlines()]


def _write(folder: Path, records: list[dict]) -> Path:
    manifest = folder / "vakforge.jsonl"
    manifest.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return manifest


@pytest.fixture
def dataset(tmp_path) -> Path:
    """48 synthetic conversations, no meta.split: 8 agent voices, 20 customers who call two or three
    times and reach two agents (voice_i and voice_i+4), so speakers chain conversations into 4 groups;
    every 8th conversation names only its customer, 4 name no speaker (each its own group)."""
    folder = tmp_path / "data"
    shutil.copytree(SMOKE, folder)
    (folder / "splits.json").unlink()
    templates = [r for r in _smoke_records() if r["meta"]["source"] == "synthetic"]
    records = []
    for k in range(48):
        record = copy.deepcopy(templates[k % len(templates)])
        record["id"] = f"conv_{k:04d}"
        record["meta"].pop("split", None)
        record["meta"]["speakers"] = {"agent": f"voice_{k % 8}", "user": f"cust_{k % 20}"}
        if k % 8 == 0:
            del record["meta"]["speakers"]["agent"]  # a customer-only conversation
        if k % 12 == 11:
            del record["meta"]["speakers"]
        records.append(record)
    return _write(folder, records)


def _speaker_splits(manifest: Path, splits: dict) -> dict[str, set[str]]:
    where = {cid: name for name, ids in splits["splits"].items() for cid in ids}
    seen = defaultdict(set)
    for record in map(json.loads, manifest.read_text(encoding="utf-8").splitlines()):
        for speaker in (record["meta"].get("speakers") or {}).values():
            seen[speaker].add(where[record["id"]])
    return seen


def test_speaker_disjoint_and_accepted_by_check_splits(dataset):
    summary = split_manifest(dataset, FRACTIONS, seed=7)
    splits = json.loads((dataset.parent / "splits.json").read_text())
    assert splits["seed"] == 7 and list(splits["splits"]) == ["train", "dev", "test"]
    assert sorted(cid for ids in splits["splits"].values() for cid in ids) == [f"conv_{k:04d}" for k in range(48)]
    assert all(len(names) == 1 for names in _speaker_splits(dataset, splits).values())
    convs = read_vakforge(dataset, check_media=False)
    lines = list(enumerate(convs, 1))
    _, problems = check_splits(dataset.parent / "splits.json", str(dataset),
                               [(n, c.id) for n, c in lines], lines)
    assert problems == []
    assert summary["groups"] == 8  # 4 chained speaker groups and 4 conversations without speakers
    assert sum(s["conversations"] for s in summary["splits"].values()) == 48
    assert summary["without_speakers"] == 4


def test_fractions_are_tracked_to_within_one_group(dataset):
    largest = 11  # the 4 speaker groups hold 11 conversations each (12 less the one without speakers)
    for seed in range(4):
        split_manifest(dataset, {"train": 0.5, "test": 0.5}, seed=seed)
        splits = json.loads((dataset.parent / "splits.json").read_text())
        assert abs(len(splits["splits"]["train"]) - 24) <= largest


def test_deterministic_for_a_seed_and_different_across_seeds(dataset):
    target = dataset.parent / "splits.json"
    split_manifest(dataset, FRACTIONS, seed=11)
    first = target.read_bytes()
    split_manifest(dataset, FRACTIONS, seed=11)
    assert target.read_bytes() == first
    others = []
    for seed in (12, 13, 14):
        split_manifest(dataset, FRACTIONS, seed=seed)
        others.append(json.loads(target.read_text())["splits"])
    assert any(other != json.loads(first)["splits"] for other in others)


def test_stated_meta_split_is_kept_with_its_speaker_group(dataset):
    records = [json.loads(line) for line in dataset.read_text().splitlines()]
    records[5]["meta"]["split"] = "test"  # conv_0005: voice_5, cust_5
    _write(dataset.parent, records)
    for seed in (1, 2, 3):
        summary = split_manifest(dataset, FRACTIONS, seed=seed)
        splits = json.loads((dataset.parent / "splits.json").read_text())
        assert "conv_0005" in splits["splits"]["test"]
        assert _speaker_splits(dataset, splits)["voice_5"] == {"test"}
        assert summary["fixed_groups"] == 1


def test_two_stated_splits_in_one_speaker_group_are_refused(dataset):
    records = [json.loads(line) for line in dataset.read_text().splitlines()]
    records[5]["meta"]["split"] = "test"
    records[13]["meta"]["split"] = "train"  # conv_0013 shares voice_5 with conv_0005
    _write(dataset.parent, records)
    with pytest.raises(FormatError, match=r"id=conv_0013: meta.speakers.agent: this speaker is in split 'train'"):
        split_manifest(dataset, FRACTIONS, seed=1)
    assert not (dataset.parent / "splits.json").exists()


def test_a_stated_split_outside_the_fractions_names_the_line(dataset):
    records = [json.loads(line) for line in dataset.read_text().splitlines()]
    records[2]["meta"]["split"] = "holdout"
    _write(dataset.parent, records)
    with pytest.raises(SplitError, match=r"vakforge.jsonl:3: id=conv_0002: meta.split: 'holdout' is not one of"):
        split_manifest(dataset, FRACTIONS, seed=1)


def test_invalid_manifest_is_reported_by_the_reader_before_any_split(dataset):
    lines = dataset.read_text().splitlines()
    broken = json.loads(lines[3])
    broken["turns"][0]["lang"] = "fr"
    _write(dataset.parent, [json.loads(line) for line in lines[:3]] + [broken])
    with pytest.raises(FormatError, match=r"vakforge.jsonl:4: id=conv_0003: turns\[0\].lang"):
        split_manifest(dataset, FRACTIONS, seed=1)
    assert not (dataset.parent / "splits.json").exists()


def test_too_few_groups(dataset):
    records = [json.loads(line) for line in dataset.read_text().splitlines()][:2]
    for record in records:
        record["meta"]["speakers"] = {"agent": "voice_0"}
    _write(dataset.parent, records)
    with pytest.raises(SplitError, match="1 speaker groups cannot fill 3 splits"):
        split_manifest(dataset, FRACTIONS, seed=1)


def test_cli_reproduces_the_smoke_splits_and_counts_conversations_without_speakers(tmp_path, capsys):
    folder = tmp_path / "smoke"
    shutil.copytree(SMOKE, folder)
    records = _smoke_records()
    del records[2]["meta"]["speakers"]
    _write(folder, records)
    rc = vakforge_main(["split", f"--manifest={folder / 'vakforge.jsonl'}", "--seed=20260916",
                        "--fractions=train=0.6,dev=0.2,test=0.2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # Every smoke conversation states meta.split, so the seed's assignment comes back exactly.
    assert json.loads((folder / "splits.json").read_text()) == json.loads((SMOKE / "splits.json").read_text())
    assert f"replaced {folder / 'splits.json'}" in out
    assert "note: 1 conversations name no speaker" in out


def test_cli_error_exit(tmp_path, capsys):
    assert vakforge_main(["split", f"--manifest={tmp_path / 'none.jsonl'}", "--seed=1"]) == 1
    assert "no such file" in capsys.readouterr().err
