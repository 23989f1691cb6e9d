"""Valen evaluation metrics (seed 000), aggregated per question.

Seed 000: "Evaluation aggregates per question" (every labeled question weighs the same, unlike the
default `state_mean` training loss); unlabeled questions count toward nothing but the counts; soft
labels count toward the distribution metrics (cross-entropy, Brier, RPS) but not toward hard-label
accuracy, calibration or the noul confusion matrix. Candidate order is the inference order: choice
in input order, noul `true` then `false`, score grades 0 … K−1 (list indices).

For one question with predicted probabilities q (length K, from the scored branches) and label
probabilities p (a hard label is one-hot):

    cross-entropy  CE    = −Σ_k p_k · ln(max(q_k, 1e-12))
                           (the clip keeps a confidently wrong q_k = 0 finite: it costs ln(1e12) ≈ 27.6)
    Brier          B     = Σ_k (q_k − p_k)²          (summed over candidates, not divided by K; range [0, 2])
    ranked prob.   RPS   = 1/(K−1) · Σ_{k=0}^{K−1} (Q_k − P_k)²,  Q_k = Σ_{j≤k} q_j,  P_k = Σ_{j≤k} p_j
                           (score questions only; range [0, 1]; the k = K−1 term is 0)
    correct        c     = [argmax_k q_k = argmax_k p_k]     (hard labels only; ties go to the lowest index)
    confidence     conf  = max_k q_k;  bin b = min(floor(10 · conf), 9), i.e. [0, .1), …, [.9, 1]

Over a group (overall, one question type, or one breakdown value):

    accuracy       = Σ c / H                              H  = hard-labeled questions
    cross_entropy  = Σ CE / L,  brier = Σ B / L          L  = labeled questions (hard + soft)
    rps            = Σ RPS / L_score                      L_score = labeled score questions
    ece            = Σ_b (n_b / H) · |Σ_{i∈b} c_i / n_b − Σ_{i∈b} conf_i / n_b| = Σ_b |Σ_{i∈b} (c_i − conf_i)| / H
    noul_confusion = counts of (label, prediction) over hard-labeled noul questions, label = argmax p,
                     prediction = argmax q (a 0.5/0.5 tie predicts `true`): {"true": {"true": n, "false": n},
                     "false": {...}} with the label first.

A choice question may have a single candidate (seed 000: 1–255 candidates). Its one branch takes
all the probability (q = [1]) and its label is [1], so CE = 0, B = 0, c = 1 and conf = 1 (bin 9,
no calibration error): it counts toward every mean like any other question, with a perfect score.

A metric whose denominator is 0 is reported as null. Groups: `overall`, `type:<choice|noul|score>`,
and `domain:…`, `modality:…`, `language_bucket:…` from each record's `meta` (a question whose record
has no such field is counted under the value `(missing)`, so each breakdown sums to `overall`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

# Question types, noul order (true first, seed 000) and breakdowns: the Example contract's.
from data_pipeline.examples import NOUL_KEYS, QUESTION_TYPES, VALEN_BREAKDOWNS
from valen_jax.evaluation.metrics import OVERALL, GroupedSums, ratio

BREAKDOWN_KEYS = VALEN_BREAKDOWNS
MISSING = "(missing)"
CLIP = 1e-12  # floor on q_k inside the logarithm of the cross-entropy
BINS = 10  # equal-width confidence bins of the calibration error
PROB_TOL = 1e-3  # predicted probabilities come from a float32 softmax; anything further off is a bug

FIELDS = (
    "questions", "labeled", "unlabeled", "hard", "soft",
    "ce_sum", "brier_sum", "score_labeled", "rps_sum", "correct",
    "noul_true_true", "noul_true_false", "noul_false_true", "noul_false_false",  # label_prediction
    *(f"bin{b}_count" for b in range(BINS)),
    *(f"bin{b}_conf" for b in range(BINS)),
    *(f"bin{b}_correct" for b in range(BINS)),
)


def cross_entropy(probs: np.ndarray, label: np.ndarray) -> float:
    return float(-np.sum(label * np.log(np.maximum(probs, CLIP))))


def brier(probs: np.ndarray, label: np.ndarray) -> float:
    return float(np.sum((probs - label) ** 2))


def ranked_probability_score(probs: np.ndarray, label: np.ndarray) -> float:
    k = probs.shape[0]
    return float(np.sum((np.cumsum(probs) - np.cumsum(label)) ** 2) / (k - 1))


def confidence_bin(confidence: float) -> int:
    return min(int(math.floor(BINS * confidence)), BINS - 1)


class ValenStats(GroupedSums):
    """Per-question sums of the metrics above; `add` one question at a time, `merge`/vectors across hosts."""

    FIELDS = FIELDS

    def add(
        self,
        question_type: str,
        probs: np.ndarray,
        label: np.ndarray | None,
        is_hard: bool,
        breakdown: Mapping[str, str] | None = None,
    ) -> None:
        """One question: predicted `probs` [K], label probabilities [K] (None when unlabeled),
        whether the label is hard (one-hot), and the record's `meta` breakdown values."""
        if question_type not in QUESTION_TYPES:
            raise ValueError(f"question type must be one of {QUESTION_TYPES}, got {question_type!r}")
        q = _distribution(probs, "probs", PROB_TOL)
        keys = self._keys(question_type, breakdown or {})
        if label is None:
            if is_hard:
                raise ValueError("an unlabeled question cannot have a hard label")
            self._add(keys, questions=1, unlabeled=1)
            return
        p = _distribution(label, "label", 1e-6)  # seed 000: label sums are checked with abs_tol=1e-6
        if p.shape != q.shape:
            raise ValueError(f"label has {p.shape[0]} candidates but probs has {q.shape[0]}")
        if question_type == "noul" and q.shape[0] != 2:
            raise ValueError(f"a noul question has 2 candidates (true, false), got {q.shape[0]}")
        if question_type == "score" and q.shape[0] < 2:
            raise ValueError(f"a score question has 2–10 grades, got {q.shape[0]}")
        # Hard means what the reader means (formats/valen.py): one candidate at exactly 1, the rest 0.
        if is_hard and not (p.max() == 1.0 and np.count_nonzero(p) == 1):
            raise ValueError(f"is_hard=True but the label is not one-hot: {p.tolist()}")
        sums = dict(questions=1, labeled=1, ce_sum=cross_entropy(q, p), brier_sum=brier(q, p))
        if question_type == "score":
            sums.update(score_labeled=1, rps_sum=ranked_probability_score(q, p))
        if not is_hard:
            self._add(keys, soft=1, **sums)
            return
        predicted, truth = int(np.argmax(q)), int(np.argmax(p))
        correct = float(predicted == truth)
        b = confidence_bin(float(q.max()))
        sums.update(hard=1, correct=correct, **{f"bin{b}_count": 1, f"bin{b}_conf": float(q.max()),
                                                 f"bin{b}_correct": correct})
        if question_type == "noul":
            names = NOUL_KEYS
            sums[f"noul_{names[truth]}_{names[predicted]}"] = 1
        self._add(keys, **sums)

    @staticmethod
    def _keys(question_type: str, breakdown: Mapping[str, str]) -> list[str]:
        unknown = sorted(set(breakdown) - set(BREAKDOWN_KEYS))
        if unknown:
            raise ValueError(f"breakdown keys must be among {BREAKDOWN_KEYS}, got {unknown}")
        keys = [OVERALL, f"type:{question_type}"]
        for name in BREAKDOWN_KEYS:
            value = breakdown.get(name)
            keys.append(f"{name}:{MISSING if value is None else value}")
        return keys

    def report(self) -> dict:
        """{"overall": metrics, "by_type": {type: metrics}, "by_domain": …, "by_modality": …,
        "by_language_bucket": …}; see the module docstring for each metric's formula."""
        out: dict = {"overall": _metrics(self._sums(OVERALL))}
        out["by_type"] = {name: _metrics(sums) for name, sums in self._breakdown("type")}
        for name in BREAKDOWN_KEYS:
            out[f"by_{name}"] = {value: _metrics(sums) for value, sums in self._breakdown(name)}
        return out


def _distribution(values: np.ndarray, what: str, tol: float) -> np.ndarray:
    x = np.asarray(values, np.float64)
    if x.ndim != 1 or x.shape[0] < 1:
        raise ValueError(f"{what} must be a vector of at least 1 candidate probability, got shape {x.shape}")
    if not np.all(np.isfinite(x)) or x.min() < 0 or abs(x.sum() - 1.0) > tol:
        raise ValueError(f"{what} must be finite, non-negative and sum to 1, got {x.tolist()}")
    return x


def _metrics(s: dict[str, float]) -> dict:
    hard = s["hard"]
    ece = None
    if hard:
        ece = sum(abs(s[f"bin{b}_correct"] - s[f"bin{b}_conf"]) for b in range(BINS)) / hard
    return {
        "questions": int(s["questions"]),
        "labeled": int(s["labeled"]),
        "unlabeled": int(s["unlabeled"]),
        "hard_labeled": int(hard),
        "soft_labeled": int(s["soft"]),
        "accuracy": ratio(s["correct"], hard),
        "cross_entropy": ratio(s["ce_sum"], s["labeled"]),
        "brier": ratio(s["brier_sum"], s["labeled"]),
        "rps": ratio(s["rps_sum"], s["score_labeled"]),
        "ece": ece,
        "noul_confusion": {
            truth: {pred: int(s[f"noul_{truth}_{pred}"]) for pred in NOUL_KEYS}
            for truth in NOUL_KEYS
        },
    }
