"""Evaluation during training (`config.eval.every`): the held-out set (`config.data.eval`) read once
at start-up, then scored with the params of the moment through the same code as `evaluate`.

Token families (vflash, chat, vakforge, prepared) get teacher-forced loss/accuracy
(`tokens.forced_sums`/`forced_metrics`, `teacher_forced`'s parts: each process its slice, sums added across processes) and, where records hold
images, the same loss with each record's images swapped for another's (`image_reliance.teacher_forced_gap`:
eval_loss_with_images, eval_loss_swapped_images, eval_image_loss_gap); Valen data gets
the per-question metrics of `valen.evaluate`. Greedy decoding is left to the end-of-run report:
it reruns the model once per generated token, too slow to repeat every few hundred steps.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from valen_jax.evaluation import tokens, valen
from valen_jax.evaluation.image_reliance import teacher_forced_gap
from valen_jax.evaluation.options import Options
from valen_jax.evaluation.workdir import data_format, load_examples
from valen_jax.run import ModelRun

log = logging.getLogger(__name__)

VALEN_KEYS = ("questions", "labeled", "accuracy", "cross_entropy", "brier", "rps", "ece")


class PeriodicEval:
    """`evaluator(params)` → {"eval_<metric>": value} for metrics.jsonl (a metric with no data,
    e.g. RPS without a labeled score question, is left out rather than logged as null)."""

    def __init__(self, run: ModelRun):
        """`run`: the training run in the shape a workdir restores to; its params are ignored."""
        config = run.config
        fmt, options = data_format(run, None)
        self.examples, self.family, available = load_examples(
            fmt, config.data.eval, run.workdir, config.data.tokenizer, run.fingerprint, options,
            int(config.eval.max_examples))
        if not self.examples:
            raise ValueError(f"{config.data.eval}: no examples to evaluate during training (config.eval.every)")
        self.run = run
        self.options = Options(batch_size=int(config.eval.batch_size), max_new_tokens=0, image_reliance=False)
        log.info("evaluating every %d steps on %d of the %d examples of %s", config.eval.every,
                 len(self.examples), available, config.data.eval)

    def __call__(self, params) -> dict[str, float]:
        run = dataclasses.replace(self.run, params=params)
        with jax.set_mesh(run.mesh):
            if self.family == "valen":
                report = valen.evaluate(run, self.examples, self.options)
                values = {key: report[key] for key in VALEN_KEYS}
            else:
                rows = tokens.local_rows(self.examples, run.spec)
                sums = tokens.forced_sums(params, run.graphdef, rows, len(self.examples), run.spec, run.mesh,
                                          self.options.batch_size)
                values = tokens.forced_metrics(sums)
                # Blindness shows here long before the end-of-run decode (issue 25): the same loss with
                # each record's image swapped for another's (only the swapped rows run again); a gap near
                # 0 is a model that does not look.
                values.update(teacher_forced_gap(params, run.graphdef, rows, sums, run.spec, run.mesh,
                                                 self.options.batch_size))
        return {f"eval_{k}": float(v) for k, v in values.items() if v is not None}
