"""Evaluation across processes: which examples a process reads, and summing its sums with the others'.

Each process evaluates a disjoint slice of the data (examples i with i ≡ process index mod process
count), so every statistic is a partial sum; `sum_stats` adds the partial sums of all processes
before any ratio is formed (a mean of per-host means would weight hosts by their share of the
data). The group keys differ between processes (one host may never see `domain:kitchen`), so the
keys are unioned first and every process lays its sums out over the same sorted key list
(`GroupedSums.to_vector`). With one process every step is the identity.

`gather` is the one collective: `gather(x)` returns every process's `x` stacked on a new leading
axis, in process order (`jax.experimental.multihost_utils.process_allgather`). Tests pass a fake
that joins threads to act as several processes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from valen_jax.evaluation.metrics import GroupedSums

Gather = Callable[[np.ndarray], np.ndarray]


def process_gather(x: np.ndarray) -> np.ndarray:
    """Every process's `x`, stacked in process order: [process_count, *x.shape]."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def local_indices(count: int, process_index: int | None = None, process_count: int | None = None) -> list[int]:
    """The examples (of `count`, in data order) this process evaluates."""
    index = jax.process_index() if process_index is None else process_index
    processes = jax.process_count() if process_count is None else process_count
    return list(range(index, count, processes))


def batch_count(count: int, local_batch: int, process_count: int | None = None) -> int:
    """Batches every process runs: the same number everywhere (each batch is one collective
    computation), enough for the process with the most examples; the others pad."""
    processes = jax.process_count() if process_count is None else process_count
    most = -(-count // processes)
    return -(-most // local_batch)


def batches_for_local(local_count: int, local_batch: int, gather: Gather = process_gather) -> int:
    """Batches every process runs over items it holds itself (decoded messages, swapped prompts), whose
    numbers differ by process: enough for the process holding the most; the others pad."""
    return -(-max(gather_json(int(local_count), gather)) // local_batch)


def gather_json(value, gather: Gather = process_gather) -> list:
    """Every process's JSON-serialisable `value`, in process order (lengths first, then padded bytes)."""
    own = np.frombuffer(json.dumps(value, ensure_ascii=False).encode(), np.uint8)
    lengths = np.asarray(gather(np.asarray([own.size], np.int64))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: own.size] = own
    blobs = np.asarray(gather(padded))
    return [json.loads(bytes(blob[:n]).decode()) for blob, n in zip(blobs, lengths, strict=True)]


def union_keys(key_lists: Sequence[Sequence[str]]) -> list[str]:
    return sorted(set().union(*map(set, key_lists)))


def sum_stats(stats: GroupedSums, gather: Gather = process_gather) -> GroupedSums:
    """A stats of the same type and configuration holding the sums of every process's `stats`."""
    keys = union_keys(gather_json(stats.group_keys(), gather))
    total = np.asarray(gather(stats.to_vector(keys)), np.float64).sum(axis=0)
    return type(stats).from_vector(total, keys, **stats._config())


def sum_array(values: np.ndarray, gather: Gather = process_gather) -> np.ndarray:
    """Element-wise float64 sum over processes of a fixed-shape array of sums."""
    return np.asarray(gather(np.asarray(values, np.float64)), np.float64).sum(axis=0)
