"""The Grain pipeline for Valen shard sets: weighted refs → records with labels → rows → batches.

Rows are built by `valen_rows.valen_row` (question or shared_state mode) and are never packed:
a question-mode row already holds one state with all its branches. In training a record with
no labeled question is dropped before its media is read (seed 000: "its media is never read")
and counted; choice candidates are shuffled with an rng keyed by (seed, record, epoch), so a
resumed run sees the same order as an uninterrupted one.
"""

from __future__ import annotations

import grain
import jax
import numpy as np

from valen_jax.data.assemble import RowSpec, batch_shapes_of
from valen_jax.data.pipeline import example_refs
from valen_jax.data.sources import Sources, decode, mixture_of
from valen_jax.data.valen_rows import QuestionSpec, has_labels, valen_row


def is_valen(sources: Sources) -> bool:
    formats = {shard_set.manifest.data["format"] for shard_set, _ in mixture_of(sources)}
    if "valen" in formats and len(formats) > 1:
        raise ValueError(f"a run mixes Valen with {sorted(formats - {'valen'})} shards; "
                         "mixing scored questions with token formats in one run is not supported")
    return formats == {"valen"}


class _ValenReader:
    """(component, record, epoch) → Valen row, or None for a record without labels in training."""

    def __init__(self, sets, spec: RowSpec, qspec: QuestionSpec, seed: int):
        self._sets, self._spec, self._qspec, self._seed = sets, spec, qspec, seed
        self._sources = None

    def __call__(self, ref):
        if self._sources is None:  # opened lazily, in the process that reads
            self._sources = [shard_set.source() for shard_set in self._sets]
        component, record, epoch = ref
        example = decode(self._sources[component][record])
        if self._qspec.training and not has_labels(example):
            return None
        rng = np.random.default_rng([self._seed, component, record, epoch])
        return valen_row(example, self._spec, self._qspec, rng if self._qspec.training else None)

    def __getstate__(self):
        return {**self.__dict__, "_sources": None}


def build_valen_dataset(sources: Sources, spec: RowSpec, qspec: QuestionSpec, *, global_batch: int, seed: int,
                        shuffle: bool, repeat: bool, workers: int) -> grain.IterDataset:
    components = mixture_of(sources)
    process_count = jax.process_count()
    if global_batch % process_count:
        raise ValueError(f"global batch {global_batch} is not divisible by {process_count} processes")
    refs = example_refs(components, seed=seed, shuffle=shuffle, repeat=repeat,
                        process_index=jax.process_index(), process_count=process_count)
    rows = refs.map(_ValenReader([s for s, _ in components], spec, qspec, seed)).filter(lambda row: row is not None)
    iterable = rows.to_iter_dataset().batch(global_batch // process_count, drop_remainder=True)
    if workers > 0:
        iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iterable


def valen_batch_shapes(spec: RowSpec, qspec: QuestionSpec, global_batch: int) -> dict:
    shapes = batch_shapes_of(spec, global_batch)
    grid = (global_batch, qspec.max_questions, qspec.max_candidates)
    per_question = (global_batch, qspec.max_questions)
    shapes.update({
        "branch_ids": jax.ShapeDtypeStruct((global_batch, spec.seq_len), np.int32),
        "score_positions": jax.ShapeDtypeStruct(grid, np.int32),
        "branch_mask": jax.ShapeDtypeStruct(grid, np.bool_),
        "labels": jax.ShapeDtypeStruct(grid, np.float32),
        "candidate_index": jax.ShapeDtypeStruct(grid, np.int32),
        "labeled": jax.ShapeDtypeStruct(per_question, np.bool_),
        "question_state": jax.ShapeDtypeStruct(per_question, np.int32),
    })
    return shapes
