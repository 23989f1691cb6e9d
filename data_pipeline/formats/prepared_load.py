"""Prepared token rows as conversion reads them (seed 003, "Prepared token rows", "What is checked").

- `read_prepared_rows`: the zip (or directory) checked by `read_prepared` (prepared.json, every
  row's rules, each file's counts against the descriptor); each file is read again here and its
  SHA-256 compared once more, so the rows stored are the bytes that were checked.
- `check_prepared` (the conversion `check` hook): both digests against the tokenizer AS SHIPPED,
  loaded with `AutoTokenizer` from the same `--tokenizer` path. Not the training tokenizer: that
  one carries added primitive tokens and maybe an installed training template, which change both
  digests (see data_pipeline/prepared.py). Then the longest row against `max_seq_length` when one
  is given (a run never truncates prepared rows), and every token id against the shipped
  vocabulary (ids past it would name tokens the rows' tokenizer never had).
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from transformers import AutoTokenizer

from data_pipeline.formats.errors import FILE_FIELD, FormatError, Problem
from data_pipeline.formats.limits import TooLarge, ZipBudget, check_regular_file, read_file_capped
from data_pipeline.formats.prepared import (
    DESCRIPTOR_NAME,
    PreparedDescriptor,
    check_against_tokenizer,
    check_max_seq_length,
    parse_descriptor,
    read_prepared,
)


@dataclass(frozen=True)
class PreparedRow:
    source: str  # ZIP/member (or DIR/member)
    line: int  # 1-based row of that file
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # int8 [T], 0/1


def read_prepared_rows(path: str | Path) -> tuple[PreparedDescriptor, list[PreparedRow]]:
    """Every row of a checked prepared version, files in the descriptor's (training) order."""
    path = Path(path)
    descriptor = read_prepared(path).descriptor
    rows: list[PreparedRow] = []
    for entry in descriptor.files:
        source = descriptor.where(entry.path)
        data = _member_bytes(path, entry.path)
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise FormatError([Problem(source, 0, "sha256", f"changed while converting: now {digest}")])
        table = pq.read_table(pa.BufferReader(data), columns=["input_ids", "loss_mask"])
        ids = _split(table.column("input_ids"), np.int32)
        masks = _split(table.column("loss_mask"), np.int8)
        rows.extend(PreparedRow(source, number, i, m)
                    for number, (i, m) in enumerate(zip(ids, masks, strict=True), start=1))
    return descriptor, rows


def read_descriptor(path: str | Path) -> PreparedDescriptor:
    path = Path(path)
    return parse_descriptor(_member_bytes(path, DESCRIPTOR_NAME), f"{path}/{DESCRIPTOR_NAME}", str(path))


def check_prepared(path: str | Path, rows: list[PreparedRow], tokenizer_path: str,
                   max_seq_length: int | None) -> dict:
    """The run's checks (see the module docstring); returns what manifest.json records of them."""
    descriptor = read_descriptor(path)
    shipped = AutoTokenizer.from_pretrained(str(tokenizer_path))
    check_against_tokenizer(descriptor, shipped)
    if max_seq_length is not None:
        check_max_seq_length(descriptor, max_seq_length)
    vocab = len(shipped)
    problems = [Problem(row.source, row.line, "input_ids",
                        f"{int(row.input_ids.max())} is outside the tokenizer's vocabulary of {vocab}")
                for row in rows if len(row.input_ids) and int(row.input_ids.max()) >= vocab]
    if problems:
        raise FormatError(problems)
    return {"prepared": descriptor.to_json()}


def _member_bytes(path: Path, name: str) -> bytes:
    try:
        if path.is_dir():
            return read_file_capped(path / name)
        check_regular_file(path)  # a device "zip" would be read for ever
        with zipfile.ZipFile(path) as archive:
            return ZipBudget(archive).read(name)
    except (OSError, KeyError, zipfile.BadZipFile, TooLarge) as err:
        raise FormatError([Problem(f"{path}/{name}", 0, FILE_FIELD, f"cannot read: {err}")]) from None


def _split(column: pa.ChunkedArray, dtype: type) -> list[np.ndarray]:
    """One numpy array per row of a list column (rows are checked non-null by read_prepared)."""
    array = column.combine_chunks()
    lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
    values = array.flatten().to_numpy(zero_copy_only=False).astype(dtype)
    return np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []
