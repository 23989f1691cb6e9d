"""Convert validated records into ArrayRecord shards plus `manifest.json`.

Example (from the repository root):

    python -m data_pipeline.convert --format=recipe --input=data/smoke/vflash/recipe.json \
        --output=/tmp/vflash_shards --tokenizer=data/tokenizer --workers=2

`--format=vflash` takes one JSONL file; `--format=recipe` takes a VFlash recipe and converts
every entry in recipe order. The output appears atomically (written beside, then renamed), so
an interrupted run never leaves a half-written shard set behind a valid-looking manifest.
Identical inputs and options give byte-identical shards and manifest for any `--workers`.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from data_pipeline import shards
from data_pipeline.formats.errors import FormatError
from data_pipeline.formats.recipe import read_recipe_records
from data_pipeline.formats.vflash import read_vflash
from data_pipeline.render.common import RenderError
from data_pipeline.render.vflash import VFlashRenderer
from data_pipeline.tokenizer import fingerprint, load_tokenizer

log = logging.getLogger(__name__)
_RECORDS_PER_SHARD = 512


@dataclass(frozen=True)
class SourceEntry:
    """One named group of records (a recipe entry, or a whole file), kept in input order."""

    name: str
    files: tuple[Path, ...]
    repeat_time: float
    records: list


@dataclass(frozen=True)
class ConvertFormat:
    """How one format reaches shards: read its input into entries; render one record.

    `make_renderer(tokenizer)` returns an object with `render(record, entry_name) -> Example`;
    it runs in worker processes, so it must be a picklable module-level callable.
    """

    load: Callable[[Path], list[SourceEntry]]
    make_renderer: Callable[[PreTrainedTokenizerBase], object]


def _load_vflash(path: Path) -> list[SourceEntry]:
    return [SourceEntry(path.stem, (path,), 1.0, read_vflash(path))]


def _load_recipe(path: Path) -> list[SourceEntry]:
    return [SourceEntry(entry.name, tuple(entry.annotation), entry.repeat_time, records)
            for entry, records in read_recipe_records(path)]


FORMATS: dict[str, ConvertFormat] = {
    "vflash": ConvertFormat(_load_vflash, VFlashRenderer),
    "recipe": ConvertFormat(_load_recipe, VFlashRenderer),
}


_worker_renderer = None


def _init_worker(fmt: str, tokenizer_path: str) -> None:
    global _worker_renderer
    logging.getLogger("data_pipeline.tokenizer").setLevel(logging.ERROR)
    _worker_renderer = FORMATS[fmt].make_renderer(load_tokenizer(tokenizer_path))


def _render_one(job: tuple) -> bytes:
    record, entry = job
    return _worker_renderer.render(record, entry).to_bytes()


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


def convert(fmt: str, input_path: str | Path, output: str | Path, tokenizer: str | Path,
            workers: int = 1, overwrite: bool = False, progress: bool = True) -> shards.Manifest:
    input_path, output = Path(input_path), Path(output)
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise FileExistsError(f"{output}: exists and is not empty; pass --overwrite to replace it")
    if fmt not in FORMATS:
        raise ValueError(f"--format={fmt}: conversion supports {', '.join(sorted(FORMATS))}")
    tok = load_tokenizer(tokenizer)
    entries = FORMATS[fmt].load(input_path)
    jobs = [(record, entry.name) for entry in entries for record in entry.records]
    if not jobs:
        raise ValueError(f"{input_path}: no records to convert")
    if workers > 1:
        context = multiprocessing.get_context("spawn")  # fork after JAX/threads is unsafe
        with context.Pool(workers, initializer=_init_worker, initargs=(fmt, str(tokenizer))) as pool:
            rendered = list(tqdm(pool.imap(_render_one, jobs, chunksize=8), total=len(jobs),
                                 desc="convert", disable=not progress))
    else:
        _init_worker(fmt, str(tokenizer))
        rendered = [_render_one(job) for job in tqdm(jobs, desc="convert", disable=not progress)]

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
                                 "start": start, "stop": start + len(entry.records)})
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
            "options": {"records_per_shard": _RECORDS_PER_SHARD},
            "shards": written,
        })
        manifest.write(staging)
        if output.exists():
            shutil.rmtree(output)
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _statistics(rendered: Sequence[bytes]) -> dict:
    tokens = supervised = longest = 0
    media: dict[str, str] = {}
    for data in rendered:
        example = shards.Example.from_bytes(data)
        length = len(example.arrays["input_ids"])
        tokens += length
        supervised += int((example.arrays["target_weights"] > 0).sum())
        longest = max(longest, length)
        for item in example.meta.get("media", []):
            media.setdefault(item["sha256"], Path(item["path"]).name)
    return {
        "counts": {"records": len(rendered), "skipped": {}, "tokens": tokens,
                   "supervised_tokens": supervised, "longest_example": longest},
        "media": [{"sha256": digest, "name": name} for digest, name in sorted(media.items())],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", required=True, choices=sorted(FORMATS))
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer directory or hub name")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        manifest = convert(args.format, args.input, args.output, args.tokenizer, args.workers, args.overwrite)
    except FormatError as err:
        print(err, file=sys.stderr)
        return 1
    except (RenderError, FileExistsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    counts = manifest.data["counts"]
    print(f"{args.output}: {counts['records']} records, {counts['tokens']} tokens, "
          f"{counts['supervised_tokens']} supervised, longest {counts['longest_example']}, "
          f"skipped {sum(counts['skipped'].values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
