"""Packing assembled examples into rows of `seq_len`: segment ids, per-segment positions, a segment cap.

Row fields are those of `assemble.assemble` (one example = segment 1), extended to k examples:
`segment_ids` 1..k, `positions` restarting at 0 in each segment (each segment's positions are those
of a separate sequence, 1-D or M-RoPE: `positions.py`), and the examples' vision
patches concatenated in example order with `patch_segments` numbering the row's media items
1..M. The model gives the n-th media-slot token of a row the n-th merged vision token
(`Transformer.embed_tokens`), so patches must follow the slot tokens' order and every media
item needs its own patch segment (the vision tower attends within one item only).

An example is never split and never truncated: cutting could split a media placeholder or drop
every target (DESIGN). One that cannot fit an empty row is "overlong", and `overlong` says what
happens: `error` stops with its source line, `skip` drops it and counts it.

Packing is online bin packing with at most `pack_buffer` open rows (a bounded buffer of
examples), deterministic given the input order:
- `first_fit`: an example joins the oldest open row it fits; when none fits and the buffer is
  full, the oldest row is emitted (bounded first fit).
- `best_fit`: an example joins the open row it leaves with the least free space; when none fits
  and the buffer is full, the fullest row is emitted (bounded best fit keeps the rows that still
  have room for later, smaller examples).
- `none`: one example per row, as `assemble` builds it.
A row is emitted at once when it is full (no token left, or `max_segments` examples), and at the
latest `pack_buffer × max_segments` examples after it opened: a nearly full row that no later
example fits would otherwise stay open forever, and the resume state (which re-reads every
example still buffered) would grow without bound.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline.shards import Example
from valen_jax.data.assemble import AssemblyError, RowSpec, expand_media_slots
from valen_jax.errors import ConfigError

log = logging.getLogger(__name__)

PACKING_MODES = ("none", "first_fit", "best_fit")
OVERLONG_POLICIES = ("error", "skip")
# The key under which a packing iterator's counters sit in its (JSON) state; see `packing_statistics`.
STATS_KEY = "packing_counts"


@dataclass(frozen=True)
class PackingSpec:
    """`data.packing`, `data.max_segments`, `data.overlong`, `data.pack_buffer`."""

    packing: str = "none"
    # Attention kernels with per-segment bookkeeping have a fixed segment budget (DESIGN lessons).
    max_segments: int = 16
    overlong: str = "error"
    # Open rows held while packing; more rows pack tighter but delay an example by up to this many rows.
    pack_buffer: int = 32
    # Distinct records the stream can hold (the trainer fills it in; 0: unknown). With `overlong=skip`, once
    # that many distinct records (by source:line) were skipped since the last one that fitted, every
    # record has been seen not to fit: an error, not an endless loop. It cannot fire while some record
    # fits (that one is never skipped); records sharing a source:line only make it fire later or never.
    records: int = 0

    def __post_init__(self):
        if self.packing not in PACKING_MODES:
            raise ValueError(f"data.packing={self.packing!r}: choose one of {', '.join(PACKING_MODES)}")
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"data.overlong={self.overlong!r}: choose one of {', '.join(OVERLONG_POLICIES)} "
                             "(truncation is not offered: it could cut a media placeholder)")
        if self.max_segments < 1 or self.pack_buffer < 1:
            raise ValueError(f"data.max_segments={self.max_segments} and data.pack_buffer={self.pack_buffer} "
                             "must be ≥ 1")

    @classmethod
    def from_config(cls, config) -> PackingSpec:
        data = config.data
        try:
            return cls(data.packing, int(data.max_segments), data.overlong, int(data.pack_buffer))
        except ValueError as error:  # the message names the data.* key; at start-up it is a config error
            raise ConfigError(f"config.{error}") from None

    @property
    def segments_per_row(self) -> int:
        return 1 if self.packing == "none" else self.max_segments

    @property
    def open_rows(self) -> int:
        return 1 if self.packing == "none" else self.pack_buffer

    @property
    def horizon(self) -> int:
        """Examples read after a row opened by which it is emitted; bounds the examples a resume re-reads.

        An open row gets about one in `open_rows` examples and holds at most `segments_per_row`, so
        a row still open after this many has stopped filling.
        """
        return self.open_rows * self.segments_per_row


@dataclass(frozen=True)
class Piece:
    """One example ready to place: shifted inputs/targets of length L and its vision patches."""

    tokens: np.ndarray  # int32 [L]
    targets: np.ndarray  # int32 [L]
    weights: np.ndarray  # float32 [L]
    patches: np.ndarray  # float32 [N, patch_dim], media items in slot order
    patch_positions: np.ndarray  # int32 [N, 3]
    patch_media: np.ndarray  # int32 [N]: 1..m, the example's media item of each patch
    num_media: int
    where: str
    positions: np.ndarray  # int32 [L] or [L, 3]: the example's own positions, as a separate sequence
    draft_block: np.ndarray | None = None  # int32 [L], aligned with targets, when spec.draft_blocks

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def num_patches(self) -> int:
        return len(self.patches)


def piece_of(example: Example, spec: RowSpec, media_log=None, **augment) -> Piece:
    """`augment`: the training-time media options of `expand_media_slots` (training, rng, entry);
    `media_log`: a `media_log.MediaLog` that records each media item as it is processed."""
    expanded = expand_media_slots(example, spec, **augment)
    if media_log is not None:
        media_log.log_expanded(example, expanded, spec)
    media = expanded.media
    patches = (np.concatenate([m.patches for m in media]) if media
               else np.zeros((0, spec.patch_dim), np.float32))
    positions = np.concatenate([m.positions for m in media]) if media else np.zeros((0, 3), np.int32)
    media_index = np.repeat(np.arange(1, len(media) + 1, dtype=np.int32), [m.num_tokens for m in media])
    ids = expanded.ids
    return Piece(ids[:-1].astype(np.int32), ids[1:].astype(np.int32), expanded.weights[1:].astype(np.float32),
                 patches.astype(np.float32), positions.astype(np.int32), media_index, len(media),
                 contract.where(example), expanded.positions(spec)[:-1],
                 None if expanded.draft_block is None else expanded.draft_block[1:])


def overlong_reason(piece: Piece, spec: RowSpec) -> str | None:
    if piece.length > spec.seq_len:
        return (f"{piece.length} tokens after media expansion exceed data.seq_len={spec.seq_len}; "
                "raise seq_len or shorten the record")
    if piece.num_patches > spec.max_patches:
        return (f"{piece.num_patches} vision patches exceed data.max_patches={spec.max_patches}; "
                "raise it or lower media_kwargs.max_pixels")
    return None


def row_of(pieces: list[Piece], spec: RowSpec) -> dict[str, np.ndarray]:
    """Padded row arrays; with one piece this equals `assemble.assemble` of that example."""
    length, budget = spec.seq_len, spec.max_patches
    row = {"tokens": np.full(length, spec.pad_id, np.int32), "targets": np.full(length, spec.pad_id, np.int32),
           "target_weights": np.zeros(length, np.float32), "positions": np.zeros(spec.positions.shape(length), np.int32),
           "segment_ids": np.zeros(length, np.int32),
           "patches": np.zeros((budget, spec.patch_dim), np.float32),
           "patch_positions": np.zeros((budget, 3), np.int32), "patch_segments": np.zeros(budget, np.int32)}
    if spec.draft_blocks:
        row["draft_block"] = np.zeros(length, np.int32)
    start = patch_start = media_seen = 0
    for segment, piece in enumerate(pieces, start=1):
        stop, patch_stop = start + piece.length, patch_start + piece.num_patches
        row["tokens"][start:stop], row["targets"][start:stop] = piece.tokens, piece.targets
        row["target_weights"][start:stop] = piece.weights
        row["positions"][start:stop] = piece.positions
        row["segment_ids"][start:stop] = segment
        if spec.draft_blocks:
            row["draft_block"][start:stop] = piece.draft_block
        row["patches"][patch_start:patch_stop] = piece.patches
        row["patch_positions"][patch_start:patch_stop] = piece.patch_positions
        row["patch_segments"][patch_start:patch_stop] = piece.patch_media + media_seen
        start, patch_start, media_seen = stop, patch_stop, media_seen + piece.num_media
    return row


class OpenRow:
    """Members are (serial, piece): the serial names the example in the iterator's state."""

    __slots__ = ("members", "tokens", "patches")

    def __init__(self):
        self.members: list[tuple[int, Piece]] = []
        self.tokens = self.patches = 0

    @property
    def opened(self) -> int:
        return self.members[0][0]

    def add(self, serial: int, piece: Piece) -> None:
        self.members.append((serial, piece))
        self.tokens += piece.length
        self.patches += piece.num_patches


class Packer:
    """The packing decisions alone (no I/O): `add` pieces, take emitted rows from `closed`."""

    def __init__(self, spec: RowSpec, packing: PackingSpec):
        self.spec, self.packing = spec, packing
        self.open: list[OpenRow] = []  # oldest first
        self.closed: deque[OpenRow] = deque()  # emitted in this order

    def _fits(self, row: OpenRow, piece: Piece) -> bool:
        return (len(row.members) < self.packing.segments_per_row and row.tokens + piece.length <= self.spec.seq_len
                and row.patches + piece.num_patches <= self.spec.max_patches)

    def _choose(self, piece: Piece) -> OpenRow | None:
        fitting = [row for row in self.open if self._fits(row, piece)]
        if not fitting:
            return None
        if self.packing.packing == "best_fit":
            # min() keeps the first (oldest) of equally tight rows: ties break by age, deterministically.
            return min(fitting, key=lambda row: self.spec.seq_len - row.tokens - piece.length)
        return fitting[0]

    def _close(self, row: OpenRow) -> None:
        self.open.remove(row)
        self.closed.append(row)

    def add(self, serial: int, piece: Piece) -> None:
        while self.open and serial - self.open[0].opened >= self.packing.horizon:
            self._close(self.open[0])
        row = self._choose(piece)
        if row is None:
            if len(self.open) >= self.packing.open_rows:
                victim = self.open[0]
                if self.packing.packing == "best_fit":
                    victim = max(self.open, key=lambda r: r.tokens)  # first of the fullest: the oldest
                self._close(victim)
            row = OpenRow()
            self.open.append(row)
        row.add(serial, piece)
        if len(row.members) >= self.packing.segments_per_row or row.tokens >= self.spec.seq_len:
            self._close(row)

    def flush(self) -> None:
        while self.open:
            self._close(self.open[0])


def pack(pieces: Iterable[Piece], spec: RowSpec, packing: PackingSpec) -> list[list[Piece]]:
    """All rows of a finite sequence of fitting pieces (for tests and benchmarks)."""
    packer = Packer(spec, packing)
    rows = []
    for serial, piece in enumerate(pieces):
        packer.add(serial, piece)
        rows.extend(packer.closed)
        packer.closed.clear()
    packer.flush()
    rows.extend(packer.closed)
    return [[p for _, p in row.members] for row in rows]


class _PackIterator(grain.DatasetIterator):
    """Streams rows; its state names the buffered examples so a restore rebuilds the buffer exactly.

    The state holds the parent's state before the oldest buffered example, how many examples were
    read since, and which of them sit in which open or emitted-but-unsent row. Restoring re-reads
    those examples (at most the buffer's worth) and skips the ones already emitted, so the next
    rows equal those of an uninterrupted run. Everything is JSON, as Grain's checkpoint handler needs.
    """

    def __init__(self, parent: grain.DatasetIterator, spec: RowSpec, packing: PackingSpec):
        super().__init__(parent)
        self._spec, self._packing = spec, packing
        self._reset()

    def _reset(self) -> None:
        self._packer = Packer(self._spec, self._packing)
        self._serial = 0
        self._before: dict[int, Any] = {}  # serial → parent state just before that buffered example
        self._counts = {"rows": 0, "examples": 0, "tokens": 0, "skipped_overlong": 0}
        self._skipped_since_fit: set[str] = set()  # `where`s skipped since the last example that fitted

    def _admit(self, piece: Piece) -> bool:
        reason = overlong_reason(piece, self._spec)
        if reason is None:
            self._skipped_since_fit.clear()
            return True
        if self._packing.overlong == "error":
            raise AssemblyError(f"{piece.where}: {reason} (or set data.overlong=skip)")
        self._counts["skipped_overlong"] += 1
        # DESIGN: a deliberate skip is counted and reported, never silent.
        log.warning("%s: skipped (data.overlong=skip): %s", piece.where, reason)
        self._skipped_since_fit.add(piece.where)
        if self._packing.records and len(self._skipped_since_fit) >= self._packing.records:
            raise AssemblyError(f"data.overlong=skip: none of the {self._packing.records} training records fits "
                                f"a row (each was read and skipped; the last, {piece.where}: {reason})")
        return False

    def __next__(self) -> dict[str, np.ndarray]:
        while not self._packer.closed:
            before = self._parent.get_state()
            try:
                piece = next(self._parent)
            except StopIteration:
                self._packer.flush()
                if not self._packer.closed:
                    raise
                break
            serial = self._serial
            self._serial += 1
            if self._admit(piece):
                self._before[serial] = before
                self._packer.add(serial, piece)
        row = self._packer.closed.popleft()
        for serial, _ in row.members:
            del self._before[serial]
        pieces = [piece for _, piece in row.members]
        self._counts["rows"] += 1
        self._counts["examples"] += len(pieces)
        self._counts["tokens"] += sum(p.length for p in pieces)
        return row_of(pieces, self._spec)

    def get_state(self) -> dict[str, Any]:
        rows = {"closed": list(self._packer.closed), "open": self._packer.open}
        buffered = [serial for group in rows.values() for row in group for serial, _ in row.members]
        anchor = min(buffered) if buffered else self._serial
        return {
            "parent": self._before[anchor] if buffered else self._parent.get_state(),
            "consumed": self._serial - anchor,
            **{name: [[serial - anchor for serial, _ in row.members] for row in group]
               for name, group in rows.items()},
            STATS_KEY: dict(self._counts),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._reset()
        wanted = {offset for name in ("closed", "open") for row in state[name] for offset in row}
        pieces = {}
        for offset in range(state["consumed"]):
            before = self._parent.get_state()
            piece = next(self._parent)
            if offset in wanted:
                pieces[offset], self._before[offset] = piece, before
        self._serial = state["consumed"]
        for name, target in (("closed", self._packer.closed), ("open", self._packer.open)):
            for members in state[name]:
                row = OpenRow()
                for offset in members:
                    row.add(offset, pieces[offset])
                target.append(row)
        self._counts = dict(state[STATS_KEY])


class PackIterDataset(grain.IterDataset):
    """Pieces → padded rows (`none`, `first_fit` or `best_fit`), checkpointable with the Grain iterator."""

    def __init__(self, parent: grain.IterDataset, spec: RowSpec, packing: PackingSpec):
        super().__init__(parent)
        self._spec, self._packing = spec, packing

    def __iter__(self) -> _PackIterator:
        return _PackIterator(self._parent.__iter__(), self._spec, self._packing)

    def __str__(self) -> str:
        return f"PackIterDataset({self._packing})"


def packing_statistics(state: Any) -> dict[str, int]:
    """Counters of every packing stage in an iterator state (one per worker), summed.

    Takes `iterator.get_state()`: with `mp_prefetch` the packers run in worker processes, and the
    state is the one place their counts reach the trainer, consistent with the rows consumed.
    """
    totals = {"rows": 0, "examples": 0, "tokens": 0, "skipped_overlong": 0}

    def visit(node: Any) -> None:
        if isinstance(node, Mapping):
            if STATS_KEY in node:
                for key, value in node[STATS_KEY].items():
                    totals[key] = totals.get(key, 0) + int(value)
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    visit(state)
    return totals
