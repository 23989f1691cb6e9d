"""Convert validated records into ArrayRecord shards plus `manifest.json`.

Example (from the repository root):

    python -m data_pipeline.convert --format=recipe --input=data/smoke/vflash/recipe.json \
        --output=/tmp/vflash_shards --tokenizer=data/tokenizer --workers=2

`--format=vflash` takes one JSONL file; `--format=recipe` takes a VFlash recipe and converts
every entry in recipe order; `--format=chat` one chat JSONL file (`--assistant-turns=all|last`);
`--format=prepared` a prepared zip or directory (`--max-seq-length=N`); `--format=vakforge` a
vakforge.jsonl beside its splits.json (`--split=NAME`, `--overlap=merge|drop`,
`--assistant-turns`). An option a format does not take is refused, never ignored.
`--template-family=chatml|llama3` installs a training template for a tokenizer without one.

    python -m data_pipeline.convert --format=vakforge --input=data/smoke/vakforge/vakforge.jsonl \
        --output=/tmp/vakforge_train --tokenizer=data/tokenizer --split=train --overlap=drop

The output appears atomically (written beside, then renamed), so
an interrupted run never leaves a half-written shard set behind a valid-looking manifest.
Identical inputs and options give byte-identical shards and manifest for any `--workers`.

`--runner=beam` renders on Apache Beam instead of a local process pool (optional extra `beam`;
`--beam-runner=DirectRunner|DataflowRunner|FlinkRunner|SparkRunner`, repeatable
`--beam-option KEY=VALUE` passed to the pipeline); the output is the same bytes. See
`data_pipeline/beam_convert.py` for what a cluster run needs.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from data_pipeline import shards
from data_pipeline.chat_templates import TRAINING_TEMPLATES
from data_pipeline.formats.chat import read_chat
from data_pipeline.formats.errors import FormatError
from data_pipeline.formats.recipe import read_recipe_records
from data_pipeline.formats.valen import read_valen
from data_pipeline.formats.vflash import read_vflash
from data_pipeline.render.chat import ASSISTANT_TURNS, ChatRenderer
from data_pipeline.render.common import RenderError
from data_pipeline.render.prepared import PreparedRenderer, check_prepared, read_prepared_rows
from data_pipeline.render.vakforge import OVERLAP_POLICIES, VakforgeRenderer, read_vakforge_items
from data_pipeline.render.valen import ValenRenderer
from data_pipeline.render.vflash import VFlashRenderer
from data_pipeline.tokenizer import fingerprint, load_tokenizer

log = logging.getLogger(__name__)
_RECORDS_PER_SHARD = 512
# --runner=beam: the Beam runners --beam-runner takes (data_pipeline/beam_convert.py).
BEAM_RUNNERS = ("DirectRunner", "DataflowRunner", "FlinkRunner", "SparkRunner")


@dataclass(frozen=True)
class SourceEntry:
    """One named group of records (a recipe entry, or a whole file), kept in input order."""

    name: str
    files: tuple[Path, ...]
    repeat_time: float
    records: list
    # What the loader needs to treat this entry's media (recipe `data_augment`, `visual_aug`,
    # `video_reader_backend`, seed 004); written into the manifest's entry when non-empty.
    media_options: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class ConvertFormat:
    """How one format reaches shards: read its input into entries; render one record.

    `make_renderer(tokenizer, **render_options)` returns an object with
    `render(record, entry_name) -> Example`; it runs in worker processes, so it must be a picklable
    module-level callable. `load(path, **load_options)` runs once in the main process. Each
    options mapping names the options the format takes, with their defaults.

    `check(input_path, entries, tokenizer_path, **load_options)`, when given, runs in the main
    process after loading and before rendering, and returns additions to manifest.json. It exists
    for checks that need the tokenizer path rather than the training tokenizer (prepared rows are
    compared with the tokenizer as shipped, seed 003) and for provenance only the loader knows
    (vakforge's manifest_hash, seed 002 "Adapters").
    """

    load: Callable[..., list[SourceEntry]]
    make_renderer: Callable[..., object]
    load_options: Mapping[str, object] = field(default_factory=dict)
    render_options: Mapping[str, object] = field(default_factory=dict)
    check: Callable[..., dict] | None = None


def _load_vflash(path: Path) -> list[SourceEntry]:
    return [SourceEntry(path.stem, (path,), 1.0, read_vflash(path))]


def _load_recipe(path: Path) -> list[SourceEntry]:
    return [SourceEntry(entry.name, tuple(entry.annotation), entry.repeat_time, records, _media_options(entry))
            for entry, records in read_recipe_records(path)]


def _media_options(entry) -> dict:
    aug = entry.visual_aug
    options = {"data_augment": entry.data_augment, "video_reader_backend": entry.video_reader_backend}
    if aug is not None:
        options["visual_aug"] = {"prob": aug.prob, "views": aug.views if isinstance(aug.views, str) else list(aug.views),
                                 "ops": list(aug.ops), "severity": list(aug.severity),
                                 "zoom_max_severity": aug.zoom_max_severity}
    return options


def _load_valen(path: Path) -> list[SourceEntry]:
    return [SourceEntry(path.stem, (path,), 1.0, read_valen(path))]


def _load_chat(path: Path) -> list[SourceEntry]:
    return [SourceEntry(path.stem, (path,), 1.0, read_chat(path))]


def _load_prepared(path: Path, max_seq_length: int | None) -> list[SourceEntry]:
    _, rows = read_prepared_rows(path)
    files = (path,) if path.is_file() else tuple(sorted(p for p in path.rglob("*") if p.is_file()))
    return [SourceEntry(path.stem, files, 1.0, rows)]


def _check_prepared(path: Path, entries: list[SourceEntry], tokenizer_path: str,
                    max_seq_length: int | None) -> dict:
    return check_prepared(path, entries[0].records, tokenizer_path, max_seq_length)


def _load_vakforge(path: Path, split: str | None) -> list[SourceEntry]:
    items = read_vakforge_items(path, split)
    return [SourceEntry(path.stem if split is None else split, (path, path.parent / "splits.json"), 1.0, items)]


def _check_vakforge(path: Path, entries: list[SourceEntry], tokenizer_path: str, split: str | None) -> dict:
    # Seed 002, "Adapters": the output names the exact data it came from (one hash per manifest).
    return {"manifest_hash": entries[0].records[0].manifest_hash}


FORMATS: dict[str, ConvertFormat] = {
    "valen": ConvertFormat(_load_valen, ValenRenderer),
    "vflash": ConvertFormat(_load_vflash, VFlashRenderer),
    "recipe": ConvertFormat(_load_recipe, VFlashRenderer),
    "chat": ConvertFormat(_load_chat, ChatRenderer, render_options={"assistant_turns": "all"}),
    "prepared": ConvertFormat(_load_prepared, PreparedRenderer, load_options={"max_seq_length": None},
                              check=_check_prepared),
    "vakforge": ConvertFormat(_load_vakforge, VakforgeRenderer, load_options={"split": None},
                              render_options={"overlap": "merge", "assistant_turns": "all"},
                              check=_check_vakforge),
}


_worker_renderer = None


def _init_worker(fmt: str, tokenizer_path: str, template_family: str | None = None,
                 render_options: Mapping[str, object] | None = None) -> None:
    global _worker_renderer
    logging.getLogger("data_pipeline.tokenizer").setLevel(logging.ERROR)
    _worker_renderer = FORMATS[fmt].make_renderer(load_tokenizer(tokenizer_path, template_family),
                                                  **(render_options or {}))


def _render_one(job: tuple) -> bytes:
    record, entry = job
    return _worker_renderer.render(record, entry).to_bytes()


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


def _split_options(fmt: str, options: Mapping[str, object] | None) -> tuple[dict, dict]:
    """(load options, render options) of `fmt`: its defaults, updated by the given ones."""
    spec = FORMATS[fmt]
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
    if fmt not in FORMATS:
        raise ValueError(f"--format={fmt}: conversion supports {', '.join(sorted(FORMATS))}")
    load_options, render_options = _split_options(fmt, options)
    tok = load_tokenizer(tokenizer, template_family)
    # Built once here, so a bad option fails before any worker starts (a failing Pool initializer
    # would be restarted forever).
    FORMATS[fmt].make_renderer(tok, **render_options)
    entries = FORMATS[fmt].load(input_path, **load_options)
    jobs = [(record, entry.name) for entry in entries for record in entry.records]
    if not jobs:
        raise ValueError(f"{input_path}: no records to convert")
    check = FORMATS[fmt].check
    additions = check(input_path, entries, str(tokenizer), **load_options) if check is not None else {}
    return Conversion(fmt, input_path, output, tokenizer, tok, entries, jobs, load_options, render_options,
                      template_family, additions)


def convert(fmt: str, input_path: str | Path, output: str | Path, tokenizer: str | Path,
            workers: int = 1, overwrite: bool = False, progress: bool = True,
            options: Mapping[str, object] | None = None, template_family: str | None = None) -> shards.Manifest:
    """`options`: the format's options (see FORMATS); None values mean "not given"."""
    conv = prepare(fmt, input_path, output, tokenizer, overwrite, options, template_family)
    jobs = conv.jobs
    initargs = (fmt, str(tokenizer), template_family, conv.render_options)
    if workers > 1:
        context = multiprocessing.get_context("spawn")  # fork after JAX/threads is unsafe
        with context.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
            rendered = list(tqdm(pool.imap(_render_one, jobs, chunksize=8), total=len(jobs),
                                 desc="convert", disable=not progress))
    else:
        _init_worker(*initargs)
        rendered = [_render_one(job) for job in tqdm(jobs, desc="convert", disable=not progress)]
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
    if "input_ids" in arrays:
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
        for item in example.meta.get("media", []):
            media.setdefault(item["sha256"], Path(item["path"]).name)
        for totals, key in ((skipped, "skipped"), (overlaps, "overlaps")):
            for name, count in example.meta.get(key, {}).items():
                totals[name] = totals.get(name, 0) + count
    counts = {"records": len(rendered), "skipped": dict(sorted(skipped.items())), "tokens": tokens,
              "supervised_tokens": supervised, "longest_example": longest}
    if overlaps:
        counts["overlaps"] = dict(sorted(overlaps.items()))
    return {
        "counts": counts,
        "media": [{"sha256": digest, "name": name} for digest, name in sorted(media.items())],
    }


def _convert_beam(args: argparse.Namespace, options: Mapping[str, object]) -> shards.Manifest:
    # Imported here: apache-beam is an optional extra the local runner never needs.
    try:
        from data_pipeline.beam_convert import convert_beam, parse_beam_options
    except ImportError as err:
        raise ValueError(f"--runner=beam needs apache-beam (pip install 'valen-jax[beam]'): {err}") from err
    if args.workers != 1:
        raise ValueError("--workers is for --runner=local; with --runner=beam set the runner's own "
                         "parallelism, e.g. --beam-option direct_num_workers=4")
    return convert_beam(args.format, args.input, args.output, args.tokenizer, args.overwrite, options=options,
                        template_family=args.template_family, beam_runner=args.beam_runner or "DirectRunner",
                        beam_options=parse_beam_options(args.beam_option))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", required=True, choices=sorted(FORMATS))
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer directory or hub name")
    parser.add_argument("--workers", type=int, default=1, help="--runner=local: rendering processes")
    parser.add_argument("--runner", choices=("local", "beam"), default="local",
                        help="local: a process pool on this machine; beam: an Apache Beam pipeline (extra `beam`)")
    parser.add_argument("--beam-runner", choices=BEAM_RUNNERS,
                        help="--runner=beam: the Beam runner (DirectRunner)")
    parser.add_argument("--beam-option", action="append", metavar="KEY=VALUE",
                        help="--runner=beam: a pipeline option, e.g. temp_location=gs://b/tmp (repeatable)")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--template-family", choices=sorted(TRAINING_TEMPLATES),
                        help="install this training chat template when the tokenizer's has no generation markers")
    # Format options: left unset (None) they take the format's default; set for a format that does
    # not take them, they are refused.
    parser.add_argument("--assistant-turns", choices=ASSISTANT_TURNS, help="chat, vakforge: loss policy (all)")
    parser.add_argument("--split", help="vakforge: convert only this split of splits.json (all)")
    parser.add_argument("--overlap", choices=OVERLAP_POLICIES, help="vakforge: overlapping turns (merge)")
    parser.add_argument("--max-seq-length", type=int, help="prepared: refuse rows longer than this (unchecked)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = {"assistant_turns": args.assistant_turns, "split": args.split, "overlap": args.overlap,
               "max_seq_length": args.max_seq_length}
    try:
        if args.runner == "beam":
            manifest = _convert_beam(args, options)
        else:
            if args.beam_runner or args.beam_option:
                raise ValueError("--beam-runner and --beam-option need --runner=beam")
            manifest = convert(args.format, args.input, args.output, args.tokenizer, args.workers,
                               args.overwrite, options=options, template_family=args.template_family)
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
