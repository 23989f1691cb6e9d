"""The report of a restored run on a data file: the library half of `python -m valen_jax.evaluate`.

Training's end-of-run report (`evaluate_params`) and the CLI (`evaluate_workdir`) both come here, so
a command never imports another command.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax

from data_pipeline.format_registry import FORMATS
from valen_jax.errors import EvaluationError, UsageError
from valen_jax.evaluation import image_reliance, registry
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.run import ModelRun, decoding_layout, holds_drafter, restore_model
from valen_jax.training import checkpoint
from valen_jax.vflash import evaluation as speculative


def run(restored: ModelRun, data, fmt: str, options: dict | None, *, mode: str | None = None,
        max_examples: int | None = None, batch_size: int | None = None, max_new_tokens: int | None = None,
        samples: int | None = 8) -> dict:
    """The report of `restored` on `data` (converter format `fmt`); call inside `jax.set_mesh`."""
    eval_cfg = restored.config.eval
    examples, example_format, available = eval_workdir.load_examples(
        fmt, data, restored.workdir, checkpoint.tokenizer_dir(restored.workdir), restored.fingerprint, options,
        max_examples)
    if not examples:
        raise EvaluationError(f"{data}: no examples to evaluate")
    evaluator = registry.evaluator_for(example_format, str(data))
    if evaluator.needs_score_head:
        eval_workdir.require_score_head(restored, str(data))
    chosen = registry.Options(batch_size=int(batch_size or eval_cfg.batch_size),
                              max_new_tokens=int(max_new_tokens or eval_cfg.max_new_tokens), mode=mode,
                              samples=samples)
    report = {"data": str(data), "format": example_format, "task": restored.config.task, "step": restored.step,
              "examples": len(examples), "examples_in_data": available}
    report.update(evaluator.evaluate(restored, examples, chosen))
    image_reliance.warn_if_blind(report)  # here, so the end-of-training report warns too
    return report


def evaluate_params(restored: ModelRun, data) -> dict:
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
    if holds_drafter(workdir, step):  # a vflash run: its drafter, by speculative decoding
        return speculative.evaluate_workdir(workdir, data, step, fmt, **options)
    if options.pop("from_call", False):
        raise UsageError(f"--from-call: {workdir} is not a vflash (drafter) workdir; it only applies to one")
    restored = decoding_layout(restore_model(workdir, step))
    fmt, converter_options = eval_workdir.data_format(restored, fmt)
    if not Path(data, "manifest.json").is_file():  # a shard directory says its own format when loaded
        registry.evaluator_for(FORMATS[fmt].family, str(data))  # refused before it is converted into the workdir
    with jax.set_mesh(restored.mesh):
        return run(restored, data, fmt, converter_options, **options)


def summary(report: dict) -> str:
    """The one line the CLI prints about `report`, as its kind's evaluator words it."""
    if "speculative" in report:
        return speculative.summary(report)
    return registry.evaluator_for(report["format"]).summary(report)
