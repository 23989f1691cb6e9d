"""The Grain pipeline, one for every format: recipe-weighted indices per shard set → shuffle per
epoch → mix by weight → shard by process → decode → assemble → rows → batch → worker processes.

What differs between formats is the row assembly alone (`RowAssembly`): token formats expand
media and pack pieces into rows (`TokenAssembly`); Valen builds one question-mode or
shared_state row per record and never packs (`valen_rows.ValenAssembly`). Everything else (the
order, the per-example random generator, process sharding, the media log, workers) is shared, so a
fix in one place holds for both.

Everything before the row stage is a MapDataset of (component, record, epoch) references, so the
order of examples is a pure function of the seed and the position, which is what makes the
iterator state small and a resume exact. Packing is a stateful stream stage
(`packing.PackIterDataset`) whose state travels with the rest of the iterator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import grain
import jax
import numpy as np
from absl import flags

from data_pipeline.shards import Example
from valen_jax.data.assemble import RowSpec, batch_shapes_of
from valen_jax.data.augment import EntryMedia, example_rng
from valen_jax.data.media_log import MediaLog
from valen_jax.data.packing import PackingSpec, PackIterDataset, piece_of
from valen_jax.data.sources import ShardSet, Sources, decode, mixture_of, sampling_indices


class RowAssembly(Protocol):
    """How decoded examples become batch rows; the one part of the pipeline that differs by format."""

    def item(self, example: Example, spec: RowSpec, *, training: bool, rng: np.random.Generator,
             entry: EntryMedia | None, media_log: MediaLog | None) -> Any | None:
        """One example → what `rows` consumes, or None for an example this assembly drops (and counts)."""

    def rows(self, items: grain.IterDataset, spec: RowSpec) -> grain.IterDataset:
        """Items → padded row dicts."""

    def batch_shapes(self, spec: RowSpec, global_batch: int) -> dict:
        """Abstract shapes of a global batch of its rows, for compiling the step before the first batch."""


@dataclass(frozen=True)
class TokenAssembly:
    """Token formats: media expanded (augmented in training), pieces packed by `packing`."""

    packing: PackingSpec = field(default_factory=PackingSpec)

    def item(self, example, spec, *, training, rng, entry, media_log):
        if not training:
            return piece_of(example, spec, media_log=media_log)
        return piece_of(example, spec, media_log=media_log, training=True, rng=rng, entry=entry)

    def rows(self, items, spec):
        return PackIterDataset(items, spec, self.packing)

    def batch_shapes(self, spec, global_batch):
        return batch_shapes_of(spec, global_batch)


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
    """(component, record, epoch) → the assembly's item; picklable, so worker processes can rebuild it.

    Per-example randomness (media augmentation, seed 004; Valen's candidate order, seed 000) draws
    from an rng keyed by (component seed, record, epoch): a restored iterator re-reads buffered
    examples and must see them exactly as before, and a shard set alone is keyed by the run seed.
    """

    def __init__(self, components: list[tuple[ShardSet, float]], spec: RowSpec, assembly: RowAssembly,
                 training: bool, seed: int, media_log: MediaLog | None):
        self._sets = [shard_set for shard_set, _ in components]
        self._spec, self._assembly = spec, assembly
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
        rng = example_rng(component_seed(self._seed, component), record, epoch)
        return self._assembly.item(example, self._spec, training=self._training, rng=rng,
                                   entry=self._entry(component, record), media_log=self._media_log)

    def __getstate__(self):
        return {**self.__dict__, "_sources": None}


def build_dataset(sources: Sources, spec: RowSpec, assembly: RowAssembly | None = None, *, global_batch: int,
                  seed: int, shuffle: bool, repeat: bool, workers: int, process_index: int | None = None,
                  process_count: int | None = None, training: bool = False,
                  media_log_dir=None) -> grain.IterDataset:
    """Batches of `global_batch / process_count` rows for this process, as numpy arrays.

    `sources`: one ShardSet, or (ShardSet, weight) pairs mixed by weight. `assembly`: how examples
    become rows (default: token rows, one example per row). `process_index/count` default to JAX's;
    tests pass others to act as one process of many. `training` turns on media augmentation (and
    Valen's training layout); `media_log_dir` writes the media log (seed 000) there.
    """
    assembly = TokenAssembly() if assembly is None else assembly
    components = mixture_of(sources)
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if global_batch % process_count:
        raise ValueError(f"global batch {global_batch} is not divisible by {process_count} processes")
    refs = example_refs(components, seed=seed, shuffle=shuffle, repeat=repeat, process_index=process_index,
                        process_count=process_count)
    media_log = MediaLog(media_log_dir, process_index) if media_log_dir is not None else None
    items = refs.map(_Reader(components, spec, assembly, training, seed, media_log))
    # An assembly drops an example by returning None (Valen: no labeled question in training).
    items = items.filter(_kept).to_iter_dataset()
    iterable = assembly.rows(items, spec).batch(global_batch // process_count, drop_remainder=True)
    if workers > 0:
        if not flags.FLAGS.is_parsed():
            # Grain's worker processes read absl flags (profiling switches); callers outside
            # absl.app (tests, notebooks, benchmarks) never parsed them, and the defaults are right.
            flags.FLAGS.mark_as_parsed()
        iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iterable


def _kept(item) -> bool:
    return item is not None
