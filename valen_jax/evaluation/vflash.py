"""VFlash evaluation (seed 004): teacher-forced assistant-token loss and accuracy, and greedy
decoding of each example's last answer scored against the reference with `VFlashStats` (points,
boxes, trajectories, dense motion; formulas in `valen_jax.evaluation.metrics.vflash`), overall and per
recipe entry (Example meta `entry`).

Masks: the Example keeps no `atom_loss_masks` strings, but they are recoverable exactly from what
it does keep: `primitive_spans` locates every primitive with coordinates, and a coordinate token
the mask removed has target weight 0. So the reference's masks are rebuilt from the Example, and a
masked-out waypoint (e.g. an occluded dense point) is excluded from the metrics as in training.

Image reliance (`evaluation.image_reliance`): the last answers are decoded again with each record's
images swapped for another's and scored by the same `answer_stats`; the headline is `headline`'s, and its
verdict compares with the text-only baseline below where that has the same headline.

Text-only baseline (`evaluation.text_only`): the last answers a predictor reading only the prompt's text
gives (the most common training answer of the same prompt), scored by the same `answer_stats` and
`headline`, so a reader sees whether the data needs the image at all. The report's `text_only_baseline`:

    {"metric": str, "value": float | None, "same_prompt": int, "records": int, "training_records": int}

`records`: the evaluated records; `same_prompt`: those answered from training records with the same
prompt (the rest get the most common training answer overall); `training_records`: those read (the
first `text_only.TRAINING_RECORDS`). Training data that cannot be read (moved since training) gives
`{"metric": str, "value": None, "unavailable": "<reason naming the path>"}` and one warning line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline.primitives import DENSE_SCALE, PrimitiveError, parse_answer
from data_pipeline.shards import Example
from data_pipeline.tokenizer import end_of_turn_id, number_token_ids
from valen_jax.evaluation import hosts, image_reliance, prompts, text_only, tokens
from valen_jax.evaluation.metrics import shown
from valen_jax.evaluation.metrics.vflash import VFlashStats
from valen_jax.evaluation.workdir import local_batch_size
from valen_jax.run import ModelRun

if TYPE_CHECKING:
    from valen_jax.evaluation.options import Options

log = logging.getLogger(__name__)

# The trajectory kinds of the metrics, in the order `headline` tries them for image reliance.
TRAJECTORY_KINDS = ("robot_2d", "robot_3d", "drive")


def answer_masks(example: Example, end_of_turn: int, numbers: np.ndarray) -> list[str] | None:
    """One 0/1 string per coordinate primitive of the last answer (one character per coordinate
    token, '0' where training gave it no weight), or None when the Example has no spans."""
    arrays = example.arrays
    if "primitive_spans" not in arrays:
        return None
    ids, weights = arrays["input_ids"], arrays["target_weights"]
    spans = prompts.answer_spans(ids, weights, end_of_turn)
    if not spans:
        return None
    start, stop = spans[-1]
    masks = []
    for _, first, last in arrays["primitive_spans"]:
        if first < start or last > stop:
            continue
        inner = np.arange(first + 1, last - 1)
        coords = inner[np.isin(ids[inner], numbers)]
        masks.append("".join("1" if weights[t] > 0 else "0" for t in coords))
    return masks


def dense_scale(example: Example) -> float:
    """The dataset's dense-motion scale `s` (m) that conversion carried into the Example (seed 004:
    "a per-dataset scale"); only a reference with dense motion needs one, and then it must be there."""
    scale = contract.meta_of(example).dense_scale
    if scale is not None:
        return float(scale)
    if "<dense>" in contract.meta_of(example).answers[-1]:
        raise ValueError(f"{contract.where(example)}: a dense-motion reference in shards "
                         "without dense_scale (made before it was recorded); convert the data again")
    return DENSE_SCALE  # never read: neither the reference nor a matched prediction has dense motion


def parses(text: str) -> bool:
    """The answer reads as primitives and holds at least one."""
    try:
        primitives, _ = parse_answer(text)
    except PrimitiveError:
        return False
    return bool(primitives)


def _first_image(example: Example) -> str | None:
    """The path of the example's first media item when it is an image file (for drawing)."""
    for header in contract.media_headers(example):
        return header["path"] if header.get("kind") in ("path", "file") else None
    return None


def evaluate(restored: ModelRun, examples: list[Example], options: Options) -> dict:
    """The report's VFlash part; `options.samples` answers are listed (None: all, in data order)."""
    forced = tokens.teacher_forced(restored.params, restored.graphdef, examples, restored.spec, restored.mesh,
                                   options.batch_size)
    prompts = last_answer_prompts(restored, examples)
    generated = greedy_answers(restored, examples, options, prompts)
    report = {**forced, **answers_report(restored, examples, generated, options)}
    report["text_only_baseline"] = text_only_baseline(restored, examples, report["metrics"]["overall"])
    if options.image_reliance:
        part = image_reliance_report(restored, examples, prompts, generated, options, report["text_only_baseline"])
        if part is not None:
            report["image_reliance"] = part
    return report


def last_answer_prompts(restored: ModelRun, examples: list[Example]) -> list[dict]:
    """The prompt of the last answer of each example this process evaluates (`hosts.local_indices` order)."""
    eot = end_of_turn_id(restored.tokenizer)
    return [prompts.prompt_of(examples[i], restored.spec, eot) for i in hosts.local_indices(len(examples))]


def greedy_answers(restored: ModelRun, examples: list[Example], options: Options,
                   prompts: list[dict] | None = None) -> list[list[int]]:
    """The greedy ids (stop token kept) of the last answer of each example this process evaluates
    (`hosts.local_indices` order), from `prompts` (default: `last_answer_prompts`): every process
    enters the same batches."""
    prompts = last_answer_prompts(restored, examples) if prompts is None else prompts
    local_batch = local_batch_size(options.batch_size, restored.mesh)
    eot = end_of_turn_id(restored.tokenizer)
    return tokens.greedy(restored.params, restored.graphdef, prompts, restored.spec, restored.mesh, local_batch,
                         hosts.batch_count(len(examples), local_batch), options.max_new_tokens, eot,
                         len(restored.tokenizer))


def answer_stats(tokenizer, examples: list[Example], texts: list[str]) -> VFlashStats:
    """The metrics' sums of decoded last answers `texts` against their examples' references (this
    process's; `hosts.sum_stats` adds the others')."""
    eot = end_of_turn_id(tokenizer)
    numbers = np.asarray(number_token_ids(tokenizer), np.int32)
    stats = VFlashStats()
    for example, text in zip(examples, texts, strict=True):
        meta = contract.meta_of(example)
        stats.add(meta.answers[-1], text, entry=meta.entry, masks=answer_masks(example, eot, numbers),
                  dense_scale=dense_scale(example))
    return stats


def answers_report(restored: ModelRun, examples: list[Example], generated: list[list[int]], options: Options) -> dict:
    """generation, metrics and samples of this process's decoded last answers (`greedy_answers`' order),
    sums added across processes: the same numbers whichever decoder produced the ids (the speculative
    report scores its answers here too)."""
    tokenizer, max_new_tokens, samples = restored.tokenizer, options.max_new_tokens, options.samples
    mine = hosts.local_indices(len(examples))
    local = [examples[i] for i in mine]
    eot = end_of_turn_id(tokenizer)
    texts = [tokens.decode(tokenizer, ids, eot) for ids in generated]
    stats = answer_stats(tokenizer, local, texts)
    counts = np.zeros(3)  # answers, parsed, exact
    listed = []
    for i, example, text in zip(mine, local, texts, strict=True):
        reference = contract.meta_of(example).answers[-1]
        ok = parses(text)
        counts += (1, ok, text == reference)
        if samples is None or i < samples:
            listed.append({"index": i, "source": contract.where(example),
                           "entry": contract.meta_of(example).entry, "image": _first_image(example),
                           "reference": reference, "answer": text, "parses": ok})
    answers, parsed, exact = hosts.sum_array(counts)
    listed = sorted((s for part in hosts.gather_json(listed) for s in part), key=lambda s: s["index"])
    return {
        "generation": {"answers": int(answers), "max_new_tokens": int(max_new_tokens),
                       "primitive_parse_rate": parsed / answers if answers else 0.0,
                       "exact_match_rate": exact / answers if answers else 0.0},
        "metrics": hosts.sum_stats(stats).report(),
        "samples": listed,
    }


def headline(overall: dict) -> tuple[str, Callable[[dict], float | None], bool]:
    """(name, its value in an overall metrics dict, lower is better) of the compared answers' headline,
    chosen by what their references hold, so the real and the swapped answers are scored alike: point
    accuracy, else box accuracy at IoU 0.5 (box mean IoU has the same denominator, so it is never there
    when acc_at_0.5 is not), else the ADE of the first trajectory kind with references (robot_2d,
    robot_3d, drive; lower is better; over the trajectories the answers give, so None where none of
    them gives one), else the exact match of the whole answer."""
    if overall["point"]["reference"]:
        return "point_accuracy", lambda m: m["point"]["accuracy"], False
    if overall["box"]["reference"]:
        return "box_acc_at_0.5", lambda m: m["box"]["acc_at_0.5"], False
    for kind in TRAJECTORY_KINDS:
        if overall[kind]["reference"]:
            return "trajectory_ade", lambda m, kind=kind: m[kind]["ade"], True
    return "exact_match", lambda m: m["exact_match"], False


def _overall(tokenizer, examples: list[Example], texts: list[str]) -> dict:
    """All processes' overall metrics of these answers, with the exact match of the whole answer."""
    overall = hosts.sum_stats(answer_stats(tokenizer, examples, texts)).report()["overall"]
    exact, answers = hosts.sum_array(np.asarray(
        [sum(t == contract.meta_of(e).answers[-1] for e, t in zip(examples, texts, strict=True)), len(texts)]))
    return {**overall, "exact_match": exact / answers if answers else None}


def image_reliance_report(restored: ModelRun, examples: list[Example], prompts: list[dict],
                          generated: list[list[int]], options: Options, baseline: dict | None = None) -> dict | None:
    """The report's `image_reliance` (`evaluation.image_reliance`) of this process's last answers
    (`prompts` and their `generated` ids, in `hosts.local_indices` order); None without media. `baseline`:
    the report's `text_only_baseline`, which the verdict compares with where its metric is the headline's."""
    plan = image_reliance.plan_swaps([image_reliance.layout_of(p["vision"]) for p in prompts])
    if sum(image_reliance.global_counts(len(plan.donors), len(plan.unswappable))) == 0:
        return None
    tokenizer, eot = restored.tokenizer, end_of_turn_id(restored.tokenizer)
    swapped = image_reliance.greedy(restored, image_reliance.swap_prompts(prompts, plan), options)
    local = [examples[i] for i in hosts.local_indices(len(examples))]
    compared = [local[j] for j in plan.donors]
    real_texts = [tokens.decode(tokenizer, generated[j], eot) for j in plan.donors]
    swapped_texts = [tokens.decode(tokenizer, ids, eot) for ids in swapped]
    real, fake = _overall(tokenizer, compared, real_texts), _overall(tokenizer, compared, swapped_texts)
    metric, value, lower_is_better = headline(real)
    differing, differing_changed = image_reliance.differing_changes(
        [contract.meta_of(e).answers[-1] for e in compared],
        [contract.meta_of(local[d]).answers[-1] for d in plan.donors.values()], real_texts, swapped_texts)
    return image_reliance.reliance(
        changed=sum(a != b for a, b in zip(real_texts, swapped_texts, strict=True)), compared=len(compared),
        unswappable=len(plan.unswappable), differing=differing, differing_changed=differing_changed,
        metric=metric, with_images=value(real), swapped_images=value(fake), lower_is_better=lower_is_better,
        baseline=baseline["value"] if baseline is not None and baseline["metric"] == metric else None)


def text_only_baseline(restored: ModelRun, examples: list[Example], overall: dict) -> dict:
    """The report's `text_only_baseline` (module docstring) of the evaluated `examples` (the whole data);
    `overall`: the real answers' overall metrics, whose references name the metric when the training data
    is unavailable."""
    try:
        predictor = text_only.fit_training(restored)
    except text_only.TrainingDataUnavailable as error:
        log.warning("text-only baseline unavailable: %s", error)
        return {"metric": headline(overall)[0], "value": None, "unavailable": str(error)}
    slots, eot = tokens.media_slot_ids(restored.spec), end_of_turn_id(restored.tokenizer)
    local = [examples[i] for i in hosts.local_indices(len(examples))]
    answered = [predictor.answer(text_only.prompt_key(e, slots, eot)) for e in local]
    baseline = _overall(restored.tokenizer, local, [text for text, _ in answered])
    metric, value, _ = headline(baseline)
    same, records = hosts.sum_array(np.asarray([sum(same for _, same in answered), len(local)]))
    return {"metric": metric, "value": value(baseline), "same_prompt": int(same), "records": int(records),
            "training_records": predictor.records}


def _baseline_summary(report: dict) -> str:
    part = report.get("text_only_baseline")  # absent: a report written before it was recorded
    if part is None:
        return ""
    if "unavailable" in part:
        return ", text-only baseline unavailable"
    return (f", text-only baseline {part['metric']} {shown(part['value'])} "
            f"({part['same_prompt']} of {part['records']} by a training prompt)")


def summary(report: dict) -> str:
    return (f"loss {shown(report['loss'])}, accuracy {shown(report['accuracy'])}, "
            f"primitive parse rate {report['generation']['primitive_parse_rate']:.3f}"
            f"{_baseline_summary(report)}{image_reliance.summary(report)}")
