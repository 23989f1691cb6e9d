"""Valen evaluation and prediction (seed 000): the model's candidate probabilities for every
question of every record, fed to `ValenStats` (metrics) or written as answers.

Both modes (`question`: the branch tree; `shared_state`: every candidate in one sequence) run at
inference settings: candidates keep the record's order (`QuestionSpec(training=False)`) and
unlabeled questions are scored too. A question's probabilities are the softmax of its branches'
scores, taken in float64 from the float32 log-probabilities and renormalised, so the metrics and
the answers file hold the very same numbers and the report can be recomputed from the answers.

Answer line (one per record, in data order):
    {"group_id": …, "record_id": …, "answers": {QUESTION_ID: {"type": "choice|noul|score",
      "probabilities": {CANDIDATE_KEY: q_k, …}   # keys as in the labels, in the record's candidate order
      "argmax": CANDIDATE_KEY,                    # highest q_k; ties go to the earliest candidate
      "expected": Σ_k k·q_k}}}                    # score questions only, in [0, K−1]

Image reliance (`evaluation.image_reliance`): the labeled records are scored again with each record's
images swapped for another's; the report gives the fraction of questions whose argmax changes (of all,
and of those whose gold candidate differs from the donor record's: `reliance`) and the hard-label
accuracy with and without the record's own images.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline.shards import Example
from valen_jax.data.assemble import RowSpec
from valen_jax.data.valen_rows import MODES, QuestionSpec, has_labels, row_needs, valen_row
from valen_jax.errors import EvaluationError, UsageError
from valen_jax.evaluation import hosts, image_reliance
from valen_jax.evaluation.metrics import shown
from valen_jax.evaluation.metrics.valen import ValenStats
from valen_jax.evaluation.workdir import (
    data_format,
    host_local,
    load_examples,
    local_batch_size,
    require_score_head,
    stack,
)
from valen_jax.models import sharding
from valen_jax.models.heads import branch_log_probs
from valen_jax.run import ModelRun
from valen_jax.training import checkpoint
from valen_jax.training.step import vision_inputs

if TYPE_CHECKING:
    from valen_jax.evaluation.options import Options

BREAKDOWN = contract.VALEN_BREAKDOWNS
log = logging.getLogger(__name__)


def question_spec(config, mode: str | None, examples: list[Example]) -> QuestionSpec:
    """Inference layout: the checkpoint's mode unless `mode` is given; row capacity grown to the
    largest record so that every question of every record is scored (one shape, one compile)."""
    if "data" not in config:
        raise ValueError("Valen evaluation needs the training config (data.valen_mode, max_questions, "
                         "max_candidates)")
    mode = mode or config.data.valen_mode
    if mode not in MODES:
        raise UsageError(f"--mode={mode!r}; choose one of {', '.join(MODES)}")
    questions = max([len(contract.meta_of(e).questions) for e in examples], default=1)
    candidates = max([len(keys) for e in examples for keys in contract.meta_of(e).candidate_keys], default=2)
    return QuestionSpec(mode, max(int(config.data.max_questions), questions),
                        max(int(config.data.max_candidates), candidates), training=False)


def row_spec(spec: RowSpec, examples: list[Example], qspec: QuestionSpec) -> RowSpec:
    """The checkpoint's row layout grown to the longest inference row of `examples` (one shape, one
    compile, as `question_spec` grows the question capacity). Training lays out only labeled questions
    (question mode) of labeled records, and `data.seq_len`/`max_patches` were sized for those rows
    (valen_fit); inference scores every question, so its rows can be longer. Positions are exact at any
    length, so a longer row gives the same scores. The same on every process (`examples` is the whole data)."""
    needs = [row_needs(example, spec, qspec) for example in examples]
    seq_len = max([spec.seq_len, *(n.seq_len for n in needs)])
    patches = max([spec.max_patches, *(n.patches for n in needs)])
    if (seq_len, patches) != (spec.seq_len, spec.max_patches):
        log.info("inference rows (%s mode, every question scored) need seq_len=%d, max_patches=%d; the checkpoint's "
                 "rows are %d, %d", qspec.mode, seq_len, patches, spec.seq_len, spec.max_patches)
    return dataclasses.replace(spec, seq_len=seq_len, max_patches=patches)


@functools.cache
def _log_probs_fn(graphdef):
    def log_probs(params, batch):
        model = nnx.merge(graphdef, params)
        hidden = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"], vision_inputs(batch),
                              batch["branch_ids"])
        return branch_log_probs(model.score_head(hidden), batch["score_positions"], batch["branch_mask"])

    return jax.jit(log_probs)


def _question_probs(example: Example, log_probs: np.ndarray, row: dict) -> list[np.ndarray]:
    """float64 probabilities of each question's candidates, in the record's candidate order."""
    owner = example.arrays["candidate_question"]
    out = []
    for q in range(len(contract.meta_of(example).questions)):
        members = np.flatnonzero(owner == q)
        mask = row["branch_mask"][q]
        if int(mask.sum()) != len(members):
            raise AssertionError(f"question {q}: {int(mask.sum())} branches for {len(members)} candidates")
        probs = np.zeros(len(members), np.float64)
        probs[row["candidate_index"][q][mask] - members[0]] = np.exp(log_probs[q][mask].astype(np.float64))
        out.append(probs / probs.sum())
    return out


@dataclasses.dataclass(frozen=True)
class _Rows:
    """The inference rows of `examples`: one layout for all of them (`row_spec`, `question_spec`)."""

    examples: list[Example]
    spec: RowSpec
    qspec: QuestionSpec

    @classmethod
    def of(cls, restored: ModelRun, examples: list[Example], qspec: QuestionSpec) -> _Rows:
        return cls(examples, row_spec(restored.spec, examples, qspec), qspec)

    def row(self, i: int, donor: int | None = None) -> dict:
        """Record i's row; with `donor`, holding the donor record's patches (`image_reliance`: the same
        layout, so every token, position and segment stays record i's)."""
        row = valen_row(self.examples[i], self.spec, self.qspec, None)
        if donor is None:
            return row
        return image_reliance.with_patches(row, valen_row(self.examples[donor], self.spec, self.qspec, None))


def _score(restored: ModelRun, rows: _Rows, indices: list[int], batches: int, local_batch: int,
           row_of: Callable[[int], dict]) -> list[tuple[int, list[np.ndarray]]]:
    """(index, per-question probabilities) of this process's records `indices`, in `batches` batches
    that every process enters together."""
    fn = _log_probs_fn(restored.graphdef)
    padding = None
    out = []
    for b in range(batches):
        chunk = indices[b * local_batch:(b + 1) * local_batch]
        built = [row_of(i) for i in chunk]
        if not built:  # this process is out of records while others are not
            padding = padding or jax.tree.map(np.zeros_like, rows.row(0))
            built = [padding]
        batch = sharding.global_batch(stack(built, local_batch), restored.mesh)
        log_probs = host_local(fn(restored.params, batch), restored.mesh)
        for k, i in enumerate(chunk):
            out.append((i, _question_probs(rows.examples[i], log_probs[k], built[k])))
    return out


def score_records(restored: ModelRun, examples: list[Example], qspec: QuestionSpec, batch_size: int,
                  rows: _Rows | None = None, layouts: list[image_reliance.Layout] | None = None
                  ) -> list[tuple[int, list[np.ndarray]]]:
    """(index in `examples`, per-question probabilities) for the records this process evaluates.
    `rows`: their layout when the caller has it (default: made here); `layouts`, when given, receives
    each scored record's image layout, in order, for the swapped pass (`image_reliance_report`)."""
    rows = _Rows.of(restored, examples, qspec) if rows is None else rows
    local_batch = local_batch_size(batch_size, restored.mesh)

    def row_of(i: int) -> dict:
        row = rows.row(i)
        if layouts is not None:
            layouts.append(image_reliance.layout_of(row))
        return row

    return _score(restored, rows, hosts.local_indices(len(examples)), hosts.batch_count(len(examples), local_batch),
                  local_batch, row_of)


def add_record(stats: ValenStats, example: Example, probs: list[np.ndarray]) -> None:
    """Every question of one record into `stats`, labeled or not (unlabeled ones only count)."""
    meta, arrays = contract.meta_of(example), example.arrays
    owner = arrays["candidate_question"]
    breakdown = {key: getattr(meta, key) for key in BREAKDOWN}
    for q, qtype in enumerate(meta.question_types):
        label = arrays["labels"][owner == q].astype(np.float64) if arrays["labeled"][q] else None
        stats.add(qtype, probs[q], label, bool(meta.hard_labels[q]), breakdown)


def answer_line(example: Example, probs: list[np.ndarray]) -> dict:
    meta = contract.meta_of(example)
    answers = {}
    for qid, qtype, keys, q in zip(meta.questions, meta.question_types, meta.candidate_keys, probs,
                                   strict=True):
        answer = {"type": qtype, "probabilities": {key: float(p) for key, p in zip(keys, q, strict=True)},
                  "argmax": keys[int(np.argmax(q))]}
        if qtype == "score":
            answer["expected"] = float(np.dot(np.arange(len(q)), q))
        answers[qid] = answer
    return {"group_id": meta.group_id, "record_id": meta.record_id, "answers": answers}


def add_unlabeled_record(stats: ValenStats, example: Example) -> None:
    """A record without any label: its questions count as unlabeled, and it is never scored, so its
    media is never read (seed 000: "If a record has no labels at all, its media is never read")."""
    meta, owner = contract.meta_of(example), example.arrays["candidate_question"]
    breakdown = {key: getattr(meta, key) for key in BREAKDOWN}
    for q, qtype in enumerate(meta.question_types):
        k = int((owner == q).sum())
        # ValenStats reads no probabilities of an unlabeled question; uniform ones pass its checks.
        stats.add(qtype, np.full(k, 1.0 / k), None, False, breakdown)


def evaluate(restored: ModelRun, examples: list[Example], options: Options) -> dict:
    """The report's Valen part: per-question metrics in `options.mode` (None: the checkpoint's).
    Records without labels add nothing to a metric, so they are counted, not scored."""
    labeled = [e for e in examples if has_labels(e)]
    unlabeled = [e for e in examples if not has_labels(e)]
    qspec = question_spec(restored.config, options.mode, labeled or examples)
    stats = ValenStats()
    rows = _Rows.of(restored, labeled, qspec) if labeled else None
    layouts: list[image_reliance.Layout] = []
    scored = score_records(restored, labeled, qspec, options.batch_size, rows, layouts) if labeled else []
    for i, probs in scored:
        add_record(stats, labeled[i], probs)
    for i in hosts.local_indices(len(unlabeled)):  # each host its share, as for scored records
        add_unlabeled_record(stats, unlabeled[i])
    metrics = hosts.sum_stats(stats).report()
    overall = metrics["overall"]
    report = {"mode": qspec.mode, "questions": overall["questions"], "labeled": overall["labeled"],
              "accuracy": overall["accuracy"], "cross_entropy": overall["cross_entropy"],
              "brier": overall["brier"], "rps": overall["rps"], "ece": overall["ece"], "metrics": metrics}
    # `labeled` is the whole data's, the same on every process: all take this branch or none.
    part = image_reliance_report(restored, rows, scored, layouts, options) if labeled and options.image_reliance else None
    if part is not None:
        report["image_reliance"] = part
    return report


def _accuracy(rows: _Rows, scored: list[tuple[int, list[np.ndarray]]]) -> float | None:
    """All processes' hard-label accuracy of these records' questions."""
    stats = ValenStats()
    for i, probs in scored:
        add_record(stats, rows.examples[i], probs)
    return hosts.sum_stats(stats).report()["overall"]["accuracy"]


def image_reliance_report(restored: ModelRun, rows: _Rows, scored: list[tuple[int, list[np.ndarray]]],
                          layouts: list[image_reliance.Layout], options: Options) -> dict | None:
    """The report's `image_reliance` (`evaluation.image_reliance`): the same questions scored with each
    record's images swapped for another record's, over this process's `scored` records (`layouts` in
    the same order); an answer is a question, its predicted candidate the argmax. The swapped rows are
    rebuilt (media processed again) rather than kept, so memory stays one batch of rows."""
    plan = image_reliance.plan_swaps(layouts)
    questions = [len(probs) for _, probs in scored]
    compared = [scored[j] for j in plan.donors]
    unswappable = sum(questions[j] for j in plan.unswappable)
    if sum(image_reliance.global_counts(len(compared), len(plan.unswappable))) == 0:
        return None
    donor = {scored[j][0]: scored[d][0] for j, d in plan.donors.items()}
    local_batch = local_batch_size(options.batch_size, restored.mesh)
    # Every process enters as many batches as the one with the most swapped records needs.
    batches = hosts.batches_for_local(len(compared), local_batch)
    swapped = _score(restored, rows, list(donor), batches, local_batch, lambda i: rows.row(i, donor[i]))
    real_argmax = [int(np.argmax(a)) for _, real in compared for a in real]
    swapped_argmax = [int(np.argmax(b)) for _, fake in swapped for b in fake]
    own, theirs = [], []  # per compared question: its gold key and the donor's question's at the same index
    for i, probs in compared:
        donor_gold = gold_keys(rows.examples[donor[i]])
        own += gold_keys(rows.examples[i])
        theirs += [donor_gold[q] if q < len(donor_gold) else None for q in range(len(probs))]
    differing, differing_changed = image_reliance.differing_changes(own, theirs, real_argmax, swapped_argmax)
    return image_reliance.reliance(changed=sum(a != b for a, b in zip(real_argmax, swapped_argmax, strict=True)),
                                   compared=sum(questions[j] for j in plan.donors), unswappable=unswappable,
                                   differing=differing, differing_changed=differing_changed, metric="accuracy",
                                   with_images=_accuracy(rows, compared), swapped_images=_accuracy(rows, swapped))


def gold_keys(example: Example) -> list[str | None]:
    """Per question, the candidate key its hard label picks (what hard-label accuracy compares the argmax
    with); None for a soft-labeled or unlabeled question."""
    meta, arrays = contract.meta_of(example), example.arrays
    owner = arrays["candidate_question"]
    return [keys[int(np.argmax(arrays["labels"][owner == q]))] if arrays["labeled"][q] and hard else None
            for q, (keys, hard) in enumerate(zip(meta.candidate_keys, meta.hard_labels, strict=True))]


def summary(report: dict) -> str:
    return (f"{report['questions']} questions ({report['labeled']} labeled, {report['mode']} mode): "
            f"accuracy {shown(report['accuracy'])}, cross-entropy {shown(report['cross_entropy'])}, "
            f"Brier {shown(report['brier'])}, RPS {shown(report['rps'])}, ECE {shown(report['ece'])}"
            f"{image_reliance.summary(report)}")


def predict_valen(restored: ModelRun, examples: list[Example], mode: str | None, batch_size: int
                  ) -> tuple[str, list[dict]]:
    """(the mode used, one answer line per record in data order; complete on process 0)."""
    qspec = question_spec(restored.config, mode, examples)
    own = [[i, answer_line(examples[i], probs)] for i, probs in score_records(restored, examples, qspec, batch_size)]
    gathered = sorted((pair for part in hosts.gather_json(own) for pair in part), key=lambda pair: pair[0])
    return qspec.mode, [line for _, line in gathered]


def predict_valen_data(restored: ModelRun, data, mode: str | None = None, batch_size: int | None = None,
                       shards_root=None) -> tuple[str, list[dict]]:
    """(the mode used, the answer lines `python -m valen_jax.predict` writes) for a seed-000 Valen JSONL,
    through the same conversion (`workdir.load_examples`, the checkpoint's Valen options) and scoring
    (`predict_valen`). `shards_root`: the folder whose `eval_shards/` the JSONL converts into (default the
    workdir; the server converts each request in a folder of its own)."""
    require_score_head(restored, str(data))
    _, options = data_format(restored, "valen")
    with jax.set_mesh(restored.mesh):
        examples, _, _ = load_examples("valen", data, shards_root or restored.workdir,
                                       checkpoint.tokenizer_dir(restored.workdir), restored.fingerprint, options)
        if not examples:
            raise EvaluationError(f"{data}: no records")
        return predict_valen(restored, examples, mode, int(batch_size or restored.config.eval.batch_size))
