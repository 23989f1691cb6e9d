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
  tokens and ms/token inside blocks target-only vs speculative (`valen_jax.evaluation.speculative`);
- chat, vakforge: assistant-token loss/accuracy, tool-call exact match, answer exact/normalised match
  (seed 003) and, for vakforge, entity accuracy by type, overall and by locale and source
  (`valen_jax.evaluation.metrics.chat`, `.answer_match`, `.entities`); answers come from KV-cache
  greedy decoding (`valen_jax.decoding`).
With several processes each evaluates a slice and the sums are added before any ratio is formed.
Every evaluation of image data (valen, vflash, chat, vakforge) also answers with each record's images
swapped for another record's and reports `image_reliance` (`valen_jax.evaluation.image_reliance`); a
model whose answers barely change is named in one warning line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import jax

from data_pipeline.cli_flags import add_flag
from data_pipeline.cli_paths import exit_on_bad_paths
from data_pipeline.format_registry import FORMATS
from valen_jax import checkpoint, cli_logging
from valen_jax.data.references import resolve_cli_data
from valen_jax.evaluation import image_reliance, registry, speculative
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.evaluation.workdir import Restored

log = logging.getLogger("valen_jax.evaluate")


def run(restored: Restored, data, fmt: str, options: dict | None, *, mode: str | None = None,
        max_examples: int | None = None, batch_size: int | None = None, max_new_tokens: int | None = None,
        samples: int | None = 8) -> dict:
    """The report of `restored` on `data` (converter format `fmt`); call inside `jax.set_mesh`."""
    eval_cfg = restored.config.eval
    examples, example_format, available = eval_workdir.load_examples(
        fmt, data, restored.workdir, checkpoint.tokenizer_dir(restored.workdir), restored.fingerprint, options,
        max_examples)
    if not examples:
        raise ValueError(f"{data}: no examples to evaluate")
    evaluator = registry.evaluator_for(example_format, str(data))
    if evaluator.needs_score_head:
        eval_workdir.require_score_head(restored, str(data))
    chosen = registry.Options(batch_size=int(batch_size or eval_cfg.batch_size),
                              max_new_tokens=int(max_new_tokens or eval_cfg.max_new_tokens), mode=mode,
                              samples=samples)
    report = {"data": str(data), "format": example_format, "task": restored.config.task, "step": restored.step,
              "examples": len(examples), "examples_in_data": available}
    report.update(evaluator.evaluate(restored, examples, chosen))
    image_reliance.warn_if_text_only(report)  # here, so the end-of-training report warns too
    return report


def evaluate_params(restored: Restored, data) -> dict:
    """Evaluation at the end of training: `restored` is the run's own state in the shape a workdir
    restores to (params, graphdef, model config, tokenizer, row spec, the full training config);
    `data` is read in the config's `data.eval_format` with its `data.eval_options`, and the first
    `eval.max_examples` examples are evaluated. Call inside `jax.set_mesh(restored.mesh)`."""
    fmt, converter_options = eval_workdir.data_format(restored, None)
    return run(restored, data, fmt, converter_options, max_examples=int(restored.config.eval.max_examples))


def write_report(report: dict, path: str | Path) -> None:
    if jax.process_index() != 0:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def evaluate_workdir(workdir: str | Path, data: str | Path, step: int | None = None, fmt: str | None = None,
                     **options) -> dict:
    """The report of the workdir's checkpoint (latest unless `step`) on `data`; `options` as in `run`."""
    if eval_workdir.holds_drafter(workdir, step):  # a vflash run: its drafter, by speculative decoding
        return speculative.evaluate_workdir(workdir, data, step, fmt, **options)
    if options.pop("from_call", False):
        raise ValueError(f"--from-call: {workdir} is not a vflash (drafter) workdir; it only applies to one")
    restored = eval_workdir.restore(workdir, step)
    fmt, converter_options = eval_workdir.data_format(restored, fmt)
    with jax.set_mesh(restored.mesh):
        return run(restored, data, fmt, converter_options, **options)


def summary(report: dict) -> str:
    """The one line the CLI prints about `report`, as its kind's evaluator words it."""
    if "speculative" in report:
        return speculative.summary(report)
    return registry.evaluator_for(report["format"]).summary(report)


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
