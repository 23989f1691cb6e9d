"""Reader of the VFlash recipe JSON (seed 004, "Recipe Format").

A recipe is a JSON object of named entries; each names JSONL annotation files, a media `root`
and sampling options. `read_recipe` checks every entry and raises one `FormatError` listing every
problem, with the line where the entry (or its field) is written.

Path resolution (seed 004 does not say; its example writes `data/robot3d/…`, which reads as
relative to the working directory of the launcher):
- Relative `annotation` and `root` paths resolve against the RECIPE FILE's folder, not the working
  directory, so a recipe moves together with its data and validates the same from anywhere.
  `root` defaults to "" (that folder itself) and must be an existing directory. Absolute paths
  are taken as they are. A path that is missing there but exists relative to the working
  directory is reported as such, with the path to write instead (a seed-style recipe kept
  outside its data folder).
- Media paths inside the annotation files resolve against the entry's `root`.

Decisions where the seed leaves room:
- `length` is refused on an entry with several annotation files: the seed defines it as the
  "expected row count of a single-file entry".
- `visual_aug` has no defaults in the seed, so `prob`, `views`, `ops` and `severity` are required.
- `video_reader_backend`: any of the seed's three is accepted in an entry, but an entry whose
  records hold video frames must name a backend the loader serves (`SERVED_VIDEO_READER_BACKENDS`:
  only PyAV is installed), so a run is refused at validation instead of failing mid-epoch.
- `dense_scale` (our field, metres): the per-dataset scale `s` of dense 3D motion, whose tokens
  mean `(k − 500) · s / 500` m (seed 004 "Physical Primitives": "a per-dataset scale `s` (for
  example 2 m)"). An entry whose records hold `<dense>` answers must state it; it travels into
  each Example's meta and evaluation measures dense errors in those metres.
- Optional fields may be written as `null`, meaning absent. Unknown keys are refused everywhere.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from data_pipeline.formats.errors import FILE_FIELD, FormatError, Problem
from data_pipeline.formats.jsonl import NumberOverflow, loads_strict
from data_pipeline.formats.limits import read_file_capped
from data_pipeline.formats.vflash import VFlashRecord, read_vflash

log = logging.getLogger(__name__)

VIDEO_READER_BACKENDS = ("decord", "pyav", "torchvision")
# What valen_jax.data.media decodes video with; the others are the seed's but not installed.
SERVED_VIDEO_READER_BACKENDS = ("pyav",)
VISUAL_AUG_OPS = ("motion_blur", "gaussian_blur", "zoom_blur", "fog", "glass_blur", "light")
SEVERITY_RANGE = (1, 10)  # seed 004: "a severity drawn from `severity` (1–10)"
ENTRY_KEYS = (
    "annotation",
    "root",
    "repeat_time",
    "data_augment",
    "length",
    "video_reader_backend",
    "visual_aug",
    "dense_scale",
)
VISUAL_AUG_KEYS = ("prob", "views", "ops", "severity", "zoom_max_severity")
RECIPE_FIELD = "recipe"


@dataclass(frozen=True)
class VisualAug:
    prob: float
    views: str | tuple[int, ...]  # "all" or image/video indexes
    ops: tuple[str, ...]
    severity: tuple[int, int]
    zoom_max_severity: int | None


@dataclass(frozen=True)
class RecipeEntry:
    name: str
    annotation: tuple[Path, ...]  # resolved absolute JSONL paths
    root: Path  # resolved absolute media root
    repeat_time: float
    data_augment: bool
    length: int | None
    video_reader_backend: str | None
    visual_aug: VisualAug | None
    dense_scale: float | None = None  # metres; required when the entry's records hold dense motion
    # Line of each field's key (and of the entry, under ""), for problems found with the records.
    lines: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)


def read_recipe(path: str | Path) -> list[RecipeEntry]:
    """The entries of a recipe in file order, or a FormatError listing every problem."""
    path = Path(path)
    source = str(path)
    try:
        text = read_file_capped(path).decode("utf-8-sig")
    except FileNotFoundError:
        raise FormatError([Problem(source, 0, FILE_FIELD, "no such file")]) from None
    except OSError as err:
        raise FormatError([Problem(source, 0, FILE_FIELD, f"cannot read: {err.strerror}")]) from None
    except UnicodeDecodeError as err:
        raise FormatError(
            [Problem(source, 0, FILE_FIELD, f"not UTF-8: invalid byte at offset {err.start}")]
        ) from None
    try:
        data = loads_strict(text)
    except json.JSONDecodeError as err:
        raise FormatError(
            [Problem(source, err.lineno, RECIPE_FIELD, f"invalid JSON: {err.msg} at column {err.colno}")]
        ) from None
    except NumberOverflow as err:
        lines = _key_lines(text)
        line = lines.get(tuple(err.path[:2]), lines.get(tuple(err.path[:1]), 0))
        raise FormatError([Problem(source, line, err.field, err.message)]) from None
    except ValueError as err:
        raise FormatError([Problem(source, 0, RECIPE_FIELD, f"invalid JSON: {err}")]) from None
    if not isinstance(data, dict) or not data:
        raise FormatError(
            [Problem(source, 0, RECIPE_FIELD, "a recipe is a non-empty JSON object of named entries")]
        )
    lines = _key_lines(text)
    folder = path.absolute().parent.resolve()
    problems: list[Problem] = []
    entries = []
    for name, spec in data.items():
        reader = _EntryReader(source, name, lines, folder)
        entry = reader.read(spec)
        problems.extend(reader.problems)
        if entry is not None:
            entries.append(entry)
    if problems:
        raise FormatError(problems)
    return entries


def read_recipe_records(
    path: str | Path, check_media: bool = True, allow_absolute_media: bool = False
) -> list[tuple[RecipeEntry, list[VFlashRecord]]]:
    """Each entry with the records of all its annotation files; problems of every file in one FormatError.

    `allow_absolute_media`: media paths may be absolute or leave their entry's `root` (`media_paths`)."""
    problems: list[Problem] = []
    result = []
    for entry in read_recipe(path):
        records: list[VFlashRecord] = []
        failed = False
        for annotation in entry.annotation:
            try:
                records.extend(read_vflash(annotation, media_root=entry.root, check_media=check_media,
                                           allow_absolute_media=allow_absolute_media))
            except FormatError as err:
                problems.extend(err.problems)
                failed = True
        problems.extend(_entry_record_problems(str(path), entry, records))
        if entry.dense_scale is not None:
            records = [replace(record, dense_scale=entry.dense_scale) for record in records]
        # Seed 004: `length` is an expectation, and "a mismatch is logged" rather than refused.
        if not failed and entry.length is not None and entry.length != len(records):
            log.warning(
                "%s: entry %r expects length=%d but %s has %d records",
                path,
                entry.name,
                entry.length,
                entry.annotation[0],
                len(records),
            )
        result.append((entry, records))
    if problems:
        raise FormatError(problems)
    return result


def _entry_record_problems(source: str, entry: RecipeEntry, records: list[VFlashRecord]) -> list[Problem]:
    """What an entry's options must say about its records: a served video reader, a dense scale."""
    problems = []

    def line(key: str) -> int:
        return entry.lines.get(key, entry.lines.get("", 0))

    videos = [r for r in records if any(m.kind == "video_frame" for m in r.media)]
    backend = entry.video_reader_backend
    if videos and backend is not None and backend not in SERVED_VIDEO_READER_BACKENDS:
        problems.append(Problem(
            source, line("video_reader_backend"), f"{entry.name}.video_reader_backend",
            f"{json.dumps(backend)} cannot decode this entry's videos ({videos[0].source}:{videos[0].line} is "
            f"the first): the loader reads video with {', '.join(SERVED_VIDEO_READER_BACKENDS)} only; set "
            f'"video_reader_backend": "pyav" or leave it out'))
    dense = [r for r in records if any(p.kind == "dense" for turn in r.primitives for p in turn)]
    if dense and entry.dense_scale is None:
        problems.append(Problem(
            source, line(""), f"{entry.name}.dense_scale",
            f"required: {dense[0].source}:{dense[0].line} answers with <dense> motion, whose tokens mean "
            '(k - 500) * s / 500 m for the dataset\'s scale s; state it, e.g. "dense_scale": 2.0'))
    return problems


class _EntryReader:
    def __init__(self, source: str, name: str, lines: dict[tuple[str, ...], int], folder: Path):
        self.source, self.name, self.lines, self.folder = source, name, lines, folder
        self.problems: list[Problem] = []

    def problem(self, field: str, message: str) -> None:
        key = field.split(".")[0].split("[")[0]
        line = self.lines.get((self.name, key), self.lines.get((self.name,), 0))
        self.problems.append(
            Problem(self.source, line, f"{self.name}.{field}" if field else self.name, message)
        )

    def read(self, spec: object) -> RecipeEntry | None:
        if not isinstance(spec, dict):
            self.problem("", "an entry must be a JSON object with at least annotation")
            return None
        for key in spec:
            if key not in ENTRY_KEYS:
                self.problem(key, f"unknown key; an entry has {', '.join(ENTRY_KEYS)}")
        annotation = self.annotation(spec)
        root = self.root(spec.get("root", ""))
        repeat_time = spec.get("repeat_time", 1.0)
        # Seed 004: >= 1 multiplies the sampling weight, (0, 1) selects a subset; 0 or less means nothing.
        if not _is_number(repeat_time) or not math.isfinite(repeat_time) or repeat_time <= 0:
            self.problem("repeat_time", f"must be a finite number > 0, got {json.dumps(repeat_time)}")
        data_augment = spec.get("data_augment", False)
        if not isinstance(data_augment, bool):
            self.problem("data_augment", f"must be true or false, got {json.dumps(data_augment)}")
        length = spec.get("length")
        if length is not None:
            if not _is_int(length) or length < 0:
                self.problem("length", f"must be an integer >= 0, got {json.dumps(length)}")
            elif annotation is not None and len(annotation) > 1:
                self.problem(
                    "length",
                    f"is the row count of a single-file entry; this entry has {len(annotation)} files",
                )
        backend = spec.get("video_reader_backend")
        if backend is not None and backend not in VIDEO_READER_BACKENDS:
            self.problem(
                "video_reader_backend",
                f"must be one of {', '.join(VIDEO_READER_BACKENDS)}, got {json.dumps(backend)}",
            )
        visual_aug = self.visual_aug(spec["visual_aug"]) if spec.get("visual_aug") is not None else None
        dense_scale = spec.get("dense_scale")
        if dense_scale is not None and not (
            _is_number(dense_scale) and math.isfinite(dense_scale) and dense_scale > 0
        ):
            self.problem("dense_scale", f"must be a number of metres > 0, got {json.dumps(dense_scale)}")
        if self.problems or annotation is None or root is None:
            return None
        lines = {key[1] if len(key) > 1 else "": line for key, line in self.lines.items() if key[0] == self.name}
        return RecipeEntry(
            self.name, annotation, root, float(repeat_time), data_augment, length, backend, visual_aug,
            None if dense_scale is None else float(dense_scale), lines,
        )

    def annotation(self, spec: dict) -> tuple[Path, ...] | None:
        value = spec.get("annotation")
        if isinstance(value, str):
            items = [("annotation", value)]
        elif isinstance(value, list) and value:
            items = [(f"annotation[{j}]", v) for j, v in enumerate(value)]
        else:
            what = "required" if "annotation" not in spec else f"got {json.dumps(value)[:40]}"
            self.problem("annotation", f"must be a path or a non-empty list of paths to JSONL files; {what}")
            return None
        paths: list[Path] = []
        for where, item in items:
            if not isinstance(item, str) or not item or "://" in item:
                self.problem(where, f"must be a local file path, got {json.dumps(item)[:60]}")
                continue
            path = (self.folder / item).resolve()
            if not path.is_file():
                self.problem(where, self.not_found("file", item, path, Path.is_file))
            elif path in paths:
                self.problem(where, f"{path} is listed twice; use repeat_time to weight a source")
            else:
                paths.append(path)
        return tuple(paths) if len(paths) == len(items) else None

    def root(self, value: object) -> Path | None:
        if not isinstance(value, str) or "://" in value:
            self.problem("root", f"must be a local folder path, got {json.dumps(value)[:60]}")
            return None
        root = (self.folder / value).resolve()
        if not root.is_dir():
            self.problem("root", self.not_found("folder", value, root, Path.is_dir))
            return None
        return root

    def not_found(self, what: str, written: str, looked: Path, exists) -> str:
        """Where a missing path was looked for, and what to write when the working directory has it."""
        if Path(written).is_absolute():
            return f"{what} not found: {looked}"
        message = f"{what} not found: {looked} (relative paths resolve against the recipe's folder {self.folder})"
        in_cwd = Path(written).absolute()
        if exists(in_cwd):
            fix = os.path.relpath(in_cwd.resolve(), self.folder)
            message += (f"; {in_cwd} exists relative to the working directory: write it relative to the "
                        f"recipe's folder ({json.dumps(fix)}) or as an absolute path")
        return message

    def visual_aug(self, spec: object) -> VisualAug | None:
        if not isinstance(spec, dict):
            self.problem("visual_aug", "must be an object with prob, views, ops and severity")
            return None
        before = len(self.problems)
        for key in spec:
            if key not in VISUAL_AUG_KEYS:
                self.problem(f"visual_aug.{key}", f"unknown key; visual_aug has {', '.join(VISUAL_AUG_KEYS)}")
        for key in VISUAL_AUG_KEYS[:4]:
            if key not in spec:
                self.problem(f"visual_aug.{key}", "required (the seed gives no default)")
        prob = spec.get("prob", 0.0)
        if not _is_number(prob) or not 0.0 <= prob <= 1.0:
            self.problem("visual_aug.prob", f"must be a probability in [0, 1], got {json.dumps(prob)}")
        views = spec.get("views", "all")
        if views != "all" and not (
            isinstance(views, list)
            and views
            and all(_is_int(v) and v >= 0 for v in views)
            and len(set(views)) == len(views)
        ):
            self.problem(
                "visual_aug.views",
                f'must be "all" or a list of distinct image/video indexes >= 0, got {json.dumps(views)}',
            )
        ops = spec.get("ops", [VISUAL_AUG_OPS[0]])
        if not (
            isinstance(ops, list)
            and ops
            and all(op in VISUAL_AUG_OPS for op in ops)
            and len(set(ops)) == len(ops)
        ):
            self.problem(
                "visual_aug.ops",
                f"must be a non-empty list of distinct ops from {', '.join(VISUAL_AUG_OPS)}; got {json.dumps(ops)}",
            )
        lo_max, hi_max = SEVERITY_RANGE
        severity = spec.get("severity", list(SEVERITY_RANGE))
        if not (
            isinstance(severity, list)
            and len(severity) == 2
            and all(_is_int(v) for v in severity)
            and lo_max <= severity[0] <= severity[1] <= hi_max
        ):
            self.problem(
                "visual_aug.severity",
                f"must be [lo, hi] integers with {lo_max} <= lo <= hi <= {hi_max}, got {json.dumps(severity)}",
            )
        zoom = spec.get("zoom_max_severity")
        if zoom is not None and not (_is_int(zoom) and lo_max <= zoom <= hi_max):
            self.problem(
                "visual_aug.zoom_max_severity",
                f"must be an integer in {lo_max}..{hi_max}, got {json.dumps(zoom)}",
            )
        if len(self.problems) > before:
            return None
        return VisualAug(
            float(prob),
            views if views == "all" else tuple(views),
            tuple(ops),
            (severity[0], severity[1]),
            zoom,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Line of each entry key (`(name,)`) and of each entry field key (`(name, field)`).

    `text` is known-valid JSON: a small scan that skips strings and tracks nesting is enough.
    """
    lines: dict[tuple[str, ...], int] = {}
    stack: list[str] = []
    keys: list[str | None] = []
    line, i, n = 1, 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            k = j + 1
            while k < n and text[k] in " \t\r\n":
                k += 1
            depth = len(stack)
            if k < n and text[k] == ":" and 1 <= depth <= 2 and stack == ["{"] * depth:
                keys[depth - 1] = json.loads(text[i : j + 1])
                lines.setdefault(tuple(keys[:depth]), line)
            i = j + 1
            continue
        if c in "{[":
            stack.append(c)
            keys.append(None)
        elif c in "}]":
            stack.pop()
            keys.pop()
        elif c == "\n":
            line += 1
        i += 1
    return lines
