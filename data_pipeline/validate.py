"""Validate input files of one format and report every problem (DESIGN, "Contracts").

Example:

    python -m data_pipeline.validate --format=recipe data/smoke/vflash/recipe.json
    python -m data_pipeline.validate --format=vflash data/smoke/vflash/boxes.jsonl --json
    python -m data_pipeline.validate --format=valen data/smoke/valen/train.jsonl
    python -m data_pipeline.validate --format=vakforge data/smoke/vakforge/vakforge.jsonl
    python -m data_pipeline.validate --format=vakforge --export-schema   # writes ./vakforge.schema.json

Exit 0 with one summary line per file on stdout; exit 1 with one `PATH:LINE: FIELD: message`
line per problem on stderr (with `--json`, stdout holds only a JSON list of the problems, empty on
success); exit 2 for a usage error.
A recipe is validated together with every annotation file it names. Every image a record names is
decoded as the training loader decodes it (`data_pipeline.formats.media_decode`, once per distinct
content), so a file that is not an image is a problem of its line, not a crash at training's first
batch; videos are checked to exist, and decoded by the loader.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from data_pipeline.cli_flags import add_flag
from data_pipeline.cli_paths import exit_on_bad_paths
from data_pipeline.format_registry import FORMATS
from data_pipeline.formats.errors import FormatError, Problem


def validate(
    fmt: str, paths: Sequence[str], check_media: bool = True, **options: object
) -> tuple[list[str], list[Problem]]:
    """Summaries of the files that passed and the problems of those that did not.

    `options` (the format's `validate_options` in format_registry) go to its validator, e.g.
    allow_unconsented for vakforge; an option the format does not take is refused.
    """
    spec = FORMATS[fmt]
    unknown = sorted(set(options) - set(spec.validate_options))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not an option of --format={fmt}")
    validator = spec.validate
    summaries: list[str] = []
    problems: list[Problem] = []
    for path in paths:
        try:
            summaries.append(f"{path}: {validator(Path(path), check_media, **options)}")
        except FormatError as err:
            problems.extend(err.problems)
    return summaries, problems


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: multi-word flags through `cli_flags.add_flag` (hyphens, or underscores)."""
    parser = argparse.ArgumentParser(
        prog="python -m data_pipeline.validate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--format", required=True, choices=tuple(FORMATS), dest="fmt")
    parser.add_argument("paths", nargs="*", metavar="PATH")
    parser.add_argument("--json", action="store_true", help="print the problems as a JSON list on stdout")
    add_flag(
        parser,
        "--no-check-media",
        dest="check_media",
        action="store_false",
        help="do not read referenced media files (neither existence nor image decoding; checks everything else)",
    )
    add_flag(
        parser,
        "--allow-unconsented",
        action="store_true",
        help="vakforge: accept meta.consent \"none\" (such rows are excluded from any published artifact)",
    )
    add_flag(
        parser,
        "--allow-absolute-media",
        action="store_true",
        help="chat, valen, vflash, recipe: accept media at absolute paths or outside the dataset folder, "
             "as convert --allow-absolute-media does",
    )
    add_flag(
        parser,
        "--export-schema",
        nargs="?",
        const="",
        metavar="PATH",
        help="write the format's JSON Schema (vakforge: vakforge.schema.json in the current folder) and exit",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_on_bad_paths(PATH=args.paths, export_schema=args.export_schema)
    if args.export_schema is not None:
        if FORMATS[args.fmt].schema is None or args.paths:
            with_schema = [name for name, spec in FORMATS.items() if spec.schema is not None]
            parser.error(f"--export-schema takes no input files and exists for {', '.join(with_schema)} only")
        default_name, export = FORMATS[args.fmt].schema
        target = Path(args.export_schema or default_name)
        try:
            print(f"wrote {export(target)}")
        except OSError as err:
            print(f"validate: cannot write {target}: {err.strerror}", file=sys.stderr)
            return 2
        return 0
    if not args.paths:
        parser.error("the following arguments are required: PATH")
    options = {name: True for name in ("allow_unconsented", "allow_absolute_media") if getattr(args, name)}
    for option in options:
        if option not in FORMATS[args.fmt].validate_options:
            takers = [name for name, spec in FORMATS.items() if option in spec.validate_options]
            parser.error(f"--{option.replace('_', '-')} applies to --format={'/'.join(takers)} only")
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
