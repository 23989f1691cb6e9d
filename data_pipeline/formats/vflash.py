"""Reader and validator of VFlash JSONL annotation files (seed 004, "Data Format").

Each line is one record: `conversations` (human/gpt turns, gpt turns written in the primitive
grammar of `data_pipeline.primitives`), the `image` media field and optional `atom_loss_masks`.
`read_vflash` checks every line, collects every problem and raises one `FormatError`.

Decisions where the seed leaves room:
- Top-level keys are `image`, `conversations`, `atom_loss_masks` and `id`; anything else is refused,
  including a top-level `video` key: the seed writes video frames inside `image`
  (`{"video": …, "frame_index": N}`) and names no other media field.
- `image` may be left out for a text-only record (then no `<image>` placeholder may appear); an
  empty list is refused, since it says nothing a missing key does not.
- `frame_index` is required in a video reference (the seed: "one decoded video frame"), and so is
  `lmdb_key` in an LMDB reference. Turns hold exactly `from` and `value`.
- Relative media paths resolve against `media_root` (a recipe entry's `root`) or else the JSONL's folder,
  and must stay inside it: absolute paths and `..` or symlinks leaving it are refused unless
  `allow_absolute_media` (`media_paths`).
- With `check_media`, every image file is decoded as the training loader decodes it (`media_decode`):
  a file that is not an image is a problem of its line, not a crash at the first batch (issue 54).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from data_pipeline import vocabulary
from data_pipeline.formats.errors import RECORD_FIELD, Problem, ProblemLog
from data_pipeline.formats.jsonl import iter_jsonl_objects
from data_pipeline.formats.media_decode import image_problem
from data_pipeline.formats.media_paths import DatasetFolder
from data_pipeline.primitives import AtomicCall, Primitive, PrimitiveError, coordinate_count, parse_answer

RECORD_KEYS = frozenset({"id", "image", "conversations", "atom_loss_masks"})
TURN_KEYS = frozenset({"from", "value"})
ROLES = ("human", "gpt")
# Seed 004 "Media": the dictionary references, keyed by the key that names their source.
MEDIA_SOURCES: dict[str, tuple[str, frozenset[str]]] = {
    "video": ("video_frame", frozenset({"video", "frame_index", "resize"})),
    "file": ("file", frozenset({"file", "resize"})),
    "lmdb_file": ("lmdb", frozenset({"lmdb_file", "lmdb_key", "resize"})),
}

# Kinds whose file is one image (decoded at validation); a video frame is decoded by the loader's PyAV
# reader, and an LMDB value is checked when conversion reads it (render/vflash.py).
IMAGE_KINDS = ("path", "file")


@dataclass(frozen=True)
class MediaRef:
    kind: str  # "path" | "video_frame" | "file" | "lmdb"
    path: Path  # resolved absolute path of the image, video or LMDB
    frame_index: int | None = None
    lmdb_key: str | None = None
    resize: tuple[int, int] | None = None  # (width, height), an exact stretch
    written: str = ""  # the path as the record writes it: what shard headers record, never `path`


@dataclass(frozen=True)
class VFlashTurn:
    role: str  # "human" | "gpt"
    text: str


@dataclass(frozen=True)
class VFlashRecord:
    source: str
    line: int
    media: tuple[MediaRef, ...]
    turns: tuple[VFlashTurn, ...]
    primitives: tuple[tuple[Primitive, ...], ...]  # per turn; empty for human turns
    atom_loss_masks: tuple[str, ...] | None
    calls: tuple[tuple[AtomicCall, ...], ...] = ()  # per turn, as parse_answer returns them
    record_id: str | int | None = None
    # The dataset's dense-motion scale `s` in metres (a recipe entry's `dense_scale`, or the
    # converter's `dense_scale` option for a plain file); None where nothing stated it.
    dense_scale: float | None = None


def read_vflash(
    path: str | Path, media_root: Path | None = None, check_media: bool = True,
    dense_scale: float | None = None, allow_absolute_media: bool = False,
) -> list[VFlashRecord]:
    """Every record of one VFlash JSONL file, or a FormatError listing every problem.

    `dense_scale`: the file's dense-motion scale `s` in metres, set on every record.
    `allow_absolute_media`: admit absolute media paths and paths leaving the media folder
    (`media_paths`); refused by default."""
    path = Path(path)
    if dense_scale is not None and not (isinstance(dense_scale, int | float) and 0 < dense_scale < float("inf")):
        raise ValueError(f"{path}: dense_scale must be a number of metres > 0, got {dense_scale!r}")
    source = str(path)
    problems = ProblemLog(source)  # lines come in order, so the problems do too
    folder = DatasetFolder(Path(media_root) if media_root is not None else path.parent, allow_absolute_media)
    records = []
    for number, obj in iter_jsonl_objects(path, source, problems):
        line = _Line(source, number, folder, check_media)
        record = line.record(obj)
        problems.extend(line.problems)
        if record is not None and not line.problems:
            records.append(record if dense_scale is None else replace(record, dense_scale=float(dense_scale)))
    problems.raise_if_any()
    return records


class _Line:
    """The checks of one JSONL line; `problems` holds what it found."""

    def __init__(self, source: str, line: int, folder: DatasetFolder, check_media: bool):
        self.source, self.line, self.folder, self.check_media = source, line, folder, check_media
        self.problems: list[Problem] = []

    def problem(self, field: str, message: str) -> None:
        self.problems.append(Problem(self.source, self.line, field, message))

    def record(self, obj: object) -> VFlashRecord | None:
        if not isinstance(obj, dict):
            self.problem(RECORD_FIELD, f"a record must be a JSON object, got {type(obj).__name__}")
            return None
        for key in sorted(set(obj) - RECORD_KEYS):
            self.problem(key, f"unknown key; a VFlash record has {', '.join(sorted(RECORD_KEYS))}")
        record_id = obj.get("id")
        if "id" in obj and (not isinstance(record_id, (str, int)) or isinstance(record_id, bool)):
            self.problem("id", "must be a string or an integer")
        turns, primitives, calls = self.conversations(obj)
        media = self.media(obj.get("image"), "image" in obj)
        if turns is not None:
            self.placeholders(turns, obj.get("image"), "image" in obj)
        masks = self.masks(obj, primitives, turns) if "atom_loss_masks" in obj else None
        if turns is None or primitives is None or media is None:
            return None
        return VFlashRecord(self.source, self.line, media, turns, primitives, masks, calls, record_id)

    # -- conversations ---------------------------------------------------------------------------

    def conversations(self, obj: dict) -> tuple[tuple[VFlashTurn, ...] | None, tuple | None, tuple]:
        conv = obj.get("conversations")
        if not isinstance(conv, list) or not conv:
            self.problem("conversations", "required: a non-empty list of turns")
            return None, None, ()
        before = len(self.problems)
        turns: list[VFlashTurn] = []
        primitives: list[tuple[Primitive, ...]] = []
        calls: list[tuple[AtomicCall, ...]] = []
        for i, turn in enumerate(conv):
            field = f"conversations[{i}]"
            if not isinstance(turn, dict):
                self.problem(field, 'a turn must be an object {"from": …, "value": …}')
                continue
            for key in sorted(set(turn) - TURN_KEYS):
                self.problem(f"{field}.{key}", "unknown key; a turn has from and value")
            role, value = turn.get("from"), turn.get("value")
            # Seed 004: human prompts and gpt answers; training needs each answer to follow a prompt.
            expected = ROLES[i % 2]
            if role not in ROLES:
                self.problem(f"{field}.from", f'must be "human" or "gpt", got {json.dumps(role)}')
            elif role != expected:
                self.problem(
                    f"{field}.from", f"turns alternate human, gpt, … starting with human; expected {expected}"
                )
            if not isinstance(value, str):
                self.problem(f"{field}.value", f"must be a string, got {json.dumps(value)[:40]}")
                continue
            turns.append(VFlashTurn(str(role), value))
            prims, turn_calls = (), ()
            if role == "gpt":
                if vocabulary.IMAGE_PLACEHOLDER in value:
                    self.problem(
                        f"{field}.value",
                        "<image> placeholder in a gpt turn; media placeholders go in human turns",
                    )
                try:
                    found, found_calls = parse_answer(value)
                    prims, turn_calls = tuple(found), tuple(found_calls)
                except PrimitiveError as err:
                    self.problem(f"{field}.value", str(err))
            primitives.append(prims)
            calls.append(turn_calls)
        if len(conv) % 2:
            # Alternation starting with human is checked per turn; an odd count means it ends with human.
            self.problem(
                "conversations",
                f"must alternate human/gpt and end with a gpt turn, so an even number of turns; got {len(conv)}",
            )
        if len(self.problems) > before:
            # Later checks (placeholders, mask lengths) would only repeat this problem in other words.
            return None, None, ()
        return tuple(turns), tuple(primitives), tuple(calls)

    def placeholders(self, turns: tuple[VFlashTurn, ...], image: object, present: bool) -> None:
        wanted = sum(t.text.count(vocabulary.IMAGE_PLACEHOLDER) for t in turns if t.role == "human")
        given = (len(image) if isinstance(image, list) else 1) if present else 0
        if wanted != given:
            self.problem("image", f"{wanted} <image> placeholder(s) in human turns but {given} media item(s)")

    # -- media -----------------------------------------------------------------------------------

    def media(self, image: object, present: bool) -> tuple[MediaRef, ...] | None:
        if not present:
            return ()
        if isinstance(image, list):
            if not image:
                self.problem("image", "empty list; leave image out for a text-only record")
                return None
            refs = [self.media_item(f"image[{j}]", item) for j, item in enumerate(image)]
        else:
            refs = [self.media_item("image", image)]
        return None if any(r is None for r in refs) else tuple(refs)

    def media_item(self, field: str, item: object) -> MediaRef | None:
        if isinstance(item, str):
            path = self.media_path(field, item, "path")
            return None if path is None else MediaRef("path", path, written=item)
        if not isinstance(item, dict):
            self.problem(field, "a media item is a path string or an object with video, file or lmdb_file")
            return None
        sources = [key for key in MEDIA_SOURCES if key in item]
        if len(sources) != 1:
            self.problem(
                field, f"a media object needs exactly one of video, file, lmdb_file; got keys {sorted(item)}"
            )
            return None
        kind, allowed = MEDIA_SOURCES[sources[0]]
        ok = True
        for key in sorted(set(item) - allowed):
            self.problem(
                f"{field}.{key}",
                f"unknown key for a {sources[0]} reference; allowed: {', '.join(sorted(allowed))}",
            )
            ok = False
        path = self.media_path(f"{field}.{sources[0]}", item[sources[0]], kind)
        frame_index = lmdb_key = resize = None
        if kind == "video_frame":
            frame_index = item.get("frame_index")
            if not _is_int(frame_index) or frame_index < 0:
                self.problem(
                    f"{field}.frame_index", f"required: an integer >= 0, got {json.dumps(frame_index)}"
                )
                ok = False
        if kind == "lmdb":
            lmdb_key = item.get("lmdb_key")
            if not isinstance(lmdb_key, str) or not lmdb_key:
                self.problem(f"{field}.lmdb_key", f"required: a non-empty string, got {json.dumps(lmdb_key)}")
                ok = False
        if "resize" in item:
            resize = item["resize"]
            if not (
                isinstance(resize, list) and len(resize) == 2 and all(_is_int(v) and v > 0 for v in resize)
            ):
                self.problem(
                    f"{field}.resize", f"must be [width, height], positive integers; got {json.dumps(resize)}"
                )
                ok = False
            else:
                resize = (resize[0], resize[1])
        if not ok or path is None:
            return None
        return MediaRef(kind, path, frame_index, lmdb_key, resize, item[sources[0]])

    def media_path(self, field: str, value: object, kind: str) -> Path | None:
        if not isinstance(value, str) or not value:
            self.problem(field, f"must be a non-empty path string, got {json.dumps(value)[:40]}")
            return None
        if "://" in value:
            self.problem(field, f"{value!r} is a URL; media must be local paths")
            return None
        refusal = self.folder.refusal(value)  # absolute, or leaving the media folder by `..` or a symlink
        if refusal is not None:
            self.problem(field, refusal)
            return None
        path = Path(self.folder.path(value)).resolve()
        if self.check_media:
            if not path.exists():
                self.problem(field, f"file not found: {path}")
                return None
            # An LMDB environment is a folder (or a file with subdir=False); images and videos are files.
            if kind != "lmdb" and not path.is_file():
                self.problem(field, f"not a file: {path}")
                return None
            if kind in IMAGE_KINDS:
                # Decoded as the loader will (issue 54): a bad image stops here, not at the first batch.
                why = image_problem(path)
                if why is not None:
                    self.problem(field, why)
                    return None
        return path

    # -- atom_loss_masks -------------------------------------------------------------------------

    def masks(self, obj: dict, primitives: tuple | None, turns: tuple | None) -> tuple[str, ...] | None:
        masks = obj["atom_loss_masks"]
        if not isinstance(masks, list):
            self.problem("atom_loss_masks", "must be a list of strings of 0/1 characters")
            return None
        ok = True
        for k, mask in enumerate(masks):
            if not isinstance(mask, str) or not mask or set(mask) - {"0", "1"}:
                self.problem(
                    f"atom_loss_masks[{k}]",
                    f"must be a string of 0/1 characters, got {json.dumps(mask)[:40]}",
                )
                ok = False
        if primitives is None or turns is None:
            return None  # lengths cannot be checked against answers that did not parse
        # Seed 004: one string per primitive of the answer, one character per coordinate token.
        owners = [(i, p) for i, prims in enumerate(primitives) for p in prims if p.values]
        lengths = coordinate_count(p for _, p in owners)
        if len(masks) != len(lengths):
            self.problem(
                "atom_loss_masks",
                f"{len(masks)} mask(s) for {len(lengths)} primitive(s) with coordinates in the gpt turns",
            )
            return None
        for k, (mask, n, (turn, prim)) in enumerate(zip(masks, lengths, owners, strict=True)):
            if isinstance(mask, str) and len(mask) != n:
                self.problem(
                    f"atom_loss_masks[{k}]",
                    f"{len(mask)} characters but its primitive (<{prim.kind}> at char {prim.start} of "
                    f"conversations[{turn}].value) has {n} coordinate tokens",
                )
                ok = False
        return tuple(masks) if ok else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
