"""The one error type every format reader raises (DESIGN, "Contracts": `PATH:LINE: FIELD: message`).

Readers collect every problem of a file before raising, so one validation run lists all
of them instead of stopping at the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

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

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.field}: {self.message}"

    def to_json(self) -> dict[str, str | int]:
        return asdict(self)


class FormatError(ValueError):
    """All problems found in one or more input files."""

    def __init__(self, problems: Sequence[Problem]):
        if not problems:
            raise ValueError("FormatError needs at least one problem")
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))
