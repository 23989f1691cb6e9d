"""The one error type every format reader raises (DESIGN, "Contracts": `PATH:LINE: FIELD: message`).

Readers collect every problem of a file before raising, so one validation run lists all
of them instead of stopping at the first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from data_pipeline.cli_paths import escaped

# Field name of problems that concern a whole file (missing, empty, undecodable JSON document).
FILE_FIELD = "file"
# Field name of problems that concern a whole JSONL line (not JSON, not an object).
RECORD_FIELD = "record"


@dataclass(frozen=True, order=True)
class Problem:
    """One thing wrong with an input file.

    `line` is the 1-based line (JSONL line, or the recipe line where the key appears);
    0 when the problem concerns the whole file. `field` is a dotted/indexed path such as
    `conversations[1].value` or `image[0].resize`.
    """

    path: str
    line: int
    field: str
    message: str

    def __post_init__(self) -> None:
        # JSON "\ud800" escapes give Python strings with lone surrogates; echoed into a field or
        # message they would make printing the problem itself fail. Escape them once, here.
        for name in ("path", "field", "message"):
            value = getattr(self, name)
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    object.__setattr__(self, name, value.encode("utf-8", "backslashreplace").decode("utf-8"))

    def __str__(self) -> str:
        # Escaped: a path, member name or field taken from a data file may hold a newline, which would
        # print one problem as two lines (or forge a second problem line).
        return escaped(f"{self.path}:{self.line}: {self.field}: {self.message}")

    def to_json(self) -> dict[str, str | int]:
        return asdict(self)


class FormatError(ValueError):
    """All problems found in one or more input files."""

    def __init__(self, problems: Sequence[Problem]):
        if not problems:
            raise ValueError("FormatError needs at least one problem")
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def __reduce__(self):
        # Rebuilt from the problems, so it crosses process boundaries (convert --workers) intact.
        return (type(self), (self.problems,))


# A file with a systematic mistake has one problem per line; a million copies help nobody and would
# hold memory proportional to the file. Readers keep the first PROBLEM_CAP and count the rest.
PROBLEM_CAP = 1000


class ProblemLog:
    """The problems of one read: the first `cap` kept in order, the rest only counted.

    Has the `append`/`extend`/truthiness of the plain list readers used before, so it can be passed
    wherever a `list[Problem]` collector is expected.
    """

    def __init__(self, source: str, cap: int = PROBLEM_CAP):
        self.source = source
        self.cap = cap
        self.kept: list[Problem] = []
        self.not_shown = 0

    def append(self, problem: Problem) -> None:
        if len(self.kept) < self.cap:
            self.kept.append(problem)
        else:
            self.not_shown += 1

    def extend(self, problems: Sequence[Problem]) -> None:
        for problem in problems:
            self.append(problem)

    def __len__(self) -> int:
        return len(self.kept) + self.not_shown

    def __bool__(self) -> bool:
        return bool(self.kept) or self.not_shown > 0

    def report(self) -> list[Problem]:
        """The kept problems, then one closing problem that says how many were left out."""
        if not self.not_shown:
            return list(self.kept)
        more = Problem(self.source, 0, FILE_FIELD, f"… {self.not_shown} more problems not shown")
        return [*self.kept, more]

    def raise_if_any(self) -> None:
        if self:
            raise FormatError(self.report())


# -- writing fields and values into messages ----------------------------------------------------------

_PLAIN_KEY = re.compile(r"[\w-]+")  # keys written bare in a field path: letters (any script), digits, _ and -
_SHOWN_CHARS = 40  # longest excerpt of a value quoted in a message


def quote(text: str) -> str:
    """A string as JSON, non-ASCII kept readable (`"红"`, not `"\\u7ea2"`)."""
    return json.dumps(text, ensure_ascii=False)


def member(field: str, key: str) -> str:
    """The field path of `key` inside `field`: `a.b` for a plain key, `a["x y"]` otherwise."""
    if isinstance(key, str) and _PLAIN_KEY.fullmatch(key):
        return f"{field}.{key}" if field else key
    return f"{field}[{quote(str(key))}]"


def describe(value: object) -> str:
    """A short description of a JSON value for "got …" in a message, bounded in length."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        if len(value) > _SHOWN_CHARS:
            return quote(value[:_SHOWN_CHARS]) + "…"
        return quote(value)
    if isinstance(value, (int, float)):
        try:
            shown = repr(value)
        except ValueError:  # an int over sys.get_int_max_str_digits() digits
            return "a number too long to show"
        return shown if len(shown) <= _SHOWN_CHARS else shown[:_SHOWN_CHARS] + "…"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    if isinstance(value, dict):
        return "an empty object" if not value else "an object"
    return type(value).__name__


class LineProblems:
    """Base of a reader's per-line checker: `problem(field, message)` records a Problem of that line."""

    def __init__(self, source: str, line: int):
        self.source, self.line = source, line
        self.problems: list[Problem] = []

    def problem(self, field: str, message: str) -> None:
        self.problems.append(Problem(self.source, self.line, field, message))
