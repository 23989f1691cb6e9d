"""Conversion as a library: validated records → ArrayRecord shards plus `manifest.json`.

`python -m data_pipeline.convert` is the command line over it; `data_pipeline.beam_convert` renders
on Apache Beam between the same `prepare` and `write_output`. What each format loads, renders and
takes as options is `data_pipeline.format_registry`.

    from data_pipeline.conversion import convert
    convert("recipe", "data/smoke/vflash/recipe.json", "/tmp/vflash_shards", "data/tokenizer", workers=2)

The output appears atomically (written beside, then renamed), so an interrupted run never leaves a
half-written shard set behind a valid-looking manifest. Identical inputs and options give
byte-identical shards and manifest for any number of workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from data_pipeline import examples, shards
from data_pipeline import format_registry as registry
from data_pipeline.format_registry import SourceEntry
from data_pipeline.tokenizer import fingerprint, installed_template_family, load_tokenizer

log = logging.getLogger(__name__)
_RECORDS_PER_SHARD = 512
# The Beam runners `data_pipeline.beam_convert` takes (convert's --beam-runner).
BEAM_RUNNERS = ("DirectRunner", "DataflowRunner", "FlinkRunner", "SparkRunner")


_worker_renderer = None
_worker_error: BaseException | None = None
# Under fork, the jobs the workers inherit from the launching process (they render by index).
_worker_jobs: Sequence[tuple] = ()


def _init_worker(fmt: str, tokenizer_path: str, template_family: str | None = None,
                 options: Mapping[str, object] | None = None) -> None:
    global _worker_renderer, _worker_error
    logging.getLogger("data_pipeline.tokenizer").setLevel(logging.ERROR)
    try:
        _, render_options = _split_options(fmt, options)
        _worker_renderer = registry.get(fmt).make_renderer(load_tokenizer(tokenizer_path, template_family),
                                                           **render_options)
    except Exception as err:  # raised with the first job: a Pool restarts a failing initializer forever
        _worker_error = err


def _render_one(job: tuple) -> bytes:
    if _worker_error is not None:
        raise _worker_error
    record, entry = job
    return _worker_renderer.render(record, entry).to_bytes()


def _render_index(index: int) -> bytes:
    return _render_one(_worker_jobs[index])


def _can_fork() -> bool:
    """Whether workers may be forked from this process as it is.

    Forking copies a process without its other threads, so a lock one of them holds stays locked in
    the child. Only a process with no other Python thread and without JAX (whose runtime threads
    Python does not see; a training run converts its data in-process) is forked; HF tokenizers
    handles being forked itself.
    """
    return ("fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
            and "jax" not in sys.modules)


def _server_context() -> multiprocessing.context.BaseContext:
    """Workers forked from a server that imported this module once (spawn where there is none).

    Under spawn every worker starts an interpreter and imports transformers (and torch, which
    transformers' auto classes import when installed): 2-3 s of CPU each.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # no effect once this process's server is running
    return context


def _with_progress(rendered: Iterable[bytes], total: int, progress: bool) -> list[bytes]:
    """`rendered` as a list, counted on a progress bar that is closed (its line ended) before a refusal
    propagates: the refusal is then a line of its own, not the tail of the bar's (issue 54)."""
    with tqdm(rendered, total=total, desc="convert", disable=not progress) as bar:
        return list(bar)


def _chunksize(jobs: int, workers: int) -> int:
    # Large chunks: one message per chunk each way; a few chunks per worker still balance the load.
    return max(1, min(256, jobs // (8 * workers)))


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


def _split_options(fmt: str, options: Mapping[str, object] | None) -> tuple[dict, dict]:
    """(load options, render options) of `fmt`: its defaults, updated by the given ones."""
    spec = registry.get(fmt)
    given = {k: v for k, v in (options or {}).items() if v is not None}
    unknown = sorted(set(given) - set(spec.load_options) - set(spec.render_options))
    if unknown:
        flags = ", ".join("--" + name.replace("_", "-") for name in unknown)
        raise ValueError(f"{flags}: not an option of --format={fmt}")
    load = {k: given.get(k, v) for k, v in spec.load_options.items()}
    render = {k: given.get(k, v) for k, v in spec.render_options.items()}
    return load, render


@dataclass(frozen=True)
class Conversion:
    """A conversion loaded and checked in the launching process, ready to render.

    `jobs` are (record, entry name) in output order. Both runners (the local Pool below and
    `data_pipeline.beam_convert`) start from `prepare` and end in `write_output`, so the shards
    and the manifest come from one code path whatever rendered the examples.
    """

    fmt: str
    input_path: Path
    output: Path
    tokenizer: str | Path
    tok: object
    entries: list[SourceEntry]
    jobs: list[tuple]
    load_options: dict
    render_options: dict
    template_family: str | None
    additions: dict


def prepare(fmt: str, input_path: str | Path, output: str | Path, tokenizer: str | Path,
            overwrite: bool = False, options: Mapping[str, object] | None = None,
            template_family: str | None = None) -> Conversion:
    """Refuse a bad call, load the input, run the format's check: all before any rendering."""
    input_path, output = Path(input_path), Path(output)
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise FileExistsError(f"{output}: exists and is not empty; pass --overwrite to replace it")
    if fmt not in registry.FORMATS:
        raise ValueError(f"--format={fmt}: conversion supports {', '.join(sorted(registry.FORMATS))}")
    load_options, render_options = _split_options(fmt, options)
    tok = load_tokenizer(tokenizer, template_family)
    # What the manifest records and the workers install: the family itself ("auto" resolved), or none where
    # the tokenizer's own template marks assistant spans.
    template_family = installed_template_family(tok)
    # Built once here, so a bad option fails before any worker starts (a failing Pool initializer
    # would be restarted forever).
    registry.FORMATS[fmt].make_renderer(tok, **render_options)
    entries = registry.FORMATS[fmt].load(input_path, **load_options)
    jobs = [(record, entry.name) for entry in entries for record in entry.records]
    if not jobs:
        raise ValueError(f"{input_path}: no records to convert")
    check = registry.FORMATS[fmt].check
    additions = check(input_path, entries, str(tokenizer), **load_options) if check is not None else {}
    return Conversion(fmt, input_path, output, tokenizer, tok, entries, jobs, load_options, render_options,
                      template_family, additions)


def convert(fmt: str, input_path: str | Path, output: str | Path, tokenizer: str | Path,
            workers: int = 1, overwrite: bool = False, progress: bool = True,
            options: Mapping[str, object] | None = None, template_family: str | None = None) -> shards.Manifest:
    """`options`: the format's options (see format_registry); None values mean "not given"."""
    if workers <= 1:
        conv = prepare(fmt, input_path, output, tokenizer, overwrite, options, template_family)
        renderer = registry.get(fmt).make_renderer(conv.tok, **conv.render_options)  # the tokenizer prepare loaded
        rendered = _with_progress((renderer.render(record, entry).to_bytes() for record, entry in conv.jobs),
                                  len(conv.jobs), progress)
        return write_output(conv, rendered)
    if _can_fork():
        return _convert_forked(fmt, input_path, output, tokenizer, workers, overwrite, progress, options,
                               template_family)
    initargs = (fmt, str(tokenizer), template_family, dict(options or {}))
    # The workers start (and load the tokenizer) while this process reads and checks the input; an
    # error there (a bad call or bad input, refused by `prepare` as with one worker) ends them.
    with _server_context().Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        conv = prepare(fmt, input_path, output, tokenizer, overwrite, options, template_family)
        jobs = conv.jobs
        rendered = _with_progress(pool.imap(_render_one, jobs, chunksize=_chunksize(len(jobs), workers)),
                                  len(jobs), progress)
    return write_output(conv, rendered)


def _convert_forked(fmt: str, input_path: str | Path, output: str | Path, tokenizer: str | Path, workers: int,
                    overwrite: bool, progress: bool, options: Mapping[str, object] | None,
                    template_family: str | None) -> shards.Manifest:
    """Workers forked after reading: they inherit the renderer and the records, so nothing is imported,
    loaded or pickled again; only job indices go out and serialised Examples come back."""
    global _worker_renderer, _worker_jobs
    conv = prepare(fmt, input_path, output, tokenizer, overwrite, options, template_family)
    _worker_renderer = registry.get(fmt).make_renderer(conv.tok, **conv.render_options)
    _worker_jobs = conv.jobs
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            indices = range(len(conv.jobs))
            rendered = _with_progress(pool.imap(_render_index, indices,
                                                chunksize=_chunksize(len(indices), workers)), len(indices), progress)
    finally:
        _worker_renderer, _worker_jobs = None, ()
    return write_output(conv, rendered)


def write_output(conv: Conversion, rendered: Sequence[bytes]) -> shards.Manifest:
    """Write `rendered` (serialised Examples, in `conv.jobs` order) as shards + manifest, atomically."""
    if len(rendered) != len(conv.jobs):
        raise ValueError(f"{len(rendered)} rendered examples for {len(conv.jobs)} records")
    fmt, input_path, output, tokenizer, tok = conv.fmt, conv.input_path, conv.output, conv.tokenizer, conv.tok
    entries, template_family = conv.entries, conv.template_family
    stats = _statistics(rendered)
    base = input_path.parent
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        num_shards = -(-len(rendered) // _RECORDS_PER_SHARD)
        written = shards.write_shards(rendered, staging, num_shards)
        start = 0
        entry_ranges = []
        for entry in entries:
            entry_ranges.append({"name": entry.name, "repeat_time": entry.repeat_time,
                                 "start": start, "stop": start + len(entry.records), **entry.media_options})
            start += len(entry.records)
        manifest = shards.Manifest({
            "schema_version": shards.SCHEMA_VERSION,
            "format": fmt,
            "input": _relative(input_path, base),
            "sources": [{"path": _relative(f, base), "sha256": shards.sha256_file(f), "entry": e.name}
                        for e in entries for f in e.files],
            "entries": entry_ranges,
            "tokenizer": {"source": str(tokenizer), "fingerprint": fingerprint(tok).to_json(),
                          "vocab_size": len(tok)},
            "counts": stats["counts"],
            "media": stats["media"],
            # Only the options of this format (none for vflash/recipe), so older manifests keep their bytes.
            # The runner (local/beam, workers) is deliberately absent: it does not change the output.
            "options": {"records_per_shard": _RECORDS_PER_SHARD, **conv.load_options, **conv.render_options,
                        **({"template_family": template_family} if template_family else {})},
            "shards": written,
            **conv.additions,
        })
        manifest.write(staging)
        if output.exists():
            shutil.rmtree(output)
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _token_counts(example: shards.Example) -> tuple[int, int]:
    """(tokens, supervised tokens) of one Example.

    Valen Examples hold pieces, not a sequence: their tokens are the pieces' total and their
    supervised unit is the scoring position of each labeled question's branches.
    """
    arrays = example.arrays
    if examples.kind_of(example) == examples.TOKENS:
        return len(arrays["input_ids"]), int((arrays["target_weights"] > 0).sum())
    pieces = ("state_ids", "instruction_ids", "candidate_ids", "suffix_ids")
    labeled = arrays["labeled"][arrays["candidate_question"]] if len(arrays["candidate_question"]) else []
    return sum(len(arrays[name]) for name in pieces), int(sum(labeled))


def _statistics(rendered: Sequence[bytes]) -> dict:
    """Totals over the Examples; `skipped` and `overlaps` sum the counters renderers put in meta.

    DESIGN: "a deliberate skip is counted and reported" (vakforge drops overlapping turns, seed 002
    "log how many"). `overlaps` appears only for formats that report it.
    """
    tokens = supervised = longest = 0
    media: dict[str, str] = {}
    skipped: dict[str, int] = {}
    overlaps: dict[str, int] = {}
    for data in rendered:
        example = shards.Example.from_bytes(data)
        length, trained = _token_counts(example)
        tokens += length
        supervised += trained
        longest = max(longest, length)
        for item in examples.media_headers(example):
            media.setdefault(item["sha256"], Path(item["path"]).name)
        meta = examples.meta_of(example)
        for totals, counters in ((skipped, meta.skipped), (overlaps, meta.overlaps)):
            for name, count in (counters or {}).items():
                totals[name] = totals.get(name, 0) + count
    counts = {"records": len(rendered), "skipped": dict(sorted(skipped.items())), "tokens": tokens,
              "supervised_tokens": supervised, "longest_example": longest}
    if overlaps:
        counts["overlaps"] = dict(sorted(overlaps.items()))
    return {
        "counts": counts,
        "media": [{"sha256": digest, "name": name} for digest, name in sorted(media.items())],
    }
