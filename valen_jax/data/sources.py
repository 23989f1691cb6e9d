"""Shard sets as Grain sources, with the recipe's sampling weights (seed 004, "Recipe Format")."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from array_record.python.array_record_data_source import ArrayRecordDataSource

from data_pipeline.shards import Example, Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSet:
    directory: Path
    manifest: Manifest

    @classmethod
    def open(cls, directory: str | Path, fingerprint: dict[str, str] | None = None) -> ShardSet:
        directory = Path(directory)
        manifest = Manifest.read(directory)
        if fingerprint is not None:
            manifest.check_fingerprint(fingerprint, str(directory))
        return cls(directory, manifest)

    def source(self) -> ArrayRecordDataSource:
        return ArrayRecordDataSource([str(self.directory / p) for p in self.manifest.shard_paths])

    def __len__(self) -> int:
        return int(self.manifest.data["counts"]["records"])


def sampling_indices(manifest: Manifest, seed: int) -> np.ndarray:
    """Example indices of one epoch, each entry weighted by its `repeat_time`.

    Seed 004: `repeat_time` ≥ 1 multiplies the entry's sampling weight; a value in (0, 1)
    selects a deterministic subset. The fractional part above 1 also takes a deterministic
    subset, so 2.5 means every example twice plus the same half once more.
    """
    chosen = []
    for entry in manifest.data["entries"]:
        indices = np.arange(entry["start"], entry["stop"])
        repeat = float(entry["repeat_time"])
        whole, fraction = int(repeat), repeat - int(repeat)
        chosen.extend([indices] * whole)
        if fraction > 0:
            # Seeded by the entry's name and the run seed, not by position: stable across reorderings.
            rng = np.random.default_rng([seed, *entry["name"].encode("utf-8")])
            take = int(round(fraction * len(indices)))
            chosen.append(np.sort(rng.permutation(indices)[:take]))
    return np.concatenate(chosen).astype(np.int64) if chosen else np.zeros(0, np.int64)


def decode(record: bytes) -> Example:
    return Example.from_bytes(record)
