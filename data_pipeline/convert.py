"""Convert validated records into ArrayRecord shards plus `manifest.json`: the command line over
`data_pipeline.conversion` (the library; formats and their options: `data_pipeline.format_registry`).

Example (from the repository root):

    python -m data_pipeline.convert --format=recipe --input=data/smoke/vflash/recipe.json \
        --output=/tmp/vflash_shards --tokenizer=data/tokenizer --workers=2

`--format=vflash` takes one JSONL file; `--format=recipe` takes a VFlash recipe and converts
every entry in recipe order; `--format=chat` one chat JSONL file (`--assistant-turns=all|last`);
`--format=prepared` a prepared zip or directory (`--max-seq-length=N`); `--format=vakforge` a
vakforge.jsonl beside its splits.json (`--split=NAME`, `--overlap=merge|drop`,
`--assistant-turns`). An option a format does not take is refused, never ignored.
`--template-family=auto|chatml|llama3` installs a training template for a tokenizer without one (auto:
the family its own chat template writes, e.g. a hub Qwen or Llama 3.x checkpoint's).

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
import sys
from collections.abc import Mapping, Sequence

from data_pipeline import shards
from data_pipeline.chat_templates import TRAINING_TEMPLATES
from data_pipeline.cli_flags import add_flag
from data_pipeline.cli_paths import exit_on_bad_paths
from data_pipeline.conversion import BEAM_RUNNERS, convert
from data_pipeline.format_registry import CONVERT_OPTIONS, FORMATS, takers
from data_pipeline.formats.errors import FormatError
from data_pipeline.render.common import RenderError
from data_pipeline.tokenizer import AUTO_FAMILY


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


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: multi-word flags through `cli_flags.add_flag` (hyphens, or underscores)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", required=True, choices=sorted(FORMATS))
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer directory or hub name")
    parser.add_argument("--workers", type=int, default=1, help="--runner=local: rendering processes")
    parser.add_argument("--runner", choices=("local", "beam"), default="local",
                        help="local: a process pool on this machine; beam: an Apache Beam pipeline (extra `beam`)")
    add_flag(parser, "--beam-runner", choices=BEAM_RUNNERS,
             help="--runner=beam: the Beam runner (DirectRunner)")
    add_flag(parser, "--beam-option", action="append", metavar="KEY=VALUE",
             help="--runner=beam: a pipeline option, e.g. temp_location=gs://b/tmp (repeatable)")
    parser.add_argument("--overwrite", action="store_true")
    add_flag(parser, "--template-family", choices=[AUTO_FAMILY, *sorted(TRAINING_TEMPLATES)],
             help="install this training chat template when the tokenizer's has no generation markers "
                  "(auto: the family the tokenizer's own template writes)")
    # Format options (format_registry.CONVERT_OPTIONS): left unset (None) they take the format's
    # default; set for a format that does not take them, they are refused.
    for name, option in CONVERT_OPTIONS.items():
        defaults = takers(name)
        shown = ", ".join(f"{fmt}={value}" if value is not None else fmt for fmt, value in defaults.items())
        if option.type is None:  # a flag: present sets True, absent leaves the default
            add_flag(parser, "--" + name.replace("_", "-"), action="store_const", const=True,
                     help=f"{option.meaning} ({shown})")
        else:
            add_flag(parser, "--" + name.replace("_", "-"), type=option.type, choices=option.choices,
                     help=f"{option.meaning} ({shown})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    exit_on_bad_paths(input=args.input, output=args.output, tokenizer=args.tokenizer)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = {name: getattr(args, name) for name in CONVERT_OPTIONS}
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
