"""Train/eval separation, checked before the train step compiles (seed 003, issue 17).

Seed 003: "Keep training and evaluation datasets separate ... an example that appears in both
datasets inflates the score." The run compares its train and eval shard sets on what the shards
already hold, so nothing is read twice from the inputs:

- `duplicate examples`: the SHA-256 of an Example's arrays (token ids, weights, Valen pieces and
  labels, media bytes), i.e. the same rendered content;
- `shared group_ids`: Valen records of one `group_id` (seed 000: "the same source material and its
  variants share one group ID");
- `shared media`: a media item (image, video frame, audio) with the same `sha256` in both sets;
- `shared conversations`: vakforge conversation ids (`meta.id`).

Vakforge speakers are not in the shards; one manifest's splits are checked for shared speakers by
the vakforge reader (`data_pipeline/formats/vakforge_splits.py`) before conversion.

Overlap is a ConfigError naming the counts and the first examples (file:line) of each kind,
unless `config.data.allow_overlap=True`: then the counts are logged and returned, and the run
records them in the checkpoint meta and in metrics.jsonl.

    from valen_jax.data.separation import check_separation
    counts = check_separation(train_set, eval_set, allow_overlap=False)   # {} when separate
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from data_pipeline import examples as ex
from data_pipeline.shards import Example, read_shard
from valen_jax.data.sources import ShardSet, mixture_of
from valen_jax.errors import ConfigError

log = logging.getLogger(__name__)

KINDS = ("duplicate_examples", "shared_group_ids", "shared_media", "shared_conversations")
# How many examples of each kind the error names.
SHOWN = 3


def example_digest(example: Example) -> str:
    """SHA-256 over an Example's arrays (names, dtypes, shapes, bytes): its rendered content, not its
    provenance (source, line), so the same record in two files has one digest. Media count by the
    digests their headers already carry, not by hashing their bytes again."""
    digest = hashlib.sha256()
    for name in sorted(example.arrays):
        if ex.MEDIA_ARRAY.fullmatch(name):
            continue
        array = example.arrays[name]
        digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.tobytes())
    for header in ex.media_headers(example):
        digest.update(f"media\0{header.get('sha256')}\0{header.get('frame_index')}\0{header.get('resize')}\0".encode())
    return digest.hexdigest()


@dataclass
class _Keys:
    """Per kind, key -> `file:line` of the first example holding it."""

    by_kind: dict[str, dict[str, str]] = field(default_factory=lambda: {kind: {} for kind in KINDS})

    def add(self, kind: str, key, where: str) -> None:
        if key is not None and key != "":
            self.by_kind[kind].setdefault(str(key), where)


def _examples(sources) -> Iterator[Example]:
    for shard_set, _ in mixture_of(sources):
        for path in shard_set.manifest.shard_paths:
            yield from read_shard(shard_set.directory / path)


def keys_of(sources) -> _Keys:
    keys = _Keys()
    for example in _examples(sources):
        where = ex.where(example)
        meta = ex.meta_of(example)
        keys.add("duplicate_examples", example_digest(example), where)
        keys.add("shared_group_ids", meta.group_id, where)
        keys.add("shared_conversations", meta.id, where)
        for header in ex.media_headers(example):
            keys.add("shared_media", header.get("sha256"), where)
    return keys


def overlap(train: ShardSet | list, eval_set: ShardSet | list) -> dict[str, list[tuple[str, str, str]]]:
    """Per kind, the shared keys as (key, train file:line, eval file:line), in eval order."""
    train_keys, eval_keys = keys_of(train), keys_of(eval_set)
    return {kind: [(key, train_keys.by_kind[kind][key], where) for key, where in eval_keys.by_kind[kind].items()
                   if key in train_keys.by_kind[kind]]
            for kind in KINDS}


def check_separation(train, eval_set, *, allow_overlap: bool, train_name: str = "train",
                     eval_name: str = "eval") -> dict[str, int]:
    """The overlap counts (only kinds with overlap; {} when separate). Overlap is a ConfigError unless
    `allow_overlap`, which logs the counts instead."""
    shared = overlap(train, eval_set)
    counts = {kind: len(found) for kind, found in shared.items() if found}
    if not counts:
        log.info("train/eval separation: %s and %s share no example, group_id, media or conversation",
                 train_name, eval_name)
        return {}
    lines = []
    for kind, found in shared.items():
        if found:
            first = "; ".join(f"{key[:16]} (train {t}, eval {e})" for key, t, e in found[:SHOWN])
            lines.append(f"{len(found)} {kind.replace('_', ' ')}: {first}")
    described = " | ".join(lines)
    if not allow_overlap:
        raise ConfigError(f"config.data.train ({train_name}) and config.data.eval ({eval_name}) overlap: "
                          f"{described}. Split by group (python -m data_pipeline.split) or set "
                          "config.data.allow_overlap=True to train anyway (counts go to the meta and metrics)")
    log.warning("train/eval overlap allowed (config.data.allow_overlap): %s", described)
    return counts
