"""Valen scoring (seed 000) under `train.mode=ar`: the model's scored-branch head trained on Valen questions.

Rows are question trees (`data.valen_mode`: one question per branch, or a shared state encoded once);
every training record is laid out against the row limits once before the step compiles, and records
without a labeled question are dropped, counted in the checkpoint meta and reported by the command.
"""

from __future__ import annotations

from valen_jax.data.valen_fit import check_training_set
from valen_jax.data.valen_rows import ValenAssembly
from valen_jax.tasks.token_lm import ModelTask


class ValenTask(ModelTask):
    """Branch cross-entropy (soft labels) on Valen questions, plus whatever token weight the config sets."""

    unlabeled: int | None = None

    def check_trainable(self) -> None:
        # The objective is the labeled questions, not the token weights the base check counts: they are
        # counted when every record is laid out (`assembly`: valen_fit.check_training_set refuses a set
        # without one, NothingToTrain, before anything is compiled).
        return None

    def assembly(self, spec):
        assembly = ValenAssembly.from_config(self.config, training=True)
        # Every record against the row limits once: one report, not one stop per limit.
        self.unlabeled = check_training_set(self.train_set, spec, assembly.qspec, assembly.overlong).unlabeled
        return assembly

    def meta(self) -> dict:
        return {**super().meta(), "records_without_labels": self.unlabeled}

    def result(self) -> dict:
        return {"records_without_labels": self.unlabeled}
