"""JSONL reading shared by every line-oriented format: UTF-8, blank lines, strict JSON.

Seed 000 ("Data format"): UTF-8, one JSON record per line, blank lines ignored, an empty file
refused. Every undecodable line becomes a `Problem` with its line number, never a traceback:
invalid UTF-8, truncated JSON, nesting deeper than the parser's stack, integers longer than
Python's int/str conversion limit, NaN/Infinity, numbers that overflow to infinity (`1e309`)
and repeated keys alike.

`iter_jsonl_objects` reads one line at a time, so memory does not grow with the file (only with
its longest line, at most `MAX_LINE_CHARS`); `read_jsonl_objects` is the list form.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from data_pipeline.formats.errors import FILE_FIELD, RECORD_FIELD, Problem, member


class ProblemSink(Protocol):
    """Where readers put problems: a plain list, or an `errors.ProblemLog` that caps them."""

    def append(self, problem: Problem, /) -> None: ...


class _NotJSON(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # json keeps the last of repeated keys silently; a repeated key is a data bug (DESIGN: no silent
    # fallbacks). Building the dict in C and comparing sizes keeps the common case cheap: this hook
    # runs for every object of every line.
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _NotJSON(f"duplicate key {key!r}")
            seen.add(key)
    return result


def _refuse_constant(name: str) -> object:
    raise _NotJSON(f"{name} is not JSON")


class NumberOverflow(_NotJSON):
    """A float literal that reads as infinity; `field`/`path` say where, once known (else empty)."""

    def __init__(self, literal: str, field: str = "", path: tuple[str | int, ...] = ()):
        self.literal, self.field, self.path = literal, field, path
        shown = literal if len(literal) <= 40 else literal[:40] + "…"
        self.message = f"the number {shown} is too large for a 64-bit float (it would read as Infinity, which is not JSON)"
        super().__init__(f"{self.message} at {field}" if field else self.message)


def _finite_float(literal: str) -> float:
    # json reads `1e309` (or 309 digits before a fraction) as inf, which a template's `tojson` then
    # writes as `Infinity`, which is not JSON. A hook per float costs less than any scan of the text
    # for such literals (Python's regex engine walks every character).
    value = float(literal)
    if math.isinf(value):
        raise NumberOverflow(literal)
    return value


# One decoder for every line: `json.loads(text, **options)` would build a new one per call.
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys, parse_constant=_refuse_constant,
                            parse_float=_finite_float)
_scan = _DECODER.scan_once  # the C scanner: one JSON value starting exactly at an index
_JSON_SPACE = " \t\n\r"


# Longest JSONL line read, in characters. Records of every seed are kilobytes; a line past this is
# not a record but a runaway file (a missing newline, /dev/zero, an endless pipe). A module constant
# so tests can lower it.
MAX_LINE_CHARS = 64 * 1024 * 1024

# Deepest nesting accepted. The C scanner's own limit differs by Python version (3.11/3.12 stop at
# the recursion limit, ~1000; 3.13 parses far deeper), so one explicit limit gives every version the
# same verdict on the same line. No record of any seed nests past a few dozen levels.
MAX_NESTING = 512
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _nesting(text: str) -> int:
    """The deepest bracket nesting of `text`, brackets inside strings not counted."""
    depth = deepest = 0
    for char in _JSON_STRING.sub("", text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _too_deep(text: str) -> bool:
    # Counting brackets runs in C; only a line with that many brackets pays for the exact scan.
    return text.count("[") + text.count("{") > MAX_NESTING and _nesting(text) > MAX_NESTING


class _Overflow:
    def __init__(self, literal: str):
        self.literal = literal


def _mark_overflow(literal: str) -> object:
    value = float(literal)
    return _Overflow(literal) if math.isinf(value) else value


_MARKING_DECODER = json.JSONDecoder(parse_float=_mark_overflow, parse_constant=_refuse_constant)


def overflowing_number(text: str) -> NumberOverflow | None:
    """The first float literal of the JSON `text` that reads as infinity, with its field, or None.

    The field is written as in every Problem (`messages[1].tool_calls[0].function.arguments.x`).
    Only called on the error path: it parses `text` again.
    """
    pending: list[tuple[str, tuple, object]] = [("", (), _MARKING_DECODER.decode(text))]
    while pending:
        field, path, value = pending.pop()
        if isinstance(value, _Overflow):
            return NumberOverflow(value.literal, field or RECORD_FIELD, path)
        if isinstance(value, dict):
            pending.extend((member(field, key), (*path, key), item) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            pending.extend((f"{field}[{i}]", (*path, i), item) for i, item in reversed(list(enumerate(value))))
    return None


def loads_strict(text: str) -> object:
    """json.loads that refuses repeated keys, NaN/Infinity and floats that overflow to infinity
    (the message then names the field); every failure is a ValueError.

    `json.JSONDecodeError` keeps its position; nesting deeper than `MAX_NESTING` (or the parser's
    stack) and integers over `sys.get_int_max_str_digits()` digits become plain ValueErrors with a
    readable message.
    """
    if _too_deep(text):
        raise _NotJSON("nested too deeply for the JSON parser")
    try:
        return _DECODER.decode(text)
    except NumberOverflow as err:
        raise overflowing_number(text) or err from None
    except RecursionError:
        raise _NotJSON("nested too deeply for the JSON parser") from None
    except (json.JSONDecodeError, _NotJSON):
        raise
    except ValueError as err:
        if "integer string conversion" in str(err):
            limit = sys.get_int_max_str_digits()
            raise _NotJSON(f"an integer with more than {limit} digits") from None
        raise


def iter_jsonl_objects(path: Path, source: str, problems: ProblemSink) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of every non-blank line, one line in memory at a time.

    Undecodable lines, and a missing, unreadable or empty file, are appended to `problems`; the
    caller must exhaust the generator before looking at them.
    """
    try:
        # surrogateescape: an invalid byte becomes a lone surrogate that is reported below with its
        # line, instead of a UnicodeDecodeError that would end the whole read. newline="\n": lines
        # end at LF only, as in a byte-wise split (a stray CR stays inside its line).
        handle = open(path, encoding="utf-8", errors="surrogateescape", newline="\n")  # noqa: SIM115
    except FileNotFoundError:
        problems.append(Problem(source, 0, FILE_FIELD, "no such file"))
        return
    except OSError as err:
        problems.append(Problem(source, 0, FILE_FIELD, f"cannot read: {err.strerror}"))
        return
    found = bad_lines = number = 0
    # readline with a limit: a line is never longer in memory than MAX_LINE_CHARS (+1 to tell a line
    # of exactly the limit from a longer one), so /dev/zero or an endless pipe stops at the limit.
    limit = MAX_LINE_CHARS
    try:
        for number, text in enumerate(iter(functools.partial(handle.readline, limit + 1), ""), start=1):
            if len(text) > limit and not text.endswith("\n"):
                problems.append(Problem(source, number, RECORD_FIELD,
                                        f"line longer than {limit} characters (the limit of JSONL lines); "
                                        "reading stops here"))
                return
            if not text.isascii():
                if number == 1 and text.startswith("\ufeff"):
                    text = text[1:]
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as err:
                    column = len(text[: err.start].encode("utf-8", "surrogateescape")) + 1
                    problems.append(
                        Problem(source, number, RECORD_FIELD, f"not UTF-8: invalid byte at column {column}")
                    )
                    bad_lines += 1
                    continue
            # Fast path: the C scanner on a line that is one value and its newline; anything else
            # (blank lines, leading spaces, errors) goes through loads_strict for the exact answer.
            try:
                if _too_deep(text):
                    raise ValueError
                obj, end = _scan(text, 0)
                if end != len(text) and text[end:] != "\n" and text[end:].strip(_JSON_SPACE):
                    raise ValueError
            except (StopIteration, ValueError, RecursionError):
                if not text or text.isspace():
                    continue
                try:
                    # Without its newline, so a truncated line reads "Unterminated string", not
                    # "Invalid control character" (the newline inside the open string).
                    obj = loads_strict(text[:-1] if text.endswith("\n") else text)
                except json.JSONDecodeError as err:
                    # json's message for a control character ends in "at"; the column follows.
                    msg = err.msg.removesuffix(" at")
                    problems.append(
                        Problem(source, number, RECORD_FIELD, f"invalid JSON: {msg} at column {err.colno}")
                    )
                    bad_lines += 1
                    continue
                except NumberOverflow as err:
                    problems.append(Problem(source, number, err.field or RECORD_FIELD, err.message))
                    bad_lines += 1
                    continue
                except ValueError as err:
                    problems.append(Problem(source, number, RECORD_FIELD, f"invalid JSON: {err}"))
                    bad_lines += 1
                    continue
            found += 1
            yield number, obj
    except OSError as err:
        problems.append(Problem(source, number + 1, FILE_FIELD, f"cannot read: {err.strerror}"))
        return
    finally:
        handle.close()
    if not found and not bad_lines:
        problems.append(Problem(source, 0, FILE_FIELD, "empty file: no records"))


def read_jsonl_objects(path: Path, source: str, problems: ProblemSink) -> list[tuple[int, object]]:
    """(line number, parsed JSON) of every non-blank line; undecodable lines become problems."""
    return list(iter_jsonl_objects(path, source, problems))
