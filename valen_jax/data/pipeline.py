"""The Grain pipeline: recipe-weighted indices per shard set → shuffle per epoch → mix by weight →
shard by process → decode and expand media → pack → batch → worker processes.

Everything before packing is a MapDataset of (component, record, epoch) references, so the order of
examples is a pure function of the seed and the position, which is what makes the iterator state
small and a resume exact. Packing is a stateful stream stage (`packing.PackIterDataset`) whose
state travels with the rest of the iterator's.
"""

from __future__ import annotations

from functools import partial

import grain
import jax
import numpy as np
from absl import flags

from valen_jax.data.assemble import RowSpec
from valen_jax.data.augment import EntryMedia, example_rng
from valen_jax.data.media_log import MediaLog
from valen_jax.data.packing import PackingSpec, PackIterDataset, piece_of
from valen_jax.data.sources import ShardSet, Sources, decode, mixture_of, sampling_indices


def component_seed(seed: int, component: int) -> int:
    """The first component keeps the run seed, so one shard set orders its examples as it does alone."""
    if component == 0:
        return seed
    return int(np.random.SeedSequence([seed, component]).generate_state(1)[0])


def _tag(component: int, epoch_length: int, position: int, record: np.integer) -> tuple[int, int, int]:
    # The epoch rides along so per-example randomness (augmentation) can be keyed by
    # (seed, record, epoch): reproducible on resume, different every epoch.
    return component, int(record), position // epoch_length


def example_refs(components: list[tuple[ShardSet, float]], *, seed: int, shuffle: bool, repeat: bool,
                 process_index: int, process_count: int) -> grain.MapDataset:
    """(component, record index, epoch) triples this process reads, in order.

    Each shard set repeats its entries by `repeat_time` (seed 004) and is shuffled with a new order
    every epoch; the sets are then interleaved by weight (Grain's deterministic proportional
    mix). Without `repeat` the mixture ends when its first set runs out, as Grain's mix defines.
    """
    parts = []
    for k, (shard_set, _) in enumerate(components):
        part_seed = component_seed(seed, k)
        indices = sampling_indices(shard_set.manifest, part_seed)
        part = grain.MapDataset.source(indices)
        if shuffle:
            part = part.shuffle(seed=part_seed)
        if repeat:
            # reseed_each_epoch: each epoch sees a new order, reproducible from the seed.
            part = part.repeat(None, reseed_each_epoch=True)
        parts.append(part.map_with_index(partial(_tag, k, max(len(indices), 1))))
    mixed = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, [w for _, w in components])
    # Every process reads a disjoint slice; together they form the global batch.
    return mixed[process_index::process_count]


class _Reader:
    """(component, record, epoch) → Piece; picklable, so worker processes can rebuild it.

    In training, media augmentation (recipe `data_augment`/`visual_aug`, seed 004) draws from an
    rng keyed by (seed, record, epoch): a restored iterator re-reads buffered examples and must
    augment them exactly as before.
    """

    def __init__(self, components: list[tuple[ShardSet, float]], spec: RowSpec, training: bool, seed: int,
                 media_log: MediaLog | None):
        self._sets = [shard_set for shard_set, _ in components]
        self._spec = spec
        self._training, self._seed, self._media_log = training, seed, media_log
        self._entries = [[(e["start"], e["stop"], EntryMedia.from_manifest_entry(e))
                          for e in shard_set.manifest.data["entries"]] for shard_set in self._sets]
        self._sources = None

    def _entry(self, component: int, record: int) -> EntryMedia | None:
        for start, stop, entry in self._entries[component]:
            if start <= record < stop:
                return entry
        return None

    def __call__(self, ref: tuple[int, int, int]):
        if self._sources is None:  # opened lazily, in the process that reads
            self._sources = [shard_set.source() for shard_set in self._sets]
        component, record, epoch = ref
        example = decode(self._sources[component][record])
        if not self._training:
            return piece_of(example, self._spec, media_log=self._media_log)
        return piece_of(example, self._spec, media_log=self._media_log, training=True,
                        rng=example_rng(component_seed(self._seed, component), record, epoch),
                        entry=self._entry(component, record))

    def __getstate__(self):
        return {**self.__dict__, "_sources": None}


def build_dataset(sources: Sources, spec: RowSpec, *, global_batch: int, seed: int, shuffle: bool,
                  repeat: bool, workers: int, packing: PackingSpec | None = None,
                  process_index: int | None = None, process_count: int | None = None, training: bool = False,
                  media_log_dir=None) -> grain.IterDataset:
    """Batches of `global_batch / process_count` rows for this process, as numpy arrays.

    `sources`: one ShardSet, or (ShardSet, weight) pairs mixed by weight. `packing`: the
    `data.packing/max_segments/overlong/pack_buffer` knobs (default: one example per row). `process_index/count` default to
    JAX's; tests pass others to act as one process of many. `training` turns on media augmentation;
    `media_log_dir` writes the media log (seed 000) there.
    """
    components = mixture_of(sources)
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if global_batch % process_count:
        raise ValueError(f"global batch {global_batch} is not divisible by {process_count} processes")
    refs = example_refs(components, seed=seed, shuffle=shuffle, repeat=repeat, process_index=process_index,
                        process_count=process_count)
    media_log = MediaLog(media_log_dir, process_index) if media_log_dir is not None else None
    pieces = refs.map(_Reader(components, spec, training, seed, media_log)).to_iter_dataset()
    rows = PackIterDataset(pieces, spec, packing or PackingSpec())
    iterable = rows.batch(global_batch // process_count, drop_remainder=True)
    if workers > 0:
        if not flags.FLAGS.is_parsed():
            # Grain's worker processes read absl flags (profiling switches); callers outside
            # absl.app (tests, notebooks, benchmarks) never parsed them, and the defaults are right.
            flags.FLAGS.mark_as_parsed()
        iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iterable
