"""The registry publishes no vakforge row seed 002 keeps out of published artifacts: `meta.consent:
"none"` and rows `prepare --skip-redaction` marked `meta.redaction_skipped`. Real registry (SQLite
index, local blob directory), real smoke dataset (audio, redaction logs, splits.json)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from data_pipeline.format_registry import FORMATS
from data_pipeline.registry import RegistryError, open_registry
from data_pipeline.registry.__main__ import main

SMOKE = Path(__file__).resolve().parents[1] / "data" / "smoke" / "vakforge"
TABLES = ("datasets", "versions", "aliases", "blobs")


def _smoke_rows() -> list[dict]:
    return [json.loads(line) for line in (SMOKE / "vakforge.jsonl").read_text().splitlines() if line.strip()]


def _derived(rows: list[dict], origin: str, new_id: str, meta: dict) -> dict:
    """A copy of smoke row `origin` under `new_id`: same split and speakers, so splits stay leak-free."""
    row = copy.deepcopy(next(r for r in rows if r["id"] == origin))
    row["id"] = new_id
    row["meta"] = {**meta, "speakers": row["meta"]["speakers"], "split": row["meta"]["split"]}
    return row


def _write_dataset(folder: Path, rows: list[dict]) -> Path:
    """The smoke dataset's files (audio, redaction logs) with these rows and a splits.json naming them."""
    shutil.copytree(SMOKE, folder)
    manifest = folder / "vakforge.jsonl"
    manifest.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    splits = json.loads((SMOKE / "splits.json").read_text())
    for row in rows:
        ids = splits["splits"][row["meta"]["split"]]
        if row["id"] not in ids:
            ids.append(row["id"])
    (folder / "splits.json").write_text(json.dumps(splits, indent=2) + "\n")
    return manifest


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> tuple[Path, Path]:
    """(clean, unpublishable): the smoke rows; the same with an unconsented row at line 3 and a row
    left unredacted at line 7."""
    root = tmp_path_factory.mktemp("publishable")
    rows = _smoke_rows()
    unconsented = _derived(rows, "conv_en_gb_0003", "conv_en_gb_0006",
                           {"source": "public", "consent": "none", "pii_redacted": False})
    unredacted = _derived(rows, "conv_en_in_0005", "conv_en_in_0007",
                          {"source": "real", "consent": "written", "consent_ref": "chat-terms-2026-02",
                           "pii_redacted": False, "redaction_skipped": True})
    dirty = rows[:2] + [unconsented] + rows[2:] + [unredacted]
    return _write_dataset(root / "clean", rows), _write_dataset(root / "dirty", dirty)


def _state(registry) -> tuple:
    """Everything the registry holds: every index row, and every file of the blob store."""
    rows = tuple(tuple(sorted(registry.index.read(f"SELECT * FROM {table}"))) for table in TABLES)
    blobs = Path(registry.blobs.root)
    files = tuple(sorted(str(p.relative_to(blobs)) for p in blobs.rglob("*"))) if blobs.exists() else ()
    return rows, files


def test_unpublishable_rows_are_refused_one_line_each_and_nothing_is_written(datasets, tmp_path, capsys):
    clean, dirty = datasets
    # The rows are well-formed: consent "none" passes the validator when it is allowed, and a
    # redaction_skipped row always does. Only publishing refuses them.
    assert FORMATS["vakforge"].validate(dirty, True, allow_unconsented=True) == "7 conversations OK"

    registry = open_registry(str(tmp_path / "registry"))
    empty = _state(registry)
    assert empty == (((),) * len(TABLES), ())
    with pytest.raises(RegistryError) as refused:
        registry.register("calls/support", dirty, "vakforge", alias="candidate")
    lines = str(refused.value).splitlines()
    assert lines[0] == f"{dirty}: 2 rows may not be published (seed 002); nothing was registered:"
    assert len(lines) == 3
    consent, redaction = lines[1:]
    assert consent.startswith(f"{dirty}:3: id=conv_en_gb_0006: meta.consent: \"none\": ")
    assert "excluded from any published artifact" in consent and "drop the row" in consent
    assert redaction.startswith(f"{dirty}:7: id=conv_en_in_0007: meta.redaction_skipped: true: ")
    assert "without --skip-redaction" in redaction and "drop the row" in redaction
    # One place says why: not the validator's hint about a flag register does not have.
    assert "--allow-unconsented" not in str(refused.value)
    assert _state(registry) == empty
    assert registry.blobs.uploaded_bytes == 0

    # The same manifest without those rows registers, and reads back as the same dataset.
    v1 = registry.register("calls/support", clean, "vakforge")
    assert (v1.reference, v1.new) == ("calls/support:v1", True)
    assert FORMATS["vakforge"].validate(v1.path, True) == "5 conversations OK"

    # A registry that holds data is left exactly as it was, and so is its version list, through
    # the library and the command line alike (exit 1, the rows on stderr), --no-upload included.
    held, uploaded = _state(registry), registry.blobs.uploaded_bytes
    with pytest.raises(RegistryError, match="2 rows may not be published"):
        registry.register("calls/support", dirty, "vakforge", alias="candidate")
    for extra in ([], ["--no-upload"]):
        assert main([f"--registry={tmp_path / 'registry'}", "datasets", "register", "calls/support",
                     "-f", str(dirty), "--format=vakforge", *extra]) == 1
        err = capsys.readouterr().err.splitlines()
        assert err[0] == f"error: {dirty}: 2 rows may not be published (seed 002); nothing was registered:"
        assert err[1:] == [consent, redaction]
    assert _state(registry) == held and registry.blobs.uploaded_bytes == uploaded
    assert [row["reference"] for row in registry.versions("calls/support")] == ["calls/support:v1"]


def test_a_row_unconsented_and_unredacted_gets_both_reasons(tmp_path):
    rows = _smoke_rows()
    both = _derived(rows, "conv_en_in_0005", "conv_en_in_0008",
                    {"source": "real", "consent": "none", "pii_redacted": False, "redaction_skipped": True})
    manifest = _write_dataset(tmp_path / "both", [rows[4], both])
    # splits.json must name only this manifest's rows.
    splits = json.loads((manifest.parent / "splits.json").read_text())
    splits["splits"] = {name: [i for i in ids if i in ("conv_en_in_0005", "conv_en_in_0008")]
                        for name, ids in splits["splits"].items()}
    (manifest.parent / "splits.json").write_text(json.dumps(splits))
    registry = open_registry(str(tmp_path / "registry"))
    with pytest.raises(RegistryError) as refused:
        registry.register("calls/both", manifest, "vakforge")
    lines = str(refused.value).splitlines()
    assert lines[0] == f"{manifest}: 1 row may not be published (seed 002); nothing was registered:"
    assert [line.split(": ", 3)[:3] for line in lines[1:]] == [
        [f"{manifest}:2", "id=conv_en_in_0008", "meta.consent"],
        [f"{manifest}:2", "id=conv_en_in_0008", "meta.redaction_skipped"],
    ]
    assert registry.list("calls") == []
