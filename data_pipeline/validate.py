"""Validate input files of one format and report every problem (DESIGN, "Contracts").

Example:

    python -m data_pipeline.validate --format=recipe data/smoke/vflash/recipe.json
    python -m data_pipeline.validate --format=vflash data/smoke/vflash/boxes.jsonl --json
    python -m data_pipeline.validate --format=valen data/smoke/valen/train.jsonl
    python -m data_pipeline.validate --format=vakforge data/smoke/vakforge/vakforge.jsonl
    python -m data_pipeline.validate --format=vakforge --export-schema   # writes ./vakforge.schema.json

Exit 0 with one summary line per file on stdout; exit 1 with one `PATH:LINE: FIELD: message`
line per problem on stderr (with `--json`, stdout holds only a JSON list of the problems, empty on
success); exit 2 for a usage error or a format whose validator is not implemented yet.
A recipe is validated together with every annotation file it names.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from data_pipeline.formats.chat import chat_diagnostics, read_chat
from data_pipeline.formats.errors import FormatError, Problem
from data_pipeline.formats.prepared import read_prepared
from data_pipeline.formats.recipe import read_recipe_records
from data_pipeline.formats.vakforge import export_schema, read_vakforge
from data_pipeline.formats.valen import check_valen
from data_pipeline.formats.vflash import read_vflash

FORMATS = ("valen", "vflash", "recipe", "chat", "vakforge", "prepared")


def _valen(path: Path, check_media: bool) -> str:
    # The streaming pass: builds no records, so memory stays flat however long the file is.
    return f"{check_valen(path, check_media=check_media)} OK"


def _vflash(path: Path, check_media: bool) -> str:
    return f"{len(read_vflash(path, check_media=check_media))} records OK"


def _recipe(path: Path, check_media: bool) -> str:
    entries = read_recipe_records(path, check_media=check_media)
    records = sum(len(records) for _, records in entries)
    return f"{len(entries)} entries, {records} records OK"


def _chat(path: Path, check_media: bool) -> str:
    records = read_chat(path, check_media=check_media)
    # Seed 003: diagnostics, not findings; they never fail a file.
    return f"{len(records)} records OK; {chat_diagnostics(records).summary()}"


def _prepared(path: Path, check_media: bool) -> str:
    # PATH is a prepared zip, or a directory laid out like one; there is no media to check.
    stats = read_prepared(path).stats
    rows, tokens = sum(s.rows for s in stats), sum(s.tokens for s in stats)
    supervised, longest = sum(s.supervised_tokens for s in stats), max(s.longest_row for s in stats)
    return f"{len(stats)} files, {rows} rows, {tokens} tokens, {supervised} supervised, longest row {longest} OK"


def _vakforge(path: Path, check_media: bool, allow_unconsented: bool = False) -> str:
    records = read_vakforge(path, allow_unconsented=allow_unconsented, check_media=check_media)
    return f"{len(records)} conversations OK"


# Formats whose records have an exported JSON Schema (seed 002: vakforge.schema.json).
SCHEMA_EXPORTERS: dict[str, tuple[str, Callable[[Path], Path]]] = {
    "vakforge": ("vakforge.schema.json", export_schema),
}
# Options only some formats take, passed to their validator as keywords.
FORMAT_OPTIONS = {"allow_unconsented": ("vakforge",)}


# Format name -> validator returning a one-line summary or raising FormatError.
# A format without a validator yet is left out; the CLI says so instead of guessing.
VALIDATORS: dict[str, Callable[[Path, bool], str]] = {
    "valen": _valen,
    "vflash": _vflash,
    "recipe": _recipe,
    "vakforge": _vakforge,
    "chat": _chat,
    "prepared": _prepared,
}


def validate(
    fmt: str, paths: Sequence[str], check_media: bool = True, **options: object
) -> tuple[list[str], list[Problem]]:
    """Summaries of the files that passed and the problems of those that did not.

    `options` (see FORMAT_OPTIONS) go to the format's validator, e.g. allow_unconsented for vakforge.
    """
    validator = VALIDATORS[fmt]
    summaries: list[str] = []
    problems: list[Problem] = []
    for path in paths:
        try:
            summaries.append(f"{path}: {validator(Path(path), check_media, **options)}")
        except FormatError as err:
            problems.extend(err.problems)
    return summaries, problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_pipeline.validate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    parser.add_argument("paths", nargs="*", metavar="PATH")
    parser.add_argument("--json", action="store_true", help="print the problems as a JSON list on stdout")
    parser.add_argument(
        "--no-check-media",
        dest="check_media",
        action="store_false",
        help="do not require referenced media files to exist (checks everything else)",
    )
    parser.add_argument(
        "--allow-unconsented",
        action="store_true",
        help="vakforge: accept meta.consent \"none\" (such rows are excluded from any published artifact)",
    )
    parser.add_argument(
        "--export-schema",
        nargs="?",
        const="",
        metavar="PATH",
        help="write the format's JSON Schema (vakforge: vakforge.schema.json in the current folder) and exit",
    )
    args = parser.parse_args(argv)
    if args.export_schema is not None:
        if args.fmt not in SCHEMA_EXPORTERS or args.paths:
            parser.error(
                f"--export-schema takes no input files and exists for {', '.join(SCHEMA_EXPORTERS)} only"
            )
        default_name, export = SCHEMA_EXPORTERS[args.fmt]
        target = Path(args.export_schema or default_name)
        try:
            print(f"wrote {export(target)}")
        except OSError as err:
            print(f"validate: cannot write {target}: {err.strerror}", file=sys.stderr)
            return 2
        return 0
    if not args.paths:
        parser.error("the following arguments are required: PATH")
    options = {"allow_unconsented": True} if args.allow_unconsented else {}
    for option in options:
        if args.fmt not in FORMAT_OPTIONS[option]:
            parser.error(f"--{option.replace('_', '-')} applies to --format={'/'.join(FORMAT_OPTIONS[option])} only")
    if args.fmt not in VALIDATORS:
        print(
            f"validate: format {args.fmt!r} has no validator yet (implemented: {', '.join(sorted(VALIDATORS))})",
            file=sys.stderr,
        )
        return 2
    summaries, problems = validate(args.fmt, args.paths, args.check_media, **options)
    if args.json:
        print(json.dumps([p.to_json() for p in problems], ensure_ascii=False, indent=1))
    else:
        for line in summaries:
            print(line)
        for problem in problems:
            print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
