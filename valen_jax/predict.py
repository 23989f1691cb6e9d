"""Answer every question of a Valen data file, or every assistant answer of VFlash, chat and vakforge
data, with a trained workdir; needs nothing but the workdir.

    python -m valen_jax.predict --workdir=runs/valen-smoke --data=data/smoke/valen/train.jsonl \
        --output=runs/valen-smoke/answers.jsonl [--mode=shared_state] [--step=N]
    python -m valen_jax.predict --workdir=runs/vflash-smoke --data=data/smoke/vflash/eval.jsonl \
        --output=runs/vflash-smoke/answers.jsonl

VFlash, chat and vakforge data are generated greedily through the KV-cache decoder, the checkpoint's
`eval.max_new_tokens` per answer, and the file holds exactly the lines of
`python -m valen_jax.generate` with its defaults (one per trained assistant answer: text, finish
reason, primitives or tool calls; `valen_jax.evaluation.answers`).

For Valen data, writes one JSON line per record, in data order (seed 000: "answers are returned for every
question, labeled or not"):

    {"group_id": "traffic-light-001", "record_id": "valen-smoke-001", "answers": {
      "color": {"type": "choice", "probabilities": {"red": 0.1, "green": 0.8, "unknown": 0.1}, "argmax": "green"},
      "go":    {"type": "noul", "probabilities": {"true": 0.7, "false": 0.3}, "argmax": "true"},
      "risk":  {"type": "score", "probabilities": {"0": 0.6, "1": 0.3, "2": 0.1}, "argmax": "0", "expected": 0.5}}}

Probabilities are keyed as in the labels and listed in the record's candidate order (choice: input
order; noul: true, false; score: grades 0 … K−1); `expected` = Σ_k k·q_k ∈ [0, K−1]. Inference keeps
the candidate order; labels, when present, are read (and validated) but not used. `--mode` picks
`question` or `shared_state` (default: the checkpoint's `data.valen_mode`). The data's converter
format is the checkpoint's `data.eval_format` unless `--format`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

from data_pipeline.cli_flags import add_flag
from data_pipeline.cli_paths import exit_on_bad_paths
from data_pipeline.format_registry import FORMATS
from valen_jax.cli import distributed
from valen_jax.cli import log_setup as cli_logging
from valen_jax.cli.boundary import error_boundary
from valen_jax.data.references import resolve_cli_data
from valen_jax.errors import EvaluationError, UsageError
from valen_jax.evaluation import answers
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.evaluation.valen import predict_valen, predict_valen_data
from valen_jax.run import restore_model
from valen_jax.training import checkpoint

GENERATION = "generation"  # what predict_workdir names as its mode for generated (non-Valen) answers


def predict_workdir(workdir: str | Path, data: str | Path, step: int | None = None, fmt: str | None = None,
                    mode: str | None = None, batch_size: int | None = None) -> tuple[str, list[dict]]:
    """(the Valen mode used, or GENERATION; the answer lines in data order; complete on process 0)."""
    restored = restore_model(workdir, step)
    fmt, options = eval_workdir.data_format(restored, fmt)
    if fmt == "valen" and not Path(data).is_dir():  # a Valen JSONL: what the server's /v1/valen/score runs too
        return predict_valen_data(restored, data, mode, batch_size)
    if FORMATS[fmt].family == "valen":
        eval_workdir.require_score_head(restored, str(data))  # before the data is converted
    else:
        answers.refuse_family(FORMATS[fmt].family, str(data))
    with jax.set_mesh(restored.mesh):
        examples, family, _ = eval_workdir.load_examples(
            fmt, data, restored.workdir, checkpoint.tokenizer_dir(restored.workdir), restored.fingerprint, options)
        if not examples:
            raise EvaluationError(f"{data}: no records")
        if family == "valen":
            eval_workdir.require_score_head(restored, str(data))  # a shard directory says its own format
            return predict_valen(restored, examples, mode, int(batch_size or restored.config.eval.batch_size))
        if mode is not None:
            raise UsageError(f"--mode={mode}: a Valen sequence mode, and {data} holds {family} data")
        # Greedy, the checkpoint's budget: the very lines `python -m valen_jax.generate` writes by default.
        return GENERATION, answers.generate_answers(restored, examples, family,
                                                    max_new_tokens=int(restored.config.eval.max_new_tokens),
                                                    batch_size=batch_size)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`; multi-word flags through `add_flag` (`--batch-size`, or `--batch_size`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--data", required=True, help="Valen, VFlash/recipe, chat or vakforge JSONL, shard directory or registry reference (ns/name:v3)")
    parser.add_argument("--output", required=True, help="answers.jsonl to write")
    parser.add_argument("--format", default=None, choices=sorted(FORMATS),
                        help="converter format of --data (default: the checkpoint's data.eval_format)")
    parser.add_argument("--mode", default=None, choices=("question", "shared_state"),
                        help="Valen sequence mode (default: the checkpoint's data.valen_mode)")
    add_flag(parser, "--batch-size", type=int, default=None, help="default: the checkpoint's eval.batch_size")
    parser.add_argument("--registry", default=None,
                        help="registry URL for a --data reference (default: $VALEN_REGISTRY or the user cache)")
    parser.add_argument("--namespace", default=None, help="namespace of a --data reference written without one")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    exit_on_bad_paths(workdir=args.workdir, data=args.data, output=args.output)
    cli_logging.configure()
    with error_boundary("valen_jax.predict", paths=(args.workdir, args.data, args.output)):
        distributed.initialize()  # a multi-process job (launch/): before any JAX backend use; else nothing
        data, _ = resolve_cli_data(args.data, args.registry, args.namespace)  # seed 003 references
        try:
            mode, lines = predict_workdir(args.workdir, data, args.step, args.format, args.mode, args.batch_size)
        except answers.NotGenerated as error:  # prepared rows: nothing to predict
            print(f"error: {error}", file=sys.stderr)
            return 2
        answers.write_answers(lines, args.output)
    if mode == GENERATION:
        records = len({line["index"] for line in lines})
        print(f"{args.output}: {len(lines)} answers of {records} records generated (greedy)")
        return 0
    questions = sum(len(line["answers"]) for line in lines)
    print(f"{args.output}: {len(lines)} records, {questions} questions answered ({mode} mode)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
