"""Rewrite a VFlash dataset with the target's own answers, as drafter training data (DFlash/EAGLE style).

    python -m valen_jax.regenerate --workdir=runs/vflash-smoke --data=data/smoke/vflash/recipe.json \
        --output=runs/vflash-regen [--samples=2 --temperature=1.0 --top-p=0.95 --seed=0] \
        [--max-new-tokens=96] [--batch-size=16]
    python -m data_pipeline.validate --format=recipe runs/vflash-regen/recipe.json
    python -m valen_jax.train --config=configs/vflash.py:drafter --workdir=runs/drafter \
        --config.model.target_from=runs/vflash-smoke --config.data.train=runs/vflash-regen/recipe.json

What it writes, what it skips and why: `valen_jax.vflash.regenerate` (the library this command calls).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_pipeline.cli_flags import add_flag
from data_pipeline.cli_paths import exit_on_bad_paths
from data_pipeline.formats.errors import FormatError
from data_pipeline.render.common import RenderError
from valen_jax.cli import log_setup as cli_logging
from valen_jax.cli.boundary import error_boundary
from valen_jax.decoding.sampling import Sampling
from valen_jax.evaluation import answers
from valen_jax.vflash.regenerate import NothingRegenerated, Regenerator, refuse_other_data, regenerate


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`; multi-word flags through `add_flag` (`--max-new-tokens`, or `--max_new_tokens`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="the ar target's workdir")
    parser.add_argument("--data", required=True, help="a VFlash recipe (.json) or JSONL")
    parser.add_argument("--output", required=True, help="the folder to write (must not exist)")
    parser.add_argument("--format", default=None, choices=("recipe", "vflash"),
                        help="default: recipe for a .json file, vflash otherwise")
    parser.add_argument("--samples", type=int, default=0, help="sampled variants per record (default 0)")
    parser.add_argument("--temperature", type=float, default=1.0, help="of the sampled variants (default 1)")
    add_flag(parser, "--top-k", type=int, default=0)
    add_flag(parser, "--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    add_flag(parser, "--max-new-tokens", type=int, default=None,
             help="per answer (default: the checkpoint's eval.max_new_tokens)")
    add_flag(parser, "--batch-size", type=int, default=None,
             help="default: the checkpoint's eval.batch_size")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.samples < 0:
        raise SystemExit(f"--samples={args.samples}: must be >= 0")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as error:
        raise SystemExit(f"--temperature={args.temperature} --top-k={args.top_k} --top-p={args.top_p}: {error}") \
            from None
    if args.samples and sampling.temperature <= 0:
        raise SystemExit(f"--samples={args.samples} needs --temperature > 0 (greedy variants would repeat the "
                         "greedy record)")
    exit_on_bad_paths(workdir=args.workdir, data=args.data)
    cli_logging.configure()
    with error_boundary("valen_jax.regenerate", paths=(args.workdir, args.data, args.output)):
        return _regenerate(args, sampling)


def _regenerate(args: argparse.Namespace, sampling: Sampling) -> int:
    """`main` after the flags were checked: regenerate, then print the report."""
    try:
        if (args.format or ("recipe" if args.data.endswith(".json") else "vflash")) == "vflash":
            refuse_other_data(Path(args.data))  # before the target is restored: a wrong file costs nothing
        regen = Regenerator(args.workdir, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                            sampling=sampling, seed=args.seed)
        report = regenerate(regen, Path(args.data), Path(args.output), samples=args.samples, fmt=args.format)
    except NothingRegenerated as error:
        print("\n".join(error.report.lines()))  # every skip with its record, then the boundary's one line
        sys.stdout.flush()
        raise
    except answers.NotGenerated as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (FormatError, RenderError) as error:  # the source data itself: every problem with its file:line
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("\n".join(report.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
