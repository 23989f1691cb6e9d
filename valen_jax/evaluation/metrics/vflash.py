"""VFlash answer metrics (seed 004): reference answer text vs predicted answer text, as sums.

Both texts are read with `data_pipeline.primitives.parse_answer`. A reference that does not parse
is an error (the data was validated); a prediction that does not parse is *malformed*: it counts in
`well_formed_rate = 1 − malformed / answers`, and then has no primitives, so every reference
primitive of that answer counts as missing (wrong for accuracies, absent from distance means).
Coordinates come from `data_pipeline.primitives.coordinates` (image kinds as fractions of the image,
0..1000 / 1000; robot 3D and driving in metres; dense in metres for the entry's scale `s`).

Pairing. Points: the i-th reference `<point>` with the i-th predicted one. Trajectories: the i-th
reference atom of a kind with the i-th predicted atom of the same kind (a dual-arm answer is a
`robot_left*` and a `robot_right*` atom, each paired with its own side). Boxes: per `<ref>` label.
Reference atoms without a partner count as `missing`, predicted atoms without one as `extra`.

Masks (`atom_loss_masks` style): one 0/1 string per reference primitive that has coordinates, one
character per coordinate token; a waypoint (point, box, trajectory step, dense frame) is excluded
from every metric when any of its characters is '0' (seed 004: dense rows mark occluded points so).

Metrics of a group (`overall`, or `entry:<recipe entry name>`):
- points: d = ‖ref − pred‖₂ in image units; `distance` = Σ d / compared, `accuracy` = #(d ≤ threshold)
  / reference points (default threshold 0.05, i.e. 50 tokens).
- boxes: IoU = area(A ∩ B) / area(A ∪ B) on continuous image coordinates (area = (x2−x1)(y2−y1)).
  For each label, predictions are matched one-to-one to reference boxes greedily: repeatedly take the
  pair with the highest remaining IoU > 0 (ties: lowest reference, then prediction index); unmatched
  reference boxes score IoU 0. `mean_iou` = Σ IoU / reference boxes, `acc_at_0.5` = #(IoU ≥ 0.5) /
  reference boxes, `precision_at_0.5` = #(IoU ≥ 0.5) / predicted boxes. A reference
  `<objects>None</objects>` is correct only when the prediction writes `None` for that label too
  (`none_accuracy`); predicted boxes for a label the reference has no box for count as predicted boxes.
- trajectories (robot 2D in image units, robot 3D in m, driving on (x, y) in m): only the common
  prefix of n = min(P_ref, P_pred) waypoints is compared, and `waypoint_mismatch` counts pairs with
  P_ref ≠ P_pred. Per trajectory over its included prefix waypoints W:
  ADE = (1/|W|) Σ_{w∈W} ‖ref_w − pred_w‖₂, FDE = ‖ref_w* − pred_w*‖₂ at the last w* ∈ W;
  `ade`/`fde` average these over compared trajectories. Driving also reports `heading_error`: the
  per-trajectory mean of |wrap(h_ref − h_pred)| in radians, wrap to (−π, π].
- dense motion: per-point error e = ‖ref − pred‖₂ in metres over included frames of the common
  prefix; `error` = Σ e / points (a mean over points, not over trajectories).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from data_pipeline.primitives import (
    DENSE_SCALE,
    DIMENSIONS,
    ROBOT_KINDS,
    Primitive,
    PrimitiveError,
    coordinates,
    parse_answer,
)
from valen_jax.evaluation.metrics import OVERALL, GroupedSums, ratio

FAMILIES: dict[str, str] = {
    **{k: "robot_2d" if DIMENSIONS[k] == 2 else "robot_3d" for k in ROBOT_KINDS},
    "drive": "drive",
}
_TRAJ = ("robot_2d", "robot_3d", "drive")
_TRAJ_FIELDS = ("ref", "missing", "extra", "compared", "mismatch", "ade_sum", "fde_sum")

FIELDS = (
    "answers", "malformed",
    "point_ref", "point_missing", "point_extra", "point_compared", "point_dist_sum", "point_hits",
    "box_ref", "box_pred", "box_iou_sum", "box_hits50", "none_ref", "none_correct",
    *(f"{fam}_{f}" for fam in _TRAJ for f in _TRAJ_FIELDS),
    "drive_heading_sum",
    "dense_ref", "dense_missing", "dense_extra", "dense_mismatch", "dense_points", "dense_err_sum",
)


def box_iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two boxes (x1, y1, x2, y2) with x1 < x2, y1 < y2."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(w, 0.0) * max(h, 0.0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union)


def greedy_match(iou: np.ndarray) -> list[tuple[int, int, float]]:
    """One-to-one (reference, prediction, IoU) pairs, highest IoU first; pairs with IoU 0 are not made."""
    iou = np.array(iou, np.float64, copy=True)
    pairs = []
    while iou.size and iou.max() > 0:
        r, p = np.unravel_index(int(np.argmax(iou)), iou.shape)  # row-major: ties to lowest indices
        pairs.append((int(r), int(p), float(iou[r, p])))
        iou[r, :] = -1.0
        iou[:, p] = -1.0
    return pairs


def split_masks(answers: Sequence[str], masks: Sequence[str] | None) -> list[tuple[str, ...] | None]:
    """A record's `atom_loss_masks` (one string per coordinate primitive over all gpt turns, in order)
    split into one tuple per reference answer, for `VFlashStats.add`."""
    if masks is None:
        return [None] * len(answers)
    out, k = [], 0
    for text in answers:
        n = sum(1 for p in parse_answer(text)[0] if p.values)
        out.append(tuple(masks[k : k + n]))
        k += n
    if k != len(masks):
        raise ValueError(f"{len(masks)} masks for {k} primitives with coordinates in the answers")
    return out


def _wrap(angle: np.ndarray) -> np.ndarray:
    """Angle difference into (−π, π]."""
    return np.pi - np.mod(np.pi - angle, 2 * np.pi)


class VFlashStats(GroupedSums):
    FIELDS = FIELDS

    def __init__(self, point_threshold: float = 0.05):
        super().__init__()
        if not point_threshold > 0:
            raise ValueError(f"point_threshold must be positive (image units), got {point_threshold}")
        self.point_threshold = float(point_threshold)

    def _config(self) -> dict:
        return {"point_threshold": self.point_threshold}

    def add(
        self,
        reference: str,
        predicted: str,
        entry: str | None = None,
        masks: Sequence[str] | None = None,
        dense_scale: float = DENSE_SCALE,
    ) -> None:
        """One answer: the reference and predicted texts, its recipe entry name, the masks of the
        reference's coordinate primitives (see `split_masks`), and the entry's dense scale `s` (m)."""
        ref_prims = parse_answer(reference)[0]
        try:
            pred_prims = parse_answer(predicted)[0]
            malformed = 0
        except PrimitiveError:
            pred_prims, malformed = [], 1
        keys = [OVERALL] if entry is None else [OVERALL, f"entry:{entry}"]
        sums: dict[str, float] = {"answers": 1, "malformed": malformed}
        included = _included(ref_prims, masks)

        def by_kind(prims: list[Primitive], kinds) -> dict[str, list[Primitive]]:
            out: dict[str, list[Primitive]] = {}
            for p in prims:
                if p.kind in kinds:
                    out.setdefault(p.kind, []).append(p)
            return out

        ref_k = by_kind(ref_prims, {"point", "dense", *FAMILIES})
        pred_k = by_kind(pred_prims, {"point", "dense", *FAMILIES})
        for kind in sorted(set(ref_k) | set(pred_k)):
            refs, preds = ref_k.get(kind, []), pred_k.get(kind, [])
            family = FAMILIES.get(kind, kind)
            _bump(sums, f"{family}_extra", max(len(preds) - len(refs), 0))
            for i, ref in enumerate(refs):
                pred = preds[i] if i < len(preds) else None
                mask = included[id(ref)]
                if kind == "point":
                    self._point(sums, ref, pred, mask)
                else:
                    _trajectory(sums, family, ref, pred, mask, dense_scale)
        _boxes(sums, ref_prims, pred_prims, included)
        self._add(keys, **sums)

    def _point(self, sums: dict, ref: Primitive, pred: Primitive | None, mask: np.ndarray) -> None:
        if not mask[0]:
            return
        _bump(sums, "point_ref", 1)
        if pred is None:
            _bump(sums, "point_missing", 1)
            return
        d = float(np.linalg.norm(coordinates(ref)[0] - coordinates(pred)[0]))
        _bump(sums, "point_compared", 1)
        _bump(sums, "point_dist_sum", d)
        _bump(sums, "point_hits", float(d <= self.point_threshold))

    def report(self) -> dict:
        """{"overall": metrics, "by_entry": {name: metrics}}; formulas in the module docstring."""
        return {
            "overall": self._metrics(self._sums(OVERALL)),
            "by_entry": {name: self._metrics(s) for name, s in self._breakdown("entry")},
        }

    def _metrics(self, s: dict[str, float]) -> dict:
        out = {
            "answers": int(s["answers"]),
            "malformed": int(s["malformed"]),
            "well_formed_rate": ratio(s["answers"] - s["malformed"], s["answers"]),
            "point": {
                "reference": int(s["point_ref"]), "missing": int(s["point_missing"]),
                "extra": int(s["point_extra"]), "threshold": self.point_threshold,
                "distance": ratio(s["point_dist_sum"], s["point_compared"]),
                "accuracy": ratio(s["point_hits"], s["point_ref"]),
            },
            "box": {
                "reference": int(s["box_ref"]), "predicted": int(s["box_pred"]),
                "mean_iou": ratio(s["box_iou_sum"], s["box_ref"]),
                "acc_at_0.5": ratio(s["box_hits50"], s["box_ref"]),
                "precision_at_0.5": ratio(s["box_hits50"], s["box_pred"]),
                "none_reference": int(s["none_ref"]),
                "none_accuracy": ratio(s["none_correct"], s["none_ref"]),
            },
        }
        for fam in _TRAJ:
            out[fam] = {
                "reference": int(s[f"{fam}_ref"]), "missing": int(s[f"{fam}_missing"]),
                "extra": int(s[f"{fam}_extra"]), "compared": int(s[f"{fam}_compared"]),
                "waypoint_mismatch": int(s[f"{fam}_mismatch"]),
                "ade": ratio(s[f"{fam}_ade_sum"], s[f"{fam}_compared"]),
                "fde": ratio(s[f"{fam}_fde_sum"], s[f"{fam}_compared"]),
            }
        out["drive"]["heading_error"] = ratio(s["drive_heading_sum"], s["drive_compared"])
        out["dense"] = {
            "reference": int(s["dense_ref"]), "missing": int(s["dense_missing"]),
            "extra": int(s["dense_extra"]), "waypoint_mismatch": int(s["dense_mismatch"]),
            "points": int(s["dense_points"]), "error": ratio(s["dense_err_sum"], s["dense_points"]),
        }
        return out


def _bump(sums: dict, name: str, amount: float) -> None:
    sums[name] = sums.get(name, 0.0) + amount


def _included(prims: list[Primitive], masks: Sequence[str] | None) -> dict[int, np.ndarray]:
    """id(primitive) → bool [units]: a unit (waypoint, point or box) counts unless a mask char is '0'."""
    with_values = [p for p in prims if p.values]
    if masks is not None and len(masks) != len(with_values):
        raise ValueError(f"{len(masks)} masks for {len(with_values)} reference primitives with coordinates")
    out = {}
    for k, p in enumerate(with_values):
        width = 4 if p.kind == "box" else 2 if p.kind == "point" else DIMENSIONS[p.kind]
        if masks is None:
            out[id(p)] = np.ones(len(p.values) // width, bool)
            continue
        mask = masks[k]
        if len(mask) != len(p.values) or set(mask) - {"0", "1"}:
            raise ValueError(f"mask {k} {mask!r} does not fit <{p.kind}> with {len(p.values)} coordinate tokens")
        chars = np.frombuffer(mask.encode(), np.uint8).reshape(-1, width)
        out[id(p)] = (chars == ord("1")).all(axis=1)
    return out


def _trajectory(sums: dict, family: str, ref: Primitive, pred: Primitive | None,
                mask: np.ndarray, dense_scale: float) -> None:
    if not mask.any():
        return  # every waypoint masked out: nothing to score
    _bump(sums, f"{family}_ref", 1)
    if pred is None:
        _bump(sums, f"{family}_missing", 1)
        return
    r, p = coordinates(ref, dense_scale), coordinates(pred, dense_scale)
    n = min(len(r), len(p))
    _bump(sums, f"{family}_mismatch", float(len(r) != len(p)))
    keep = np.flatnonzero(mask[:n])
    if keep.size == 0:
        return  # the common prefix holds only masked waypoints
    pos = 2 if family == "drive" else r.shape[1]  # driving distances on (x, y); heading separately
    dist = np.linalg.norm(r[keep, :pos] - p[keep, :pos], axis=1)
    if family == "dense":
        _bump(sums, "dense_points", keep.size)
        _bump(sums, "dense_err_sum", float(dist.sum()))
        return
    _bump(sums, f"{family}_compared", 1)
    _bump(sums, f"{family}_ade_sum", float(dist.mean()))
    _bump(sums, f"{family}_fde_sum", float(dist[-1]))
    if family == "drive":
        _bump(sums, "drive_heading_sum", float(np.abs(_wrap(r[keep, 2] - p[keep, 2])).mean()))


def _boxes(sums: dict, ref_prims: list[Primitive], pred_prims: list[Primitive],
           included: dict[int, np.ndarray]) -> None:
    def by_label(prims, use_mask):
        boxes: dict[str, list[np.ndarray]] = {}
        none: set[str] = set()
        for p in prims:
            if p.kind == "objects_none":
                none.add(p.label)
            elif p.kind == "box" and (not use_mask or included[id(p)][0]):
                boxes.setdefault(p.label, []).append(coordinates(p).reshape(4))  # x1, y1, x2, y2
        return boxes, none

    ref_boxes, ref_none = by_label(ref_prims, True)
    pred_boxes, pred_none = by_label(pred_prims, False)
    for label in ref_none - set(ref_boxes):
        _bump(sums, "none_ref", 1)
        _bump(sums, "none_correct", float(label in pred_none and label not in pred_boxes))
    _bump(sums, "box_pred", sum(len(b) for b in pred_boxes.values()))
    for label, refs in ref_boxes.items():
        preds = pred_boxes.get(label, [])
        _bump(sums, "box_ref", len(refs))
        iou = np.array([[box_iou(r, p) for p in preds] for r in refs]).reshape(len(refs), len(preds))
        for _, _, value in greedy_match(iou):
            _bump(sums, "box_iou_sum", value)
            _bump(sums, "box_hits50", float(value >= 0.5))

