"""Evaluate a trained workdir on a data file with the metrics its format defines; needs nothing but the workdir.

    python -m valen_jax.evaluate --workdir=runs/vflash-smoke --data=data/smoke/vflash/eval.jsonl \
        --output=runs/vflash-smoke/eval/report.json
    python -m valen_jax.evaluate --workdir=runs/valen-smoke --data=data/smoke/valen/train.jsonl \
        --output=runs/valen-smoke/eval/report.json --mode=shared_state
    python -m valen_jax.evaluate --workdir=runs/vflash-drafter --data=data/smoke/vflash/eval.jsonl \
        --output=runs/vflash-drafter/eval/report.json   # a vflash run: speculative decoding with its drafter
    python -m valen_jax.evaluate --workdir=runs/valen-smoke --data=smoke/valen-eval:v1 --registry=/tmp/registry \
        --output=/tmp/report.json   # a registry reference (seed 003): the report names the exact version

Model config, `media_kwargs`, tokenizer and training config come from the checkpoint (the latest
step unless `--step`). The data's format is the checkpoint's `data.eval_format` unless `--format`
is given (never guessed from the path); `data.eval_options` (e.g. vakforge's split) apply to that
format. Every example of the data is evaluated unless `--max-examples`. The report holds, per format:
- valen: per question, overall / by type / by domain, modality, language_bucket: hard-label
  accuracy, cross-entropy, Brier, RPS, ECE, the noul confusion matrix and the label counts
  (`valen_jax.evaluation.metrics.valen`), in `--mode` (default: the checkpoint's `data.valen_mode`);
- vflash: assistant-token `loss`/`accuracy` (teacher forcing); greedy decoding of each last answer:
  `generation.primitive_parse_rate`, and point/box/trajectory/dense metrics overall and per recipe
  entry (`valen_jax.evaluation.metrics.vflash`); `text_only_baseline`, the headline metric of answers
  taken from the workdir's training records with the same prompt (`valen_jax.evaluation.text_only`);
- a vflash (drafter) workdir: its target's VFlash report (`ar`, exactly the target workdir's), the same
  generation metrics from speculative decoding with the drafter, `identical` (must be 1.0) and per
  recipe entry tau (bonus token included), per-position acceptance, the histogram of accepted draft
  tokens and ms/token inside blocks target-only vs speculative (`valen_jax.vflash.evaluation`);
- chat, vakforge: assistant-token loss/accuracy, tool-call exact match, answer exact/normalised match
  (seed 003) and, for vakforge, entity accuracy by type, overall and by locale and source
  (`valen_jax.evaluation.metrics.chat`, `.answer_match`, `.entities`); answers come from KV-cache
  greedy decoding (`valen_jax.decoding`).
With several processes each evaluates a slice and the sums are added before any ratio is formed.
Every evaluation of image data (valen, vflash, chat, vakforge) also answers with each record's images
swapped for another record's and reports `image_reliance` (`valen_jax.evaluation.image_reliance`) with
its `verdict`; a model whose answers barely change, or change without improving, is named in one warning line.
"""

from __future__ import annotations

import argparse
import logging
import sys

from data_pipeline.cli_flags import add_flag
from data_pipeline.cli_paths import exit_on_bad_paths
from data_pipeline.format_registry import FORMATS
from valen_jax.cli import log_setup as cli_logging
from valen_jax.cli.boundary import error_boundary
from valen_jax.data.references import resolve_cli_data
from valen_jax.evaluation.report import evaluate_params, evaluate_workdir, run, summary, write_report  # noqa: F401

log = logging.getLogger("valen_jax.evaluate")


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`; multi-word flags through `add_flag` (`--max-new-tokens`, or `--max_new_tokens`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--data", required=True, help="JSONL, recipe, shard directory or registry reference (ns/name:v3)")
    parser.add_argument("--output", required=True, help="report.json to write")
    parser.add_argument("--format", default=None, choices=sorted(FORMATS),
                        help="converter format of --data (default: the checkpoint's data.eval_format)")
    parser.add_argument("--mode", default=None, choices=("question", "shared_state"),
                        help="Valen sequence mode (default: the checkpoint's data.valen_mode)")
    add_flag(parser, "--max-examples", type=int, default=None, help="evaluate only the first N examples")
    add_flag(parser, "--batch-size", type=int, default=None, help="default: the checkpoint's eval.batch_size")
    add_flag(parser, "--max-new-tokens", type=int, default=None,
             help="greedy decoding budget (default: the checkpoint's eval.max_new_tokens)")
    parser.add_argument("--samples", type=int, default=8, help="decoded answers listed in the report")
    add_flag(parser, "--from-call", action="store_true",
             help="vflash (drafter) workdir: also draft every reference block, from prompts that run to "
                  "the reference's atomic_decoding call")
    parser.add_argument("--registry", default=None,
                        help="registry URL for a --data reference (default: $VALEN_REGISTRY or the user cache)")
    parser.add_argument("--namespace", default=None, help="namespace of a --data reference written without one")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    exit_on_bad_paths(workdir=args.workdir, data=args.data, output=args.output)
    cli_logging.configure()
    with error_boundary("valen_jax.evaluate", paths=(args.workdir, args.data, args.output)):
        data, reference = resolve_cli_data(args.data, args.registry, args.namespace)  # seed 003 references
        report = evaluate_workdir(args.workdir, data, args.step, args.format, mode=args.mode,
                                  max_examples=args.max_examples, batch_size=args.batch_size,
                                  max_new_tokens=args.max_new_tokens, samples=args.samples,
                                  **({"from_call": True} if args.from_call else {}))
        if reference is not None:
            report["data_reference"] = reference  # the exact version evaluated (seed 003)
        write_report(report, args.output)
    print(f"{args.output}: {summary(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
