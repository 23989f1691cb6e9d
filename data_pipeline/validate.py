"""Validate input files of one format and report every problem (DESIGN, "Contracts").

Example:

    python -m data_pipeline.validate --format=recipe data/smoke/vflash/recipe.json
    python -m data_pipeline.validate --format=vflash data/smoke/vflash/boxes.jsonl --json

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

from data_pipeline.formats.errors import FormatError, Problem
from data_pipeline.formats.recipe import read_recipe_records
from data_pipeline.formats.vflash import read_vflash

FORMATS = ("valen", "vflash", "recipe", "chat", "vakforge", "prepared")


def _vflash(path: Path, check_media: bool) -> str:
    return f"{len(read_vflash(path, check_media=check_media))} records OK"


def _recipe(path: Path, check_media: bool) -> str:
    entries = read_recipe_records(path, check_media=check_media)
    records = sum(len(records) for _, records in entries)
    return f"{len(entries)} entries, {records} records OK"


# Format name -> validator returning a one-line summary or raising FormatError.
# A format without a validator yet is left out; the CLI says so instead of guessing.
VALIDATORS: dict[str, Callable[[Path, bool], str]] = {
    "vflash": _vflash,
    "recipe": _recipe,
}


def validate(fmt: str, paths: Sequence[str], check_media: bool = True) -> tuple[list[str], list[Problem]]:
    """Summaries of the files that passed and the problems of those that did not."""
    validator = VALIDATORS[fmt]
    summaries: list[str] = []
    problems: list[Problem] = []
    for path in paths:
        try:
            summaries.append(f"{path}: {validator(Path(path), check_media)}")
        except FormatError as err:
            problems.extend(err.problems)
    return summaries, problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_pipeline.validate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    parser.add_argument("paths", nargs="+", metavar="PATH")
    parser.add_argument("--json", action="store_true", help="print the problems as a JSON list on stdout")
    parser.add_argument(
        "--no-check-media",
        dest="check_media",
        action="store_false",
        help="do not require referenced media files to exist (checks everything else)",
    )
    args = parser.parse_args(argv)
    if args.fmt not in VALIDATORS:
        print(
            f"validate: format {args.fmt!r} has no validator yet (implemented: {', '.join(sorted(VALIDATORS))})",
            file=sys.stderr,
        )
        return 2
    summaries, problems = validate(args.fmt, args.paths, args.check_media)
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
