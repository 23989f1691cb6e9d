"""JSONL reading shared by every line-oriented format: UTF-8, blank lines, strict JSON.

Seed 000 ("Data format"): UTF-8, one JSON record per line, blank lines ignored, an empty file
refused. Every undecodable line becomes a `Problem` with its line number.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from data_pipeline.formats.errors import FILE_FIELD, RECORD_FIELD, Problem


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # json keeps the last of repeated keys silently; a repeated key is a data bug (DESIGN: no silent fallbacks).
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(f"duplicate key {key!r}")
        result[key] = value
    return result


def loads_strict(text: str) -> object:
    """json.loads that refuses repeated keys and NaN/Infinity."""

    def refuse_constant(name: str) -> object:
        raise _DuplicateKey(f"{name} is not JSON")

    return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=refuse_constant)


def read_jsonl_objects(path: Path, source: str, problems: list[Problem]) -> list[tuple[int, object]]:
    """(line number, parsed JSON) of every non-blank line; undecodable lines become problems."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        problems.append(Problem(source, 0, FILE_FIELD, "no such file"))
        return []
    except OSError as err:
        problems.append(Problem(source, 0, FILE_FIELD, f"cannot read: {err.strerror}"))
        return []
    found: list[tuple[int, object]] = []
    bad_lines = 0
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if number == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            problems.append(
                Problem(source, number, RECORD_FIELD, f"not UTF-8: invalid byte at column {err.start + 1}")
            )
            bad_lines += 1
            continue
        if not text.strip():
            continue
        try:
            found.append((number, loads_strict(text)))
        except json.JSONDecodeError as err:
            problems.append(
                Problem(source, number, RECORD_FIELD, f"invalid JSON: {err.msg} at column {err.colno}")
            )
            bad_lines += 1
        except ValueError as err:
            problems.append(Problem(source, number, RECORD_FIELD, f"invalid JSON: {err}"))
            bad_lines += 1
    if not found and not bad_lines:
        problems.append(Problem(source, 0, FILE_FIELD, "empty file: no records"))
    return found


