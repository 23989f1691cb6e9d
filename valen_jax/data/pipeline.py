"""The Grain pipeline: weighted indices → shuffle per epoch → shard by process → assemble → batch."""

from __future__ import annotations

import grain
import jax

from valen_jax.data.assemble import RowSpec, assemble
from valen_jax.data.sources import ShardSet, decode, sampling_indices


def build_dataset(shard_set: ShardSet, spec: RowSpec, *, global_batch: int, seed: int, shuffle: bool,
                  repeat: bool, workers: int) -> grain.IterDataset:
    process_count, process_index = jax.process_count(), jax.process_index()
    if global_batch % process_count:
        raise ValueError(f"global batch {global_batch} is not divisible by {process_count} processes")
    source = grain.MapDataset.source(shard_set.source())
    indices = sampling_indices(shard_set.manifest, seed)
    dataset = grain.MapDataset.source(indices).map(lambda i: source[int(i)])
    if shuffle:
        dataset = dataset.shuffle(seed=seed)
    if repeat:
        # reseed_each_epoch: each epoch sees a new order, reproducible from the seed.
        dataset = dataset.repeat(None, reseed_each_epoch=True)
    # Every process reads a disjoint slice; together they form the global batch.
    dataset = dataset[process_index::process_count]
    dataset = dataset.map(decode).map(lambda example: assemble(example, spec))
    dataset = dataset.batch(global_batch // process_count, drop_remainder=True)
    iterable = dataset.to_iter_dataset()
    if workers > 0:
        iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iterable
