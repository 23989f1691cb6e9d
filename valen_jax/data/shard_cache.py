"""Shards for a run's data: a shard directory as is, or a JSONL/recipe converted once into a cache.

`config_shards(config, which, ...)` is how a training run gets the shards of its `data.train` or
`data.eval`: every converter option comes from the config in one place (the format and its options,
the tokenizer and its `data.template_family`), so each conversion a run triggers, of either set and in
any format, converts as `python -m data_pipeline.convert --template-family=…` would (issue 54: a hub
tokenizer's inference template without `{% generation %}` markers was refused because the family
never reached the converter). A file the configured format cannot read, which another format reads,
is refused naming the config key to set and the formats that fit.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from data_pipeline import conversion as converter
from data_pipeline import format_registry
from data_pipeline.formats.errors import FormatError
from data_pipeline.shards import Manifest, ShardError, sha256_file
from valen_jax.data.sources import ShardSet
from valen_jax.errors import ConfigError

log = logging.getLogger(__name__)


def _input_key(fmt: str, path: Path, fingerprint: dict[str, str], options: dict) -> str:
    digest = hashlib.sha256()
    digest.update(f"{fmt}\n{path.resolve()}\n{sorted(fingerprint.items())}\n{sorted(options.items())}\n".encode())
    digest.update(sha256_file(path).encode())
    return digest.hexdigest()[:16]


# A run's two data sets: (config.data key of the data, of its format, of its converter options).
SETS = {"train": ("train", "format", "train_options"), "eval": ("eval", "eval_format", "eval_options")}


def config_shards(config, which: str, cache_dir: Path, fingerprint: dict[str, str]) -> ShardSet:
    """The shards of the run's `which` set ("train" or "eval"), converted with the config's converter
    options: `data.<format key>`, `data.<which>_options`, `data.tokenizer` and `data.template_family`.

    A FormatError where another format reads the file is a ConfigError naming the format key."""
    data = config.data
    source_key, format_key, options_key = SETS[which]
    fmt, source, options = data[format_key], data[source_key], data[options_key].to_dict()
    try:
        return ensure_shards(fmt, source, cache_dir, data.tokenizer, fingerprint, options,
                             template_family=data.template_family)
    except FormatError as error:
        fitting = formats_that_read(Path(source), exclude=fmt, options=options)
        if not fitting:
            raise  # the file's own problems, PATH:LINE each: no other format reads it either
        first = str(error.problems[0])
        raise ConfigError(f"config.data.{format_key}={fmt!r} cannot read config.data.{source_key}={str(source)!r} "
                          f"({first}); it reads as {' or '.join(fitting)}: set --config.data.{format_key}="
                          f"{fitting[0]}") from None


def formats_that_read(path: Path, exclude: str, options: Mapping[str, Any]) -> list[str]:
    """The formats (other than `exclude`) whose validator accepts the file `path` (media unchecked): what a
    refusal of the configured format suggests instead. Runs only on that error path; each is one read."""
    if not path.is_file():
        return []
    fitting = []
    for name, spec in format_registry.FORMATS.items():
        if name == exclude or name == "prepared":  # prepared data is a zip or folder, never a JSONL/recipe
            continue
        given = {key: options[key] for key in spec.validate_options if key in options}
        try:
            spec.validate(path, False, **given)
        except Exception:  # noqa: BLE001 - whatever stops a validator, that format does not read the file
            continue
        fitting.append(name)
    return fitting


def ensure_shards(fmt: str, source: str | Path, cache_dir: Path, tokenizer_path: str | Path,
                  fingerprint: dict[str, str], options: Mapping[str, Any] | None = None,
                  template_family: str | None = None) -> ShardSet:
    """Shards for `source`: a shard directory as is, or a JSONL/recipe converted once into the cache.

    `template_family` (config.data.template_family) installs that family's training template when the
    tokenizer's own has no `{% generation %}` markers (a hub checkpoint's), as it did for the run's own
    tokenizer; a tokenizer that has them (a workdir's) renders with its own.

    The cache key covers the input's bytes, the tokenizer fingerprint and the converter
    `options` (e.g. vakforge's `split`), so edited data, another tokenizer or another split
    converts anew instead of silently reusing stale shards. The template family is covered by the
    fingerprint: it is the tokenizer's as loaded with that family, whose chat template digest is the
    installed template's, so a family that changes the rendering changes the key, and one that does
    not (the tokenizer has markers) keeps it, and evaluation with the workdir's tokenizer finds the
    shards training made. A shard directory made with another
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
        converter.convert(fmt, source, target, tokenizer_path, overwrite=True, progress=False, options=options,
                          template_family=template_family)
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
