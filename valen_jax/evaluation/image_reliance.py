"""Image reliance (issue 25): do a model's answers depend on its images? The same records are
answered again with each record's images swapped for another record's, and the report says how many
answers change and how the family's headline metric moves. A VLM that learnt to answer from the text
alone scores the same either way, which no other figure of a report shows.

The swap rule (`plan_swaps`):
- A prompt's layout is the bytes of its `patch_positions` and `patch_segments` (`layout_of`): prompts
  with one layout have the same media slots, grids and M-RoPE positions, so one's patches fill the
  other's slots exactly while its text ids and positions stay as they are. A prompt without media (no
  patch, or every segment 0) has no image to swap: it is left out and not counted.
- Prompts are grouped by layout, in data order; within a group each takes the patches of the next one
  (a cyclic rotation, so the result depends on the data alone). A prompt alone in its group, or whose
  donor's patches are byte-identical to its own (the same image twice), is unswappable: counted, and
  left out of the comparison.
- Each process groups its own slice of the data (`hosts.local_indices`), so no patches cross hosts; the
  counts are added across processes, and the metrics are summed stats (`hosts.sum_stats`) like the
  rest of the report.

The swapped prompts are decoded as the real ones were (`tokens.greedy`: greedy, the same budget and stop
token); Valen questions are scored by the same score head. The report's `image_reliance`:

    {"compared": int, "unswappable": int, "changed_fraction": float | None, "differing": int,
     "reliance": float | None, "metric": str, "with_images": float | None,
     "swapped_images": float | None, "drop": float | None, "lower_is_better": bool,
     "baseline": float | None, "margin": float | None, "verdict": str | None}

`compared` and `unswappable` count answers: a decoded assistant message (VFlash: each record's last
answer; chat and vakforge: each decoded message whose prompt holds a media slot) or a Valen question.
`changed_fraction`: of the compared answers, those whose decoded text (Valen: predicted candidate)
differs with swapped images. `differing`: the compared answers whose donor record's reference differs
from the record's own (VFlash: the last answer's reference text; chat and vakforge: the message's
reference, its tool calls or text, against the donor's message in its place among the messages that see
media; Valen: the hard-labeled
question's gold candidate key, the donor's question at the same index, both hard-labeled); a
reference missing on either side (older shards, a donor with fewer messages or questions, a soft or
no label) is not counted as differing. `reliance`: of the differing answers, those whose decoded text
(Valen: predicted candidate) changes with swapped images; None when none differs. Where answers repeat
(a two-class task), another record's image changes the right answer for only some records, so a
model that looks changes only those: its `changed_fraction` stays near the share of differing pairs
(0.5 for two balanced classes) while its `reliance` reaches 1; a blind model scores 0 on both.
`metric`: the family's headline, computed over the compared answers only,
with the real images (`with_images`) and the swapped ones (`swapped_images`); `drop` is
with_images − swapped_images, or swapped_images − with_images for a metric where lower is better
(trajectory ADE), so a positive drop always means the images helped. The figures are None where no
answer could be compared. Data in which no evaluated prompt holds media (text-only data, a model
without a vision tower) gets no `image_reliance` key at all: there is nothing to measure.

The verdict (`verdict`; the report's `verdict`, the summary line's last clause, and `warn_if_blind`'s
warning line for either of the two blind ones; None where no answer was compared):
- "answers_from_text" (`answers_from_text`): under CHANGE_FLOOR of the compared answers change, or under
  RELIANCE_FLOOR of at least RELIANCE_MIN_DIFFERING differing ones do: the image plays no part.
- "moves_without_improving" (`moves_without_improving`, issue 55): the answers move with the image (not
  the verdict above) but are no better for it: `drop` is under `margin`, and `with_images` is not above
  `baseline` by `margin` either (both oriented by `lower_is_better`). `baseline` is the report's text-only
  baseline of the same metric (`evaluation.text_only`; VFlash only, over all evaluated records, which the
  compared ones nearly always are); where it is None (chat, Valen, training data unavailable) the drop
  alone decides. A model whose picture moves its point everywhere but towards the object asked for (issue
  55: reliance 0.78, drop 0.0, point accuracy 0.03 = the baseline) sees nothing the question needs. The
  test needs at least RELIANCE_MIN_DIFFERING differing answers: where another record's image leaves the
  right answer as it is, a model that looks loses nothing by the swap either.
- "looks": neither.
`margin` (`margin`), on the figures of all compared answers: only the `differing` ones can be worse
with another record's image for a model that looks (the others' right answer stays), so it is a margin
per differing answer times differing / compared; a few image questions among many text ones (Valen)
would otherwise hide a model that looks below a margin sized for all. Per differing answer: for a metric
where higher is better (a fraction of answers: accuracies, exact match), MIN_GAIN or STANDARD_ERRORS
standard errors of the difference of two such fractions over the differing answers, whichever is larger
(the variance p(1 − p) taken at the worst of `with_images`, `swapped_images` and `baseline`); for one
where lower is better (trajectory ADE, in image units or metres: no common scale, and the report keeps no
spread of it), RELATIVE_GAIN of the largest of those three errors. None where `with_images` or
`swapped_images` is None or no answer differs; then, and for a report written before `lower_is_better`
was recorded, the verdict is the first test's alone.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.evaluation import hosts, tokens
from valen_jax.evaluation.metrics import shown
from valen_jax.evaluation.workdir import local_batch_size
from valen_jax.run import ModelRun

if TYPE_CHECKING:
    from valen_jax.data.assemble import RowSpec
    from valen_jax.evaluation.options import Options

log = logging.getLogger(__name__)

# Below this fraction of changed answers the model is reported as answering from the text. Another
# record's image moves the coordinates of nearly every grounding answer of a model that looks; a few
# answers may rightly not move (a tool call the text decides, "no such object" in both images), but
# fewer than 1 in 20 changing means the image plays no part in what the model says.
CHANGE_FLOOR = 0.05
# Below this fraction of the differing answers changing, with at least RELIANCE_MIN_DIFFERING of them,
# the model is reported as answering from the text too: where another record's image changes the right
# answer, a model that looks changes its own nearly always; a handful of differing answers is too few
# to tell that from chance.
RELIANCE_FLOOR = 0.05
RELIANCE_MIN_DIFFERING = 20
# The margin by which the images must improve the headline for the answers' moving to count as looking,
# per differing answer (module docstring, `margin`). A fraction of answers: at least 1 in 20 better, and
# more than two standard errors of the difference on few answers, where chance alone moves a fraction by
# that much. An error (ADE): a tenth of it, the same scale-free "barely better" whatever its unit.
MIN_GAIN = 0.05
STANDARD_ERRORS = 2.0
RELATIVE_GAIN = 0.1
VERDICTS = ("looks", "answers_from_text", "moves_without_improving")


@dataclass(frozen=True)
class Layout:
    """What the swap rule reads of one prompt's vision inputs: digests, so a pass may drop the arrays."""

    key: bytes | None  # sha256 of patch_positions and patch_segments; None: the prompt holds no media
    patches: bytes  # sha256 of the patches (equal digests: byte-identical patches)


@dataclass(frozen=True)
class SwapPlan:
    """Indices into the prompts `plan_swaps` was given (this process's, in data order)."""

    donors: dict[int, int]  # compared prompt → the prompt whose patches it takes, in prompt order
    unswappable: tuple[int, ...]  # prompts with media but no other image of their layout


def _digest(*arrays: np.ndarray) -> bytes:
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())  # equal bytes in another shape differ
        digest.update(array.tobytes())
    return digest.digest()


def layout_of(vision: Mapping[str, np.ndarray]) -> Layout:
    """The layout of one prompt's (or Valen row's) vision arrays (`assemble.vision_arrays`)."""
    segments = np.asarray(vision["patch_segments"])
    if not segments.any():
        return Layout(None, b"")
    return Layout(_digest(vision["patch_positions"], segments), _digest(vision["patches"]))


def sees_media(ids: np.ndarray, spec: RowSpec) -> bool:
    """Whether a prompt's ids hold a media slot: patches fill slot tokens only, so a prompt that ends
    before its record's first image (an early chat message) cannot see it, whatever the patches."""
    return bool(np.isin(np.asarray(ids), tokens.media_slot_ids(spec)).any())


def plan_swaps(layouts: Sequence[Layout]) -> SwapPlan:
    """The swap rule (module docstring) over one process's prompts, in data order."""
    groups: dict[bytes, list[int]] = {}
    for index, layout in enumerate(layouts):
        if layout.key is not None:
            groups.setdefault(layout.key, []).append(index)
    donors, unswappable = {}, []
    for members in groups.values():
        for position, index in enumerate(members):
            donor = members[(position + 1) % len(members)]
            if donor == index or layouts[donor].patches == layouts[index].patches:
                unswappable.append(index)
            else:
                donors[index] = donor
    return SwapPlan(dict(sorted(donors.items())), tuple(sorted(unswappable)))


def with_patches(vision: Mapping[str, np.ndarray], donor: Mapping[str, np.ndarray]) -> dict:
    """`vision` with the donor's patches; positions and segments its own (the same, by the layout)."""
    return {**vision, "patches": donor["patches"]}


def swap_prompts(prompts: Sequence[dict], plan: SwapPlan) -> list[dict]:
    """The compared prompts (in `plan.donors` order), each with its donor's patches."""
    return [{**prompts[i], "vision": with_patches(prompts[i]["vision"], prompts[donor]["vision"])}
            for i, donor in plan.donors.items()]


def teacher_forced_gap(params, graphdef, rows: Sequence[dict], real_sums: np.ndarray, spec: RowSpec, mesh,
                       batch_size: int) -> dict[str, float]:
    """Teacher-forced loss of the swappable rows with their own images and with their donors' (the swap
    rule above), for evaluation during training: `rows` are this process's (`tokens.local_rows`) and
    `real_sums` their per-row sums with their own images (`tokens.forced_sums`), so only the swapped rows
    run again; the sums are added across processes. {"loss_with_images", "loss_swapped_images",
    "image_loss_gap": swapped − with}: a gap near 0 means the supervised tokens are predicted as well from
    another record's image, a model that does not look, which the loss alone never shows. {} when no row
    anywhere has an image to swap."""
    plan = plan_swaps([layout_of(row) for row in rows])
    if sum(global_counts(len(plan.donors), len(plan.unswappable))) == 0:
        return {}
    swapped = [with_patches(rows[i], rows[donor]) for i, donor in plan.donors.items()]
    local_batch = local_batch_size(batch_size, mesh)
    batches = hosts.batches_for_local(len(swapped), local_batch)  # swappable rows differ by process
    compared = np.asarray(real_sums)[list(plan.donors)].reshape(-1, 3)
    (real_nll, _, weight), (swapped_nll, _, _) = (
        hosts.sum_array(part.sum(axis=0)) for part in
        (compared, tokens.row_sums(params, graphdef, swapped, spec, mesh, local_batch, batches)))
    if weight == 0:
        return {}
    with_images, swapped_images = real_nll / weight, swapped_nll / weight
    return {"loss_with_images": with_images, "loss_swapped_images": swapped_images,
            "image_loss_gap": swapped_images - with_images}


def global_counts(compared: int, unswappable: int, gather: hosts.Gather = hosts.process_gather) -> tuple[int, int]:
    """(compared, unswappable) summed over processes: every process takes the same branch on them."""
    total = hosts.sum_array(np.asarray([compared, unswappable]), gather)
    return int(total[0]), int(total[1])


def greedy(restored: ModelRun, prompts: list[dict], options: Options) -> list[list[int]]:
    """Greedy ids of this process's `prompts`, decoded as evaluation decodes the real ones (`tokens.greedy`,
    the options' budget, stop at end of turn); every process enters as many batches as the fullest needs."""
    local_batch = local_batch_size(options.batch_size, restored.mesh)
    batches = hosts.batches_for_local(len(prompts), local_batch)
    eot = end_of_turn_id(restored.tokenizer)
    return tokens.greedy(restored.params, restored.graphdef, prompts, restored.spec, restored.mesh, local_batch,
                         batches, options.max_new_tokens, eot, len(restored.tokenizer))


def differing_changes(references: Sequence, donor_references: Sequence, real: Sequence, swapped: Sequence
                      ) -> tuple[int, int]:
    """(differing, changed of them) over compared answers: answer k differs when both its references are
    known (not None) and unequal, and changes when `real[k] != swapped[k]` (decoded text, predicted candidate)."""
    differing = changed = 0
    for own, donor, a, b in zip(references, donor_references, real, swapped, strict=True):
        if own is not None and donor is not None and own != donor:
            differing += 1
            changed += a != b
    return differing, changed


def reliance(*, changed: int, compared: int, unswappable: int, differing: int, differing_changed: int,
             metric: str, with_images: float | None, swapped_images: float | None, lower_is_better: bool = False,
             baseline: float | None = None, gather: hosts.Gather = hosts.process_gather) -> dict:
    """The report's `image_reliance` from this process's counts (added across processes here; `differing`
    and `differing_changed` from `differing_changes`) and the metric of all processes' compared answers
    (already summed: `hosts.sum_stats`); `baseline`: the text-only baseline of `metric`, where known."""
    changed, compared, unswappable, differing, differing_changed = (int(x) for x in hosts.sum_array(
        np.asarray([changed, compared, unswappable, differing, differing_changed]), gather))
    drop = None
    if with_images is not None and swapped_images is not None:
        drop = _oriented(with_images, swapped_images, lower_is_better)
    part = {"compared": compared, "unswappable": unswappable,
            "changed_fraction": changed / compared if compared else None, "differing": differing,
            "reliance": differing_changed / differing if differing else None, "metric": metric,
            "with_images": with_images, "swapped_images": swapped_images, "drop": drop,
            "lower_is_better": lower_is_better, "baseline": baseline}
    part["margin"] = margin(part)
    part["verdict"] = verdict(part)
    return part


def _oriented(value: float, other: float, lower_is_better: bool) -> float:
    """How much better `value` is than `other` (positive: better), whichever way the metric points."""
    return other - value if lower_is_better else value - other


def _few_change(part: dict) -> bool:
    return part["compared"] > 0 and part["changed_fraction"] < CHANGE_FLOOR


def _differing_kept(part: dict) -> bool:
    # .get: reports written before `reliance` was recorded hold only the changed fraction.
    return (part.get("reliance") is not None and part["differing"] >= RELIANCE_MIN_DIFFERING
            and part["reliance"] < RELIANCE_FLOOR)


def answers_from_text(part: dict | None) -> bool:
    """The model's answers do not depend on its images, by either test. Under CHANGE_FLOOR of the compared
    answers changing needs nothing of the references and covers data where none differs (`reliance` None),
    but answers moving for any reason pass it: on a task whose answers repeat, a model whose answers shift
    where the right answer stays and stay where it flips changes often enough. Under RELIANCE_FLOOR of the
    differing answers changing catches that model, whatever the share of differing pairs."""
    return bool(part) and (_few_change(part) or _differing_kept(part))


def margin(part: dict) -> float | None:
    """The improvement the images must bring for the answers' moving to count as looking (module docstring)."""
    differing = part.get("differing", 0)  # .get: reports written before it was recorded
    if not differing or part["with_images"] is None or part["swapped_images"] is None:
        return None
    values = [part["with_images"], part["swapped_images"]]
    if part.get("baseline") is not None:
        values.append(part["baseline"])
    if part.get("lower_is_better"):
        per_differing = RELATIVE_GAIN * max(values)
    else:
        variance = max(p * (1.0 - p) for p in np.clip(values, 0.0, 1.0))
        per_differing = max(MIN_GAIN, STANDARD_ERRORS * float(np.sqrt(2.0 * variance / differing)))
    return per_differing * differing / part["compared"]


def moves_without_improving(part: dict | None) -> bool:
    """The answers move with the image (`answers_from_text` does not hold) but are no better with the
    record's own image than with another's, nor than the text-only baseline where it is known, by
    `margin`; on at least RELIANCE_MIN_DIFFERING differing answers (module docstring). False for a report
    written before `lower_is_better` was recorded (its baseline's orientation unknown)."""
    if not part or "lower_is_better" not in part or answers_from_text(part):
        return False
    needed = margin(part)
    if needed is None or part["differing"] < RELIANCE_MIN_DIFFERING or part["drop"] >= needed:
        return False
    baseline = part["baseline"]
    return baseline is None or _oriented(part["with_images"], baseline, part["lower_is_better"]) < needed


def verdict(part: dict | None) -> str | None:
    """One of VERDICTS for a report's `image_reliance` (module docstring); None where no answer was compared."""
    if not part or not part["compared"]:
        return None
    if answers_from_text(part):
        return "answers_from_text"
    return "moves_without_improving" if moves_without_improving(part) else "looks"


def _changed(part: dict) -> int:
    return round(part["changed_fraction"] * part["compared"])


def _differing_changed(part: dict) -> int:
    return round(part["reliance"] * part["differing"])


def _figures(part: dict) -> str:
    return f"{part['metric']} {shown(part['with_images'])} → {shown(part['swapped_images'])}"


def warn_if_blind(report: dict) -> None:
    """One warning line when the report's `image_reliance` says the answers ignore the images, or move with
    them without improving (`verdict`)."""
    part = report.get("image_reliance")
    found = verdict(part)
    if found == "moves_without_improving":
        baseline = ("(no text-only baseline to compare with)" if part["baseline"] is None
                    else f"nor than the text-only baseline ({shown(part['baseline'])})")
        log.warning("image reliance: %d of %d answers change when each record's images are swapped for another "
                    "record's, but they are no better than with another record's image (%s, drop %s under the "
                    "margin %s) %s: the model does not see what the question asks for", _changed(part),
                    part["compared"], _figures(part), shown(part["drop"]), shown(margin(part)), baseline)
        return
    if found != "answers_from_text":
        return
    if _few_change(part):
        log.warning("image reliance: %d of %d answers change when each record's images are swapped for another "
                    "record's (%s): the model answers from the text, not the image", _changed(part),
                    part["compared"], _figures(part))
    else:
        log.warning("image reliance: %d of the %d answers whose reference differs with another record's images "
                    "change when they are swapped in (%s): the model answers from the text, not the image",
                    _differing_changed(part), part["differing"], _figures(part))


def summary(report: dict) -> str:
    """The image-reliance clause of a family's summary line ('' without `image_reliance`)."""
    part = report.get("image_reliance")
    if part is None:
        return ""
    if not part["compared"]:
        return f", image reliance: no answer compared ({part['unswappable']} unswappable)"
    line = f", image reliance: {_changed(part)} of {part['compared']} answers change with swapped images"
    if part.get("reliance") is not None:  # .get: reports written before it was recorded
        line += f", {_differing_changed(part)} of {part['differing']} whose reference differs (reliance {shown(part['reliance'])})"
    return line + f" ({_figures(part)}); verdict: {verdict(part)}"
