"""Shard sets as Grain sources, with the recipe's sampling weights (seed 004, "Recipe Format"),
and mixtures of shard sets (several formats in one run) with a weight each."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from array_record.python.array_record_data_source import ArrayRecordDataSource

from data_pipeline.shards import Example, Manifest, ShardError

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
        log_length_mismatches(manifest, str(directory))
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


def log_length_mismatches(manifest: Manifest, where: str) -> None:
    """Seed 004: an entry's `length` is an expectation; "a mismatch is logged", never refused.

    The converter logs it when converting; shards converted elsewhere are checked again here, for
    manifests whose entries carry the expected `length` (older ones do not, and are skipped).
    """
    for entry in manifest.data.get("entries", []):
        expected = entry.get("length")
        if expected is not None and int(expected) != entry["stop"] - entry["start"]:
            log.warning("%s: entry %r expects length=%d but holds %d records", where, entry["name"],
                        int(expected), entry["stop"] - entry["start"])


Sources = ShardSet | Sequence[tuple[ShardSet, float]]


def mixture_of(sources: Sources) -> list[tuple[ShardSet, float]]:
    """One shard set (weight 1) or (shard set, weight) pairs, checked to be mixable."""
    components = [(sources, 1.0)] if isinstance(sources, ShardSet) else [(s, float(w)) for s, w in sources]
    if not components:
        raise ValueError("no shard sets to read")
    for shard_set, weight in components:
        if not weight > 0:
            raise ValueError(f"{shard_set.directory}: mixture weight {weight} must be > 0")
    # One model reads every component: token ids must mean the same thing in all of them.
    first = components[0][0]
    for shard_set, _ in components[1:]:
        if shard_set.manifest.fingerprint != first.manifest.fingerprint:
            raise ShardError(f"{shard_set.directory}: tokenizer {shard_set.manifest.fingerprint} differs from "
                             f"{first.directory}'s {first.manifest.fingerprint}; convert both with one tokenizer")
    return components


def decode(record: bytes) -> Example:
    return Example.from_bytes(record)
