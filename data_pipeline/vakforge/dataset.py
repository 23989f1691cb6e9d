"""Reading an input manifest and writing a vakforge dataset folder all at once (prepare, synth).

A dataset is written into a hidden temporary folder next to `--out`, validated there with
`read_vakforge` (the same checks as `python -m data_pipeline.validate --format=vakforge`), and only
then renamed to `--out`: a failure leaves nothing behind, never a half-written dataset. `--out`
must not exist yet (or be empty), and may not be or contain the input folder, which stays untouched
(seed 002: raw uploads are never modified).

Rows are written as `json.dumps(row, ensure_ascii=False)` with the input's key order, so the same
rows give the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from data_pipeline.formats.errors import RECORD_FIELD, FormatError, Problem
from data_pipeline.formats.jsonl import read_jsonl_objects
from data_pipeline.formats.vakforge import read_vakforge
from data_pipeline.formats.vakforge_provenance import dataset_path_problem
from data_pipeline.formats.vakforge_splits import SPLITS_FILE

MANIFEST = "vakforge.jsonl"


class Row:
    """One input line: its number, the record (a dict), and where problems about it are reported."""

    def __init__(self, source: str, line: int, record: dict):
        self.source, self.line, self.record = source, line, record

    @property
    def id(self) -> str:
        return self.record["id"]

    def problem(self, field: str, message: str) -> Problem:
        return Problem(self.source, self.line, f"id={self.id}: {field}", message)


def read_rows(manifest: Path) -> list[Row]:
    """Every line of `manifest` as a Row, or a FormatError naming each line that is not a record with an id."""
    source = str(manifest)
    problems: list[Problem] = []
    rows = []
    for line, obj in read_jsonl_objects(manifest, source, problems):
        if not isinstance(obj, dict):
            problems.append(Problem(source, line, RECORD_FIELD, "a conversation is a JSON object"))
        elif not isinstance(obj.get("id"), str) or dataset_path_problem(obj["id"]) or "/" in obj["id"]:
            # The id names files (audio/ID.wav, redactions/ID.json), so it must be a plain name.
            problems.append(Problem(source, line, "id", "required: a conversation id (letters, digits, _ . -)"))
        else:
            rows.append(Row(source, line, obj))
    if problems:
        raise FormatError(problems)
    return rows


def source_file(base: Path, written: object, row: Row, field: str) -> Path:
    """The file a dataset-relative path of the input names, or a FormatError naming the field."""
    if not isinstance(written, str) or not written:
        raise FormatError([row.problem(field, "must be a path relative to the manifest's folder")])
    wrong = dataset_path_problem(written)
    if wrong is not None:
        raise FormatError([row.problem(field, wrong)])
    path = base / written
    if not path.is_file():
        raise FormatError([row.problem(field, f"file not found: {written} (relative to {base})")])
    return path


def check_out(out: Path, inputs: Sequence[Path]) -> None:
    out_real = out.resolve()
    for folder in inputs:
        folder_real = folder.resolve()
        if out_real == folder_real or folder_real.is_relative_to(out_real) or out_real.is_relative_to(folder_real):
            raise SystemExit(f"--out={out} overlaps the input folder {folder}: the input is never modified")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"--out={out} exists and is not an empty folder; choose a new folder")


@contextmanager
def staged_dataset(out: Path) -> Iterator[Path]:
    """A temporary folder next to `out`, renamed to `out` when the block succeeds, removed otherwise."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield stage
        if out.exists():
            out.rmdir()  # check_out allowed only an empty folder
        os.replace(stage, out)
    finally:
        if stage.exists():
            shutil.rmtree(stage)


def write_manifest(stage: Path, rows: Sequence[dict]) -> Path:
    path = stage / MANIFEST
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def copy_splits(manifest: Path, stage: Path, tool: str) -> bool:
    """Copy splits.json from beside the input manifest; False (with a note) when there is none."""
    splits = manifest.parent / SPLITS_FILE
    if splits.is_file():
        shutil.copyfile(splits, stage / SPLITS_FILE)
        return True
    print(f"{tool}: no {SPLITS_FILE} beside {manifest}; the dataset validates once "
          "`python -m data_pipeline.vakforge split` has written one", file=sys.stderr)
    return False


def validate_staged(stage: Path, rows: Sequence[Row], has_splits: bool, allow_unconsented: bool) -> None:
    """Validate the staged manifest; problems are reported at the input line they came from."""
    manifest = stage / MANIFEST
    try:
        read_vakforge(manifest, allow_unconsented=allow_unconsented)
    except FormatError as err:
        problems = []
        for p in err.problems:
            if p.path != str(manifest):
                if not has_splits:
                    continue  # no splits.json yet: said so by copy_splits
                problems.append(p)
                continue
            row = rows[p.line - 1] if 0 < p.line <= len(rows) else None
            where = (row.source, row.line) if row is not None else (p.path, p.line)
            problems.append(Problem(*where, p.field, f"{p.message} (in the output)"))
        if problems:
            raise FormatError(problems) from None
