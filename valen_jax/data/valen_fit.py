"""A Valen training set checked against the row limits once, at start-up, before devices compile.

Without it a run whose rows do not fit stops at the first record over `data.max_candidates`,
then, raised, at the next record over `data.seq_len`, one limit per attempt. Here every record is
laid out as the loader would lay it out (`valen_rows.row_needs`: the same code, media processed
with the run's `media_kwargs`), and one report states the smallest `seq_len`, `max_questions`,
`max_candidates` and `max_patches` that fit the whole set and what the current values would drop.
With `data.overlong=error` a set that does not fit is refused (ConfigError naming the limits);
with `skip` the report is logged once and the loader drops those records.

In training, records without a labeled question are never trained on; they are counted, and
their media is not read (seed 000).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import astuple, dataclass, field

from data_pipeline import examples as contract  # the Example fields (one declaration)
from valen_jax.data.assemble import RowSpec
from valen_jax.data.sources import Sources, decode, mixture_of
from valen_jax.data.valen_rows import QuestionSpec, RowNeeds, has_labels, row_needs
from valen_jax.errors import ConfigError, NothingToTrain

log = logging.getLogger(__name__)


@dataclass
class FitReport:
    mode: str
    records: int = 0  # records laid out (in training: those with a labeled question)
    unlabeled: int = 0  # training records without a labeled question, not read further
    needed: RowNeeds = RowNeeds(0, 0, 0, 0)  # the smallest limits that fit every record
    unfit: list[tuple[str, list[str]]] = field(default_factory=list)  # (source:line, limits exceeded)

    def add(self, where: str, needs: RowNeeds, spec: RowSpec, qspec: QuestionSpec) -> None:
        self.records += 1
        self.needed = RowNeeds(*map(max, astuple(self.needed), astuple(needs)))
        exceeded = needs.exceeded(spec, qspec)
        if exceeded:
            self.unfit.append((where, exceeded))

    def message(self, spec: RowSpec, qspec: QuestionSpec) -> str:
        fits = (f"data.seq_len={self.needed.seq_len}, data.max_questions={self.needed.questions}, "
                f"data.max_candidates={self.needed.candidates}, data.max_patches={self.needed.patches}")
        text = (f"Valen training set ({self.mode} mode, {self.records} records with labels, {self.unlabeled} "
                f"without, not trained on): the smallest limits that fit every record are {fits}")
        if not self.unfit:
            return text + "; the configured limits fit"
        per_limit = Counter(limit.split("=")[0] for _, exceeded in self.unfit for limit in exceeded)
        where, exceeded = self.unfit[0]
        current = (f"data.seq_len={spec.seq_len}, data.max_questions={qspec.max_questions}, "
                   f"data.max_candidates={qspec.max_candidates}, data.max_patches={spec.max_patches}")
        return (f"{text}. With {current}, {len(self.unfit)} of {self.records} records do not fit ("
                + ", ".join(f"{key}: {count}" for key, count in sorted(per_limit.items()))
                + f"); first: {where} ({'; '.join(exceeded)})")


def check_training_set(sources: Sources, spec: RowSpec, qspec: QuestionSpec, overlong: str) -> FitReport:
    """Lay out every record once; refuse (overlong=error) or report the records the loader will skip."""
    report = FitReport(qspec.mode)
    for shard_set, _ in mixture_of(sources):
        source = shard_set.source()
        for index in range(len(source)):
            example = decode(source[index])
            if qspec.training and not has_labels(example):
                report.unlabeled += 1
                continue
            where = contract.where(example)
            report.add(where, row_needs(example, spec, qspec), spec, qspec)
    message = report.message(spec, qspec)
    if qspec.training and report.records == 0:
        raise NothingToTrain(f"{message}. Nothing to train: no record has a labeled question (seed 000: a "
                             "question without targets is never trained on)")
    if report.unfit and overlong == "error":
        raise ConfigError(f"{message}. Raise those limits, or set data.overlong=skip to drop these records")
    if qspec.training and len(report.unfit) == report.records:
        # Every row would be dropped: the loader would wait for one forever (issue 19).
        raise ConfigError(f"{message}. No record is left to train on (none with labels fits): raise those limits")
    if report.unfit:
        log.warning("%s; data.overlong=skip: these records are skipped every epoch", message)
    else:
        log.info("%s", message)
    return report
