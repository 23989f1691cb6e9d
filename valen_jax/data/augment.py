"""Training-only media augmentation of a recipe entry (seed 004, "Recipe Format").

- `data_augment`: "Resize augmentation switch". Every media item of the sample is rescaled by one
  factor drawn uniformly from `RESCALE_RANGE` (both sides, aspect kept) before the processor, so
  the model sees each scene at varied resolutions and vision-token counts. Coordinates in the
  answers are image-relative ([0, 1000]), so they stay valid.
- `visual_aug`: "For each sample, with probability `prob`, one op from `ops` at a severity drawn
  from `severity` (1–10) is applied to the listed `views`; `zoom_max_severity` caps zoom blur."
  The op and severity are drawn once per sample (`draw_sample_aug`); every listed view, and every
  frame of a listed video, gets the same op, severity and random field, so multi-view and
  temporal consistency hold. The ops live in `visual_ops.py`.

Evaluation never augments ("It applies only in VFlash training"): callers pass `training=False`,
and nothing here is reached. Draws come only from the generator the loader passes, seeded per
example (`example_rng`), so a run is reproducible and a resumed run augments as the first did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from PIL import Image

from valen_jax.data.visual_ops import OPS, apply_op

# Side scale of the resize augmentation. Below 1 the processor sees fewer pixels (and may upsample
# back to min_pixels); above 1 it gets more tokens up to max_pixels. Symmetric around the original
# size so the mean resolution matches evaluation.
RESCALE_RANGE = (0.75, 1.25)
SEVERITY_RANGE = (1, 10)
VIDEO_READER_BACKENDS = ("decord", "pyav", "torchvision")  # seed 004; only pyav is installed
VISUAL_AUG_KEYS = ("prob", "views", "ops", "severity", "zoom_max_severity")


class AugmentError(ValueError):
    """A manifest entry whose augmentation options cannot be applied; names the entry."""


@dataclass(frozen=True)
class EntryMedia:
    """The media options of one recipe entry, as the converter writes them in manifest `entries`."""

    data_augment: bool = False
    visual_aug: dict | None = None  # the recipe's object: prob, views, ops, severity, zoom_max_severity
    video_reader_backend: str | None = None
    name: str = ""  # the recipe entry, for error messages

    @classmethod
    def from_manifest_entry(cls, entry: Mapping) -> EntryMedia:
        """Absent keys take the seed's defaults: no resize augmentation, no visual_aug, default reader."""
        name = str(entry.get("name", ""))
        backend = entry.get("video_reader_backend")
        if backend is not None and backend not in VIDEO_READER_BACKENDS:
            raise AugmentError(f"manifest entry {name!r}: video_reader_backend {backend!r}; "
                               f"seed 004 allows {', '.join(VIDEO_READER_BACKENDS)}")
        data_augment = entry.get("data_augment", False)
        if not isinstance(data_augment, bool):
            raise AugmentError(f"manifest entry {name!r}: data_augment must be true or false, got {data_augment!r}")
        visual_aug = entry.get("visual_aug")
        if visual_aug is not None:
            visual_aug = _checked_visual_aug(dict(visual_aug), name)
        return cls(data_augment, visual_aug, backend, name)

    @property
    def augments(self) -> bool:
        return self.data_augment or self.visual_aug is not None


def _checked_visual_aug(spec: dict, name: str) -> dict:
    # The recipe reader validated these already; the manifest may have been edited or written by
    # an older converter, and a bad value must fail at start-up, not in a worker mid-epoch.
    where = f"manifest entry {name!r}: visual_aug"
    unknown = set(spec) - set(VISUAL_AUG_KEYS)
    missing = set(VISUAL_AUG_KEYS[:4]) - set(spec)
    if unknown or missing:
        raise AugmentError(f"{where}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
    if not 0.0 <= float(spec["prob"]) <= 1.0:
        raise AugmentError(f"{where}.prob {spec['prob']!r} is not a probability")
    bad_ops = [op for op in spec["ops"] if op not in OPS]
    if not spec["ops"] or bad_ops:
        raise AugmentError(f"{where}.ops {spec['ops']!r}: unknown ops {bad_ops}; known {sorted(OPS)}")
    lo, hi = spec["severity"]
    if not SEVERITY_RANGE[0] <= lo <= hi <= SEVERITY_RANGE[1]:
        raise AugmentError(f"{where}.severity {spec['severity']!r} is not [lo, hi] within 1..10")
    views = spec["views"]
    if views != "all" and not (isinstance(views, (list, tuple)) and all(isinstance(v, int) for v in views)):
        raise AugmentError(f"{where}.views {views!r} is neither \"all\" nor a list of media indexes")
    return {**spec, "ops": list(spec["ops"]), "severity": [int(lo), int(hi)],
            "views": views if views == "all" else [int(v) for v in views],
            "zoom_max_severity": spec.get("zoom_max_severity")}


@dataclass(frozen=True)
class SampleAug:
    """One sample's augmentation draw, shared by all its media items."""

    scale: float | None = None  # resize augmentation factor; None: off
    op: str | None = None  # visual_aug op; None: not drawn this time (prob) or off
    severity: int | None = None
    views: str | tuple[int, ...] = "all"
    seed: int = 0  # seeds each view's random field (blur angle, fog, glass displacement, light sign)

    def applies_to(self, view: int) -> bool:
        return self.op is not None and (self.views == "all" or view in self.views)


def example_rng(seed: int, example_index: int, epoch: int) -> np.random.Generator:
    """The generator the loader passes for one example: the run seed, the example's index and the
    epoch, so the same example is augmented differently each epoch yet reproducibly."""
    return np.random.default_rng([int(seed), int(example_index), int(epoch)])


def draw_sample_aug(entry: EntryMedia, rng: np.random.Generator | None, where: str) -> SampleAug:
    if not entry.augments:
        return SampleAug()
    if rng is None:
        raise AugmentError(f"{where}: entry {entry.name!r} augments in training but no random generator "
                           "was given; the loader seeds one per example (example_rng)")
    scale = float(rng.uniform(*RESCALE_RANGE)) if entry.data_augment else None
    spec = entry.visual_aug
    if spec is None or not rng.random() < float(spec["prob"]):
        return SampleAug(scale)
    op = spec["ops"][int(rng.integers(len(spec["ops"])))]
    lo, hi = spec["severity"]
    severity = int(rng.integers(lo, hi + 1))
    if op == "zoom_blur" and spec.get("zoom_max_severity") is not None:
        severity = min(severity, int(spec["zoom_max_severity"]))
    views = "all" if spec["views"] == "all" else tuple(spec["views"])
    return SampleAug(scale, op, severity, views, int(rng.integers(2 ** 63)))


def augment_frames(frames: list[Image.Image], view: int, sample: SampleAug) -> tuple[list[Image.Image], dict | None]:
    """Frames of media item `view` → augmented frames, and what was done (for the media log)."""
    done = {}
    if sample.scale is not None:
        width, height = frames[0].size
        size = (max(1, round(width * sample.scale)), max(1, round(height * sample.scale)))
        frames = [frame.resize(size, Image.BICUBIC) for frame in frames]
        done["scale"] = sample.scale
    if sample.applies_to(view):
        # A fresh generator per frame from (sample seed, view): a video's frames get the same field.
        frames = [apply_op(frame, sample.op, sample.severity, np.random.default_rng([sample.seed, view]))
                  for frame in frames]
        done.update(op=sample.op, severity=sample.severity)
    return frames, done or None
