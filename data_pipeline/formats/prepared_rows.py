"""Prepared token rows (seed 003, "Rows files"): every rule a run checks, row by row, in batches.

Each row has list columns `input_ids` and `loss_mask` of equal length; loss_mask holds 0/1, never
marks the first token (no token predicts it) and marks at least one. Other columns are ignored and
never read. Checks are vectorised per batch with numpy; only rows that break a rule are looked at
one by one, to word their problem.

Decisions where the seed leaves room: token ids must fit int32 (DESIGN: shards hold int32 ids;
`describe` checks the tokenizer's vocabulary instead); a file with no rows is refused; both columns
must be list<integer> (a bool mask is refused: the seed writes 0 and 1); at most
MAX_PROBLEMS_PER_FILE row problems are listed per file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data_pipeline.formats.errors import FILE_FIELD, Problem

COLUMNS = ("input_ids", "loss_mask")
STATS_KEYS = ("rows", "tokens", "supervisedTokens", "longestRow")  # the descriptor's names
# DESIGN: shards hold int32 token ids; without a tokenizer at hand that is the widest id accepted.
INT32_MAX = 2**31 - 1
MAX_PROBLEMS_PER_FILE = 100  # a broken writer breaks every row; list a few, count the rest
BATCH_ROWS = 1024


@dataclass(frozen=True)
class FileStats:
    rows: int
    tokens: int
    supervised_tokens: int
    longest_row: int

    def to_json(self) -> dict[str, int]:
        values = (self.rows, self.tokens, self.supervised_tokens, self.longest_row)
        return dict(zip(STATS_KEYS, values, strict=True))


def scan_rows(
    file: str | Path | BinaryIO, source: str, vocab_size: int | None = None
) -> tuple[FileStats | None, list[Problem]]:
    """Check every row of one Parquet file, batch by batch; its counts, or None if unreadable."""
    problems: list[Problem] = []
    try:
        parquet = pq.ParquetFile(file)
        schema = parquet.schema_arrow
    # A damaged footer can also hold column names that are not UTF-8 (UnicodeDecodeError, a ValueError).
    except (pa.ArrowException, OSError, ValueError) as err:
        return None, [Problem(source, 0, FILE_FIELD, f"not a readable Parquet file: {err}")]
    for name in COLUMNS:
        if name not in schema.names:
            problems.append(
                Problem(source, 0, name, "missing column; prepared rows have input_ids and loss_mask")
            )
            continue
        kind = schema.field(name).type
        if not (
            (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)
        ):
            shown = (
                f"list<{kind.value_type}>" if pa.types.is_list(kind) or pa.types.is_large_list(kind) else kind
            )
            problems.append(Problem(source, 0, name, f"must be a list of integers, got {shown}"))
    if problems:
        return None, problems
    rows = tokens = supervised = longest = 0
    limit = INT32_MAX if vocab_size is None else vocab_size - 1
    found = 0
    try:
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=list(COLUMNS)):
            ids, mask = _Column(batch.column("input_ids")), _Column(batch.column("loss_mask"))
            tokens += int(ids.lengths.sum())
            supervised += int(np.count_nonzero(mask.values == 1))
            longest = max(longest, int(ids.lengths.max(initial=0)))
            for row, field, message in _bad_rows(ids, mask, limit, vocab_size):
                found += 1
                if found <= MAX_PROBLEMS_PER_FILE:
                    problems.append(Problem(source, rows + row + 1, field, message))
            rows += batch.num_rows
    except (pa.ArrowException, OSError, ValueError) as err:
        return None, [*problems, Problem(source, 0, FILE_FIELD, f"cannot read rows: {err}")]
    if found > MAX_PROBLEMS_PER_FILE:
        problems.append(
            Problem(source, 0, FILE_FIELD, f"{found - MAX_PROBLEMS_PER_FILE} more row problems not listed")
        )
    if rows == 0:
        problems.append(Problem(source, 0, FILE_FIELD, "no rows"))
    return FileStats(rows, tokens, supervised, longest), problems


class _Column:
    """One list column of a batch as flat numpy values with row offsets."""

    def __init__(self, array: pa.Array):
        self.null_rows = array.is_null().to_numpy(zero_copy_only=False)
        self.lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False)
        flat = array.flatten()  # drops the values of null rows, honours the batch's slice offset
        self.null_values = flat.is_null().to_numpy(zero_copy_only=False)
        self.values = flat.fill_null(0).to_numpy(zero_copy_only=False)
        self.offsets = np.concatenate(([0], np.cumsum(self.lengths)))

    def count(self, flags: np.ndarray) -> np.ndarray:
        """Per row, how many values have `flags` set (cumsum: correct for empty rows too)."""
        total = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
        return total[self.offsets[1:]] - total[self.offsets[:-1]]

    def first(self, row: int, flags: np.ndarray) -> tuple[int, object]:
        start = self.offsets[row]
        pos = int(np.flatnonzero(flags[start : self.offsets[row + 1]])[0])
        return pos, self.values[start + pos].item()


def _bad_rows(ids: _Column, mask: _Column, limit: int, vocab: int | None) -> Iterator[tuple[int, str, str]]:
    """(row in batch, field, message) for every rule of seed 003 "Rows files" a row breaks."""
    out_of_range = (ids.values < 0) | (ids.values > limit)
    not_binary = (mask.values != 0) & (mask.values != 1)
    marked = mask.count(mask.values == 1)
    checks = (
        ids.count(ids.null_values),
        ids.count(out_of_range),
        mask.count(mask.null_values),
        mask.count(not_binary),
    )
    suspects = (
        ids.null_rows | mask.null_rows | (ids.lengths != mask.lengths) | (ids.lengths == 0) | (marked == 0)
    )
    suspects |= np.logical_or.reduce([c > 0 for c in checks])
    starts = mask.offsets[:-1]
    firsts = np.zeros(len(starts), dtype=bool)
    has = mask.lengths > 0
    firsts[has] = mask.values[starts[has]] == 1
    for row in np.flatnonzero(suspects | firsts):
        row = int(row)
        if ids.null_rows[row] or mask.null_rows[row]:
            yield row, "input_ids" if ids.null_rows[row] else "loss_mask", "null; every row holds a list"
            continue
        if ids.lengths[row] == 0:
            yield row, "input_ids", "an empty row"
            continue
        if checks[0][row]:
            yield row, "input_ids", f"null token id at position {ids.first(row, ids.null_values)[0]}"
        if checks[1][row]:
            pos, value = ids.first(row, out_of_range)
            bound = (
                f"outside the tokenizer's vocabulary of {vocab}" if vocab else "not a token id (0 to 2^31-1)"
            )
            yield row, "input_ids", f"{value} at position {pos} is {bound}"
        if ids.lengths[row] != mask.lengths[row]:
            yield row, "loss_mask", f"{mask.lengths[row]} values but input_ids has {ids.lengths[row]}"
        if checks[2][row]:
            yield row, "loss_mask", f"null at position {mask.first(row, mask.null_values)[0]}"
        if checks[3][row]:
            pos, value = mask.first(row, not_binary)
            yield row, "loss_mask", f"{value} at position {pos}; a loss mask holds 0 or 1"
        if firsts[row]:
            yield row, "loss_mask", "the first token is marked, but no token predicts it"
        if marked[row] == 0:
            yield row, "loss_mask", "no token is marked; every row marks at least one token"
