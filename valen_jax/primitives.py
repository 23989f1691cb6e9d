"""Coordinate tokens ↔ coordinates for the physical primitives of seed 004 ("Physical Primitives").

The one quantise/dequantise pair of the project (DESIGN, "Primitive tokens are single tokens").
Seed 004: "Each primitive's coordinate range is quantized linearly with half-up rounding", onto the
1,001 number tokens `<0>` … `<1000>`:

    quantise(v, lo, hi)   = clip(floor(1000 · (v − lo) / (hi − lo) + 1/2), 0, 1000)
    dequantise(k, lo, hi) = lo + k · (hi − lo) / 1000

so a value in [lo, hi] comes back within half a step, (hi − lo) / 2000.

Why the scaled value is computed exactly: in binary floating point, `(v − lo) / (hi − lo) · 1000`
lands a hair above or below a decimal half (−4.995 m in [−5, 5] is 0.49999999999991 in floats),
so float arithmetic would round the same written half up in one place and down in another. Here
every float is read as the shortest decimal that round-trips it (its `repr`, the number as a
person or JSON wrote it) and the scaling is done in rationals (`fractions.Fraction`), so written
halves always round up, and the mapping stays monotonic (the shortest round-trip decimal preserves
order). Values outside [lo, hi] clip to `<0>` / `<1000>`; NaN and ±inf are refused.

`RANGES` gives (lo, hi) per primitive kind and axis, from seed 004's table:
- image kinds (point, box, 2D robot atoms): tokens are image-normalised, `k ↔ k / 1000` of the image
  width (x, u) or height (y, v); ranges are (0, 1), so coordinates come back as fractions of the image
  and distances in "normalised image units" (0..1000 / 1000).
- 3D robot atoms, camera frame: x and y in [−5, 5] m, z in [0, 10] m.
- driving, ego frame: x in [−10, 250] m, y in [−65, 65] m, heading in [−π, π] rad.
- dense 3D motion, relative to the first query point: `(k − 500) · s / 500` m, i.e. the range
  [−s, s] on every axis, for a per-dataset scale `s` (`DENSE_SCALE` = 2.0 m by default; pass the
  dataset's own scale to `ranges`/`coordinates`).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from data_pipeline.primitives import DIMENSIONS, ROBOT_KINDS, Primitive

STEPS = 1000  # seed 004: number tokens <0> … <1000>, so 1000 steps across a range
DENSE_SCALE = 2.0  # seed 004's example scale `s` for dense motion, in metres

_IMAGE = (0.0, 1.0)
_ROBOT_3D = ((-5.0, 5.0), (-5.0, 5.0), (0.0, 10.0))
_DRIVE = ((-10.0, 250.0), (-65.0, 65.0), (-math.pi, math.pi))

RANGES: dict[str, tuple[tuple[float, float], ...]] = {
    "point": (_IMAGE, _IMAGE),
    "box": (_IMAGE, _IMAGE, _IMAGE, _IMAGE),  # x1, y1, x2, y2
    **{k: (_IMAGE, _IMAGE) if DIMENSIONS[k] == 2 else _ROBOT_3D for k in ROBOT_KINDS},
    "drive": _DRIVE,
    "dense": ((-DENSE_SCALE, DENSE_SCALE),) * 3,
}


def ranges(kind: str, dense_scale: float = DENSE_SCALE) -> tuple[tuple[float, float], ...]:
    """(lo, hi) per axis of one waypoint of `kind`; dense motion uses the dataset's scale `s`."""
    if kind == "dense":
        if not (math.isfinite(dense_scale) and dense_scale > 0):
            raise ValueError(f"dense scale must be a positive finite number of metres, got {dense_scale}")
        return ((-dense_scale, dense_scale),) * 3
    if kind not in RANGES:
        raise ValueError(f"no coordinate range for primitive kind {kind!r}; known: {sorted(RANGES)}")
    return RANGES[kind]


def _exact(x: float, what: str) -> Fraction:
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{what} must be finite, got {x}")
    # repr is the shortest decimal that reads back as x: the number as written (see module doc).
    return Fraction(repr(x))


def quantise(value: float, low: float, high: float) -> int:
    """Token index in [0, 1000]: floor(1000·(value − low)/(high − low) + 1/2), computed exactly, clipped."""
    lo, hi = _exact(low, "low"), _exact(high, "high")
    if not hi > lo:
        raise ValueError(f"range needs low < high, got [{low}, {high}]")
    scaled = (_exact(value, "value") - lo) * STEPS / (hi - lo)
    return min(max(math.floor(scaled + Fraction(1, 2)), 0), STEPS)


def dequantise(token, low: float, high: float):
    """low + token·(high − low)/1000: a float for an int token, a float64 array for an array of tokens."""
    if not high > low:
        raise ValueError(f"range needs low < high, got [{low}, {high}]")
    k = np.asarray(token)
    if k.dtype.kind not in "iu" or k.size and (k.min() < 0 or k.max() > STEPS):
        raise ValueError(f"tokens must be integers in [0, {STEPS}], got {token!r}")
    out = low + k.astype(np.float64) * ((high - low) / STEPS)
    return float(out) if out.ndim == 0 else out


def coordinates(primitive: Primitive, dense_scale: float = DENSE_SCALE) -> np.ndarray:
    """float64 [P, D] coordinates of one atom: metres / radians, or fractions of the image.

    point → [1, 2] (x, y); box → [2, 2] (its corners (x1, y1), (x2, y2)); `<objects>None` → [0, 2];
    robot 2D → [P, 2] (u, v); robot 3D → [P, 3] (x, y, z) m; drive → [P, 3] (x m, y m, heading rad);
    dense → [F, 3] m relative to the first query point. A dual-arm answer is two atoms: the caller
    passes each (seed 004: left arm, then right arm).
    """
    kind = primitive.kind
    if kind == "objects_none":
        return np.zeros((0, 2), np.float64)
    axes = ranges(kind, dense_scale)
    if kind == "box":
        axes = axes[:2]  # each corner is an (x, y) pair on the image axes
    d = len(axes)
    values = np.asarray(primitive.values, np.int64)
    if values.size == 0 or values.size % d:
        raise ValueError(f"<{kind}> has {values.size} numbers, not a whole number of {d}-D waypoints")
    values = values.reshape(-1, d)
    return np.stack([dequantise(values[:, a], lo, hi) for a, (lo, hi) in enumerate(axes)], axis=1)
