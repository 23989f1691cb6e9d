"""Shards for a run's data: a shard directory as is, or a JSONL/recipe converted once into a cache."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from data_pipeline import conversion as converter
from data_pipeline.shards import Manifest, ShardError, sha256_file
from valen_jax.data.sources import ShardSet

log = logging.getLogger(__name__)


def _input_key(fmt: str, path: Path, fingerprint: dict[str, str], options: dict) -> str:
    digest = hashlib.sha256()
    digest.update(f"{fmt}\n{path.resolve()}\n{sorted(fingerprint.items())}\n{sorted(options.items())}\n".encode())
    digest.update(sha256_file(path).encode())
    return digest.hexdigest()[:16]


def ensure_shards(fmt: str, source: str | Path, cache_dir: Path, tokenizer_path: str | Path,
                  fingerprint: dict[str, str], options: Mapping[str, Any] | None = None) -> ShardSet:
    """Shards for `source`: a shard directory as is, or a JSONL/recipe converted once into the cache.

    The cache key covers the input's bytes, the tokenizer fingerprint and the converter
    `options` (e.g. vakforge's `split`), so edited data, another tokenizer or another split
    converts anew instead of silently reusing stale shards. A shard directory made with another
    tokenizer is refused (ShardError naming both fingerprints). A shard directory is used as it was
    converted (issue 27): its manifest's own options are logged, and config `options` that say
    otherwise are one warning line, not a refusal, since `python -m data_pipeline.convert` is the
    documented way to make shards and a config's defaults (chat's `assistant_turns`, vakforge's
    `split`) cannot know the options a user converted with.
    """
    source = Path(source)
    options = dict(options or {})
    if source.is_dir():
        shard_set = ShardSet.open(source, fingerprint)
        report_options(shard_set.manifest, options, source)
        return shard_set
    target = cache_dir / f"{source.stem}-{_input_key(fmt, source, fingerprint, options)}"
    # Processes sharing a workdir must not convert into the same folder at once: process 0
    # converts, the others wait at a barrier, then everyone opens the same shards.
    if jax.process_index() == 0 and not _cached(target, source, fingerprint):
        log.info("converting %s → %s", source, target)
        converter.convert(fmt, source, target, tokenizer_path, overwrite=True, progress=False, options=options)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"shards ready: {target.name}")
    return ShardSet.open(target, fingerprint)


def report_options(manifest: Manifest, options: Mapping[str, Any], source: Path) -> None:
    """Log the converter options a shard directory was made with; warn (one line) where `options`, the
    config's, give another value for an option the manifest records (one the manifest does not record,
    such as vakforge's `split` on shards made from one split file, is named too)."""
    made_with = dict(manifest.data.get("options", {}))
    log.info("%r: ready shards, converted with options %s", str(source), made_with)
    differ = {key: value for key, value in options.items() if made_with.get(key, _ABSENT) != value}
    if differ:
        shown = ", ".join(f"{key}={value!r} (shards: {made_with.get(key, 'not recorded')!r})"
                          for key, value in sorted(differ.items()))
        log.warning("%r: ready shards are used as converted; the config's converter options differ: %s",
                    str(source), shown)


_ABSENT = object()


def _cached(target: Path, source: Path, fingerprint: dict[str, str]) -> bool:
    try:
        cached = ShardSet.open(target, fingerprint)
    except ShardError:
        return False
    if _sources_current(cached.manifest, source):
        return True
    log.info("%s: annotation files changed since conversion; converting again", source)
    return False


def _sources_current(manifest: Manifest, source: Path) -> bool:
    """The recipe's annotation files (listed with digests in the manifest) are unchanged."""
    for entry in manifest.data["sources"]:
        path = Path(entry["path"])
        path = path if path.is_absolute() else source.parent / path
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            return False
    return True


def summary(shard_set: ShardSet) -> dict[str, Any]:
    counts = dict(shard_set.manifest.data["counts"])
    return {"dir": str(shard_set.directory), **counts}
