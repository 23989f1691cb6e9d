"""The Example contract: per example kind, the fields of `arrays` and `meta`, declared once.

An Example (`data_pipeline.shards`, DESIGN "Shards") is a flat mapping of numpy arrays plus a JSON
header `meta`. Two kinds exist:

- `tokens` (formats vflash, recipe, chat, vakforge, prepared): one templated token sequence with a
  per-token target weight; the loader expands media slots and shifts weights to targets.
- `valen` (format valen): token pieces (state, instructions, candidates, suffix) the loader
  assembles into `question` or `shared_state` rows, with soft labels per candidate.

Renderers write through `build` (and `extend`), which refuses an undeclared field, a missing
required one, or an array of the wrong dtype, naming the record. Readers (conversion statistics,
`valen_jax.data`, evaluation) read meta through `meta_of(example).NAME` and `where(example)`;
no module but this one spells a meta key as a string (tests/test_examples.py checks it).
The byte layout is `shards.Example`'s; this module only says what the names mean, so shards
written before it was declared load unchanged.

    from data_pipeline import examples
    ex = examples.build(examples.TOKENS, {"input_ids": ids, "target_weights": w},
                        format="prepared", source="rows.zip/a.parquet", line=1, entry="rows")
    examples.meta_of(ex).entry, examples.where(ex)   # ("rows", "rows.zip/a.parquet:1")
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from data_pipeline.shards import Example

TOKENS = "tokens"
VALEN = "valen"
KINDS = (TOKENS, VALEN)

# Valen `question_type` [Q] holds the index into this tuple (seed 000 question types); append only:
# shards on disk carry the numbers.
QUESTION_TYPES = ("choice", "noul", "score")
# A noul question's candidates, in shard order (seed 000: "Fixed, true first").
NOUL_KEYS = ("true", "false")
# `primitive_spans[:, 0]` holds the index into this tuple; append only (shards carry the numbers).
PRIMITIVE_KINDS: tuple[str, ...] = (
    "point", "box", "robot_single_2d", "robot_single", "robot_left_2d", "robot_right_2d",
    "robot_left", "robot_right", "drive", "dense",
)
# Media bytes travel as arrays `media_0`, `media_1`, ... (uint8), in the order of meta `media`.
MEDIA_ARRAY = re.compile(r"media_(\d+)")


@dataclass(frozen=True)
class ArrayField:
    name: str
    dtype: str  # numpy dtype name
    shape: str  # in words: T tokens, Q questions, C candidates, N primitives
    meaning: str
    required: bool = True


@dataclass(frozen=True)
class MetaField:
    name: str
    type: type | tuple[type, ...]  # JSON type of the value (`object`: any; None allowed where `nullable`)
    meaning: str
    required: bool = True
    nullable: bool = False


ARRAYS: dict[str, tuple[ArrayField, ...]] = {
    TOKENS: (
        ArrayField("input_ids", "int32", "[T]", "the templated sequence; one image_pad token per media slot"),
        ArrayField("target_weights", "float32", "[T]", "loss weight of token t as a prediction target (0 = none)"),
        ArrayField("primitive_spans", "int32", "[N, 3]",
                   "vflash: (PRIMITIVE_KINDS index, first token, one past last token) per primitive", False),
        # Read by `primitives.rendered_blocks`: the blocks the VFlash drafter trains on.
        ArrayField("primitive_blocks", "int32", "[N, 3]",
                   "vflash: per primitive, its atomic_decoding call index (-1 none), block_size, count", False),
    ),
    VALEN: (
        ArrayField("state_ids", "int32", "[S]", "the state through the template, up to the question turn's content"),
        ArrayField("suffix_ids", "int32", "[U]", "what closes the question turn; a branch is scored there"),
        ArrayField("instruction_ids", "int32", "[sum]", "every question's instructions, concatenated"),
        ArrayField("instruction_offsets", "int32", "[Q+1]", "question q's instructions are ids[o[q]:o[q+1]]"),
        ArrayField("candidate_ids", "int32", "[sum]", "every candidate's text (leading newline), concatenated"),
        ArrayField("candidate_offsets", "int32", "[C+1]", "candidate c is ids[o[c]:o[c+1]]"),
        ArrayField("candidate_question", "int32", "[C]", "the question each candidate belongs to"),
        ArrayField("labels", "float32", "[C]", "the candidate's probability (0 when its question is unlabeled)"),
        ArrayField("labeled", "bool", "[Q]", "whether question q has a label"),
        ArrayField("question_type", "int32", "[Q]", "index into QUESTION_TYPES"),
    ),
}

_COMMON = (
    MetaField("format", str, "the input format (format_registry) the Example came from"),
    MetaField("source", str, "the input file (prepared: ZIP/member)"),
    MetaField("line", int, "1-based line (prepared: row) of the record in `source`"),
    MetaField("entry", str, "the source entry (recipe entry, file stem or split) it belongs to"),
    MetaField("media", list, "one header per media array: sha256, kind, path, frame_index, resize[, lmdb_key]",
              required=False),
)
META: dict[str, tuple[MetaField, ...]] = {
    TOKENS: _COMMON + (
        MetaField("answers", list, "vflash, chat, vakforge: the assistant turns' text, for decoding metrics "
                  "(chat, vakforge: one per assistant message, '' for one that only calls tools)", False),
        MetaField("dense_scale", (int, float), "vflash: the dataset's dense-motion scale s in metres", False),
        MetaField("turns", int, "chat, vakforge: messages in the row", False),
        MetaField("trained_turns", int, "chat, vakforge: assistant messages carrying weight", False),
        MetaField("tool_calls", list, "chat, vakforge: per assistant message, its [{name, arguments}]", False),
        MetaField("id", str, "vakforge: conversation id", False),
        # Not `id`: VFlash ids are the user's own labels (0, 1, … in train and eval alike), not the conversation
        # identities the train/eval separation compares.
        MetaField("record_id", (str, int), "vflash: the record's `id`, carried to generated answers", False),
        MetaField("locale", str, "vakforge: locale, an evaluation breakdown", False),
        MetaField("language", str, "vakforge: primary language", False),
        MetaField("data_source", str, "vakforge: meta.source (real | synthetic | public), a breakdown", False),
        MetaField("domain", str, "vakforge: domain", False),
        MetaField("scenario", str, "vakforge: scenario", False, nullable=True),
        MetaField("split", str, "vakforge: the split of splits.json", False),
        MetaField("entities", list, "vakforge: entities of the kept turns, offsets into messages; `answer`: "
                  "the assistant message (index into `answers`) an agent entity is in, null for a user's", False),
        MetaField("overlaps", dict, "vakforge: overlapping turns seen, merged, dropped", False),
        MetaField("skipped", dict, "what the renderer dropped deliberately, by reason (summed into the manifest)",
                  False),
    ),
    VALEN: _COMMON + (
        MetaField("group_id", str, "the record's group (its questions share a state)"),
        MetaField("record_id", object, "record meta record_id", nullable=True),
        MetaField("domain", object, "record meta domain, an evaluation breakdown", nullable=True),
        MetaField("modality", object, "record meta modality, an evaluation breakdown", nullable=True),
        MetaField("language_bucket", object, "record meta language_bucket, an evaluation breakdown", nullable=True),
        MetaField("questions", list, "question ids, in question order"),
        MetaField("question_types", list, "each question's type name (QUESTION_TYPES)"),
        MetaField("candidate_keys", list, "per question, its candidate keys in candidate order"),
        MetaField("hard_labels", list, "per question, whether its label is hard (one-hot)"),
    ),
}
# Valen meta fields copied from the record's own `meta` object (seed 000), null where it lacks them.
VALEN_RECORD_META = ("record_id", "domain", "modality", "language_bucket")
# Of those, the buckets evaluation reports metrics by (seed 000: per domain/modality/language).
VALEN_BREAKDOWNS = ("domain", "modality", "language_bucket")
_ARRAYS = {kind: {f.name: f for f in fields} for kind, fields in ARRAYS.items()}
_META = {kind: {f.name: f for f in fields} for kind, fields in META.items()}


class ExampleError(ValueError):
    """An Example that breaks the contract; names the record it came from."""


def where(example: Example) -> str:
    """`source:line` of the record an Example came from, for error messages ('?' where unknown)."""
    return f"{example.meta.get('source', '?')}:{example.meta.get('line', '?')}"


def kind_of(example: Example) -> str:
    """The kind whose required arrays the Example holds."""
    for kind in KINDS:
        if all(f.name in example.arrays for f in ARRAYS[kind] if f.required):
            return kind
    raise ExampleError(f"{where(example)}: arrays {sorted(example.arrays)} are no Example kind's "
                       "(data_pipeline.examples.ARRAYS)")


def check(kind: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """Refuse arrays or meta that the kind does not declare, lacks, or types otherwise."""
    label = f"{meta.get('source', '?')}:{meta.get('line', '?')}"
    if kind not in _ARRAYS:
        raise ExampleError(f"{label}: kind {kind!r}; choose one of {', '.join(KINDS)}")
    declared = _ARRAYS[kind]
    for name, array in arrays.items():
        field = declared.get(name)
        if field is None and MEDIA_ARRAY.fullmatch(name):
            field = ArrayField(name, "uint8", "[bytes]", "media bytes")
        if field is None:
            raise ExampleError(f"{label}: array {name!r} is not a field of {kind} Examples")
        if array.dtype.name != field.dtype:
            raise ExampleError(f"{label}: array {name!r} is {array.dtype}, the contract says {field.dtype}")
    missing = [f.name for f in ARRAYS[kind] if f.required and f.name not in arrays]
    missing += [f.name for f in META[kind] if f.required and f.name not in meta]
    if missing:
        raise ExampleError(f"{label}: {kind} Example without {', '.join(missing)}")
    for name, value in meta.items():
        field = _META[kind].get(name)
        if field is None:
            raise ExampleError(f"{label}: meta {name!r} is not a field of {kind} Examples")
        if not (isinstance(value, field.type) or (value is None and field.nullable)):
            raise ExampleError(f"{label}: meta {name!r} is {type(value).__name__}, the contract says "
                               f"{getattr(field.type, '__name__', field.type)}")
    media = meta.get("media", [])
    indices = sorted(int(m.group(1)) for m in map(MEDIA_ARRAY.fullmatch, arrays) if m)
    if indices != list(range(len(media))):
        raise ExampleError(f"{label}: {len(media)} media headers for media arrays {indices}")
    broken = _broken_relation(kind, arrays, meta)
    if broken:
        raise ExampleError(f"{label}: {kind} Example: {broken}")


def _broken_relation(kind: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> str | None:
    """The first relation between the kind's fields (lengths, offsets, codes) that does not hold."""
    if kind == TOKENS:
        ids, weights = arrays["input_ids"], arrays["target_weights"]
        if ids.ndim != 1 or ids.shape != weights.shape:
            return f"input_ids {ids.shape} and target_weights {weights.shape} must be [T] of one length"
        spans, blocks = arrays.get("primitive_spans"), arrays.get("primitive_blocks")
        for name, array in (("primitive_spans", spans), ("primitive_blocks", blocks)):
            if array is not None and (array.ndim != 2 or array.shape[1] != 3):
                return f"{name} is {array.shape}, not [N, 3]"
        if spans is not None and blocks is not None and len(spans) != len(blocks):
            return f"{len(spans)} primitive_spans for {len(blocks)} primitive_blocks"
        if spans is not None and len(spans) and not (0 <= spans[:, 0].min() and spans[:, 0].max() < len(PRIMITIVE_KINDS)):
            return "primitive_spans kind ids outside PRIMITIVE_KINDS"
        return None
    for pieces in ("instruction", "candidate"):
        ids, offsets = arrays[f"{pieces}_ids"], arrays[f"{pieces}_offsets"]
        if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(ids) or (np.diff(offsets) < 0).any():
            return f"{pieces}_offsets do not split {pieces}_ids (0 … {len(ids)}, non-decreasing)"
    questions, candidates = len(arrays["instruction_offsets"]) - 1, len(arrays["candidate_offsets"]) - 1
    if not len(arrays["labeled"]) == len(arrays["question_type"]) == questions:
        return f"labeled and question_type must hold one entry per question ({questions})"
    if not len(arrays["candidate_question"]) == len(arrays["labels"]) == candidates:
        return f"candidate_question and labels must hold one entry per candidate ({candidates})"
    types = arrays["question_type"]
    if len(types) and not (0 <= types.min() and types.max() < len(QUESTION_TYPES)):
        return "question_type codes outside QUESTION_TYPES"
    per_question = [len(meta[name]) for name in ("questions", "question_types", "candidate_keys", "hard_labels")]
    if per_question != [questions] * 4:
        return f"meta questions, question_types, candidate_keys, hard_labels hold {per_question}, not {questions} each"
    if sum(len(keys) for keys in meta["candidate_keys"]) != candidates:
        return f"meta candidate_keys name {sum(len(k) for k in meta['candidate_keys'])} candidates, arrays {candidates}"
    return None


def build(kind: str, arrays: dict[str, np.ndarray], **meta: Any) -> Example:
    """The Example of `kind` with these arrays and meta fields, checked against the contract.

    An optional field given as None is left out (absent, as in shards written before it existed),
    unless the contract declares it nullable.
    """
    meta = {name: value for name, value in meta.items() if not _left_out(kind, name, value)}
    check(kind, arrays, meta)
    return Example(arrays=arrays, meta=meta)


def _left_out(kind: str, name: str, value: Any) -> bool:
    field = _META[kind].get(name)
    return value is None and field is not None and not field.required and not field.nullable


def extend(example: Example, kind: str, **meta: Any) -> Example:
    """The Example with meta fields added or replaced (an adapter over another renderer), checked."""
    merged = {**example.meta, **{name: value for name, value in meta.items() if not _left_out(kind, name, value)}}
    check(kind, example.arrays, merged)
    example.meta = merged
    return example


_ALL_META = frozenset(name for fields in _META.values() for name in fields)


class MetaView:
    """Attribute access to an Example's meta by declared name; a field the Example lacks reads None.

    A name no kind declares is an AttributeError, so a typo fails where it is made. Names of the
    other kind read None too, so code over both kinds (conversion statistics) needs no kind test.
    """

    __slots__ = ("_meta",)

    def __init__(self, meta: Mapping[str, Any]):
        self._meta = meta

    def __getattr__(self, name: str) -> Any:
        if name not in _ALL_META:
            raise AttributeError(f"{name!r} is not a meta field of any Example kind (data_pipeline.examples)")
        return self._meta.get(name)


def meta_of(example: Example) -> MetaView:
    return MetaView(example.meta)


def media_headers(example: Example) -> list[dict]:
    """One header per media item (empty for Examples without media)."""
    return list(example.meta.get("media") or [])


def media_bytes(example: Example, index: int) -> bytes:
    return example.arrays[f"media_{index}"].tobytes()


def media_arrays(blobs_data: list[bytes]) -> dict[str, np.ndarray]:
    """The `media_{i}` arrays of media bytes, in order."""
    return {f"media_{i}": np.frombuffer(data, dtype=np.uint8) for i, data in enumerate(blobs_data)}
