"""splits.json of a vakforge dataset: complete and leak-free assignments (seed 002, "Splits").

    {"seed": 20260916, "splits": {"train": ["conv_1", …], "dev": […], "test": […]}}

The file lies next to the manifest. It records the seed so evaluation is reproducible, and assigns
every conversation id of the manifest to exactly one split.

Decisions where the seed leaves room:
- splits.json is required: without it an assignment is neither complete nor checkable.
- An id in splits.json that the manifest does not hold is refused: a stale assignment means the
  splits were made for other data.
- Leakage is a speaker identity (`meta.speakers.agent` or `.user`, one namespace: a person is the
  same person in either role) in conversations of two splits. Conversation ids are named in the
  message, speaker ids are not, since a customer id may be personal data.
- `meta.split`, when given, must agree with splits.json.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict, deque
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from data_pipeline.formats.errors import FILE_FIELD, Problem
from data_pipeline.formats.jsonl import loads_strict
from data_pipeline.formats.limits import read_file_capped
from data_pipeline.formats.vakforge_schema import (
    SNAKE_CASE_PATTERN,
    ConversationId,
    VakforgeConversation,
    field_path,
)

SPLITS_FILE = "splits.json"


class VakforgeSplits(BaseModel):
    """The contents of splits.json."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    seed: int
    splits: dict[Annotated[str, Field(pattern=SNAKE_CASE_PATTERN)], list[ConversationId]] = Field(min_length=1)


def check_splits(
    splits_path: Path,
    manifest_source: str,
    record_ids: list[tuple[int, str]],
    records: list[tuple[int, VakforgeConversation]],
) -> tuple[VakforgeSplits | None, list[Problem]]:
    """Problems of splits.json against the manifest.

    `record_ids` holds (line, id) of every manifest line with a string id, valid or not, so a record
    with other problems is not also reported as missing from, or stale in, the splits.
    """
    source = str(splits_path)
    problems: list[Problem] = []
    text = _read(splits_path, source, problems)
    if text is None:
        return None, problems
    try:
        splits = VakforgeSplits.model_validate_json(json.dumps(loads_strict(text)), strict=True)
    except (ValueError, RecursionError) as err:
        if isinstance(err, ValidationError):
            for e in err.errors():
                field = field_path(e["loc"]) or FILE_FIELD
                message = "required" if e["type"] == "missing" else e["msg"].replace("Input should be", "must be")
                problems.append(Problem(source, _line_of_key(text, e["loc"]), field, message))
        elif isinstance(err, json.JSONDecodeError):
            problems.append(Problem(source, err.lineno, FILE_FIELD, f"invalid JSON: {err.msg} at column {err.colno}"))
        else:
            problems.append(Problem(source, 0, FILE_FIELD, f"invalid JSON: {err}"))
        return None, problems

    lines = _string_lines(text)
    assigned: dict[str, str] = {}
    known = {cid for _, cid in record_ids}
    for name, ids in splits.splits.items():
        for k, cid in enumerate(ids):
            line = lines[cid].popleft() if lines[cid] else 0
            field = f"splits.{name}[{k}]"
            if cid in assigned:
                problems.append(Problem(
                    source, line, field,
                    f"{cid} is already in split {assigned[cid]!r}; a conversation belongs to exactly one split",
                ))
                continue
            assigned[cid] = name
            if cid not in known:
                problems.append(Problem(
                    source, line, field,
                    f"{cid} is not a conversation of {manifest_source}; remove it or regenerate the splits",
                ))
    for line, cid in record_ids:
        if cid not in assigned:
            problems.append(Problem(
                manifest_source, line, f"id={cid}: id",
                f"not assigned to any split in {source}; add it to exactly one split",
            ))
    for line, conv in records:
        split = assigned.get(conv.id)
        if conv.meta.split is not None and split is not None and conv.meta.split != split:
            problems.append(Problem(
                manifest_source, line, f"id={conv.id}: meta.split",
                f"{conv.meta.split!r} but {source} assigns it to {split!r}; make them agree",
            ))
    problems.extend(_speaker_leaks(manifest_source, records, assigned))
    return splits, problems


def _speaker_leaks(
    manifest_source: str, records: list[tuple[int, VakforgeConversation]], assigned: dict[str, str]
) -> list[Problem]:
    # speaker id -> (split, conversation id, line) of its first conversation in file order
    first: dict[str, tuple[str, str, int]] = {}
    problems = []
    for line, conv in records:
        split = assigned.get(conv.id)
        speakers = conv.meta.speakers
        if split is None or speakers is None:
            continue
        for role in ("agent", "user"):
            speaker = getattr(speakers, role)
            if speaker is None:
                continue
            seen = first.setdefault(speaker, (split, conv.id, line))
            if seen[0] != split:
                problems.append(Problem(
                    manifest_source, line, f"id={conv.id}: meta.speakers.{role}",
                    f"this speaker is in split {split!r} here and in split {seen[0]!r} in id={seen[1]} "
                    f"(line {seen[2]}); a speaker must stay in one split, so move one conversation",
                ))
    return problems


def _read(path: Path, source: str, problems: list[Problem]) -> str | None:
    try:
        return read_file_capped(path).decode("utf-8-sig")
    except FileNotFoundError:
        problems.append(Problem(
            source, 0, FILE_FIELD,
            'no such file; write {"seed": N, "splits": {"train": [ids…], …}} next to the manifest',
        ))
    except OSError as err:
        problems.append(Problem(source, 0, FILE_FIELD, f"cannot read: {err.strerror}"))
    except UnicodeDecodeError as err:
        problems.append(Problem(source, 0, FILE_FIELD, f"not UTF-8: invalid byte at offset {err.start}"))
    return None


_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def _string_lines(text: str) -> defaultdict[str, deque[int]]:
    """Line numbers of every JSON string literal, in document order, keyed by its value."""
    found: defaultdict[str, deque[int]] = defaultdict(deque)
    for number, line in enumerate(text.splitlines(), start=1):
        for m in _STRING.finditer(line):
            try:
                found[json.loads(m.group())].append(number)
            except ValueError:
                continue
    return found


def _line_of_key(text: str, loc: tuple) -> int:
    key = next((p for p in reversed(loc) if isinstance(p, str)), None)
    if key is None:
        return 0
    lines = _string_lines(text).get(key)
    return lines[0] if lines else 0
