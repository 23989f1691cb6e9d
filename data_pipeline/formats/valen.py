"""Reader and validator of Valen scored-question JSONL (seed 000, "Data format").

Each line is one record: `group_id`, a `request` (a `state` and its `questions`), optional
`targets` (soft or hard labels), an optional `assets` manifest of media digests and optional
`meta`. Three entry points, all reading one line at a time and all raising one `FormatError` that
lists every problem of the file (the first `errors.PROBLEM_CAP`, then a count):
- `iter_valen(path)` yields typed `ValenRecord`s, raising after the last line if any was bad;
- `read_valen(path)` is its list form;
- `check_valen(path)` applies the same rules, builds no record and returns counts: memory stays
  flat however long the file (the validate CLI uses it).

Decisions where the seed leaves room:
- Top-level keys are the five the seed lists; anything else is refused, and so are unknown keys in
  `request`, in a question, in a state message or part, and in an `assets` entry (DESIGN: no silent
  fallbacks). Extra label fields (`label_source`, `votes`, …) are allowed: the seed names them.
- "Non-empty" strings (instructions, descriptions, candidate names, question ids, a string
  `group_id`) must hold a non-whitespace character: a blank description builds an empty prompt.
  A string `state` may be empty; the seed only asks for "a text string".
- `group_id` may be any JSON value but null, "" or an empty list/object ("preferably a string").
- `assets` and `meta` written as null are refused like `targets: null`: omit them or use [] / {}.
- A noul question's candidates are `("true", "true"), ("false", "false")`, true first: the seed
  gives noul no descriptions, and inventing words ("Yes") would be wrong for non-English data, so
  the candidate text is its key and wording is the renderer's business.
- A label is hard when one value is exactly 1 and the others exactly 0. A target whose
  probabilities are omitted or null is unlabeled and its extra fields are not kept.
- An `assets` entry matches a media reference when both resolve to the same normalised path
  (`./a.png` matches `a.png`). Digests are lowercase hex; upper case is accepted and lowered.
- With `check_media`, every referenced media file must exist and is hashed (once per read, even
  when many records share it; up to 4096 distinct files remembered), for labeled and unlabeled
  records alike; each image is also decoded as the training loader decodes it (`media_decode`), so a
  file that is not an image is a problem of its line (issue 54; videos are decoded by the loader).
  Without it, paths are still resolved and URLs refused; `sha256` is None.
- `{"messages": [...]}` needs at least one message, and a list `content` at least one part; a
  string `content` or text part may be empty. Media may sit in any role's message.
- A JSON object with a repeated key is refused (`jsonl.loads_strict`): json would keep the last.
- The seed's reader "loads the whole file into memory at once"; this one streams, which reports
  the same problems and lets `check_valen` run on files larger than memory.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.formats.errors import ProblemLog
from data_pipeline.formats.jsonl import iter_jsonl_objects
from data_pipeline.formats.valen_check import GRADE_KEYS, NOUL_KEYS, Checked, RecordCheck, plain_counts
from data_pipeline.formats.valen_state import Asset, MediaFiles, Message, Part, ResolvedMedia, StateMessages

__all__ = ["Asset", "Label", "Message", "Part", "Question", "ResolvedMedia", "StateMessages", "ValenRecord"]
__all__ += ["ValenCounts", "check_valen", "iter_valen", "read_valen", "NOUL_CANDIDATES"]

# The seed gives noul questions no descriptions; the candidate text is the key (module docstring).
NOUL_CANDIDATES = tuple((key, key) for key in NOUL_KEYS)


@dataclass(frozen=True, slots=True)
class Question:
    id: str
    type: str  # "choice" | "noul" | "score"
    instructions: str
    candidates: tuple[tuple[str, str], ...]  # (label key, text) in input order; noul: true first

    @property
    def keys(self) -> tuple[str, ...]:
        """Label keys in candidate order: choice names, "true"/"false", or "0" … "K-1"."""
        return tuple(key for key, _ in self.candidates)


@dataclass(frozen=True, slots=True)
class Label:
    probabilities: dict[str, float]  # every candidate key, in candidate order
    is_hard: bool  # one candidate at exactly 1, the rest at exactly 0
    extra: dict[str, object]  # provenance such as label_source, votes; training does not read it


@dataclass(frozen=True, slots=True)
class ValenRecord:
    source: str
    line: int
    group_id: object  # as written: usually a str; any non-empty JSON value is allowed
    state: str | StateMessages
    questions: tuple[Question, ...]  # file order
    targets: tuple[Label | None, ...]  # one per question, same order; None = unlabeled
    assets: tuple[Asset, ...]
    meta: dict[str, object]
    media: tuple[ResolvedMedia, ...]  # every media part of the state, in message order

    @property
    def group_key(self) -> str:
        """`group_id` as one string for splitting and grouping: a non-string as compact JSON."""
        if isinstance(self.group_id, str):
            return self.group_id
        return json.dumps(self.group_id, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @property
    def labeled(self) -> int:
        return sum(label is not None for label in self.targets)

    def target(self, question_id: str) -> Label | None:
        for question, label in zip(self.questions, self.targets, strict=True):
            if question.id == question_id:
                return label
        raise KeyError(question_id)


@dataclass(frozen=True)
class ValenCounts:
    records: int
    questions: int
    labeled: int

    def __str__(self) -> str:
        return f"{self.records} records, {self.questions} questions, {self.labeled} labeled"


def read_valen(path: str | Path, check_media: bool = True, allow_absolute_media: bool = False) -> list[ValenRecord]:
    """Every record of one Valen JSONL file, or a FormatError listing every problem."""
    return list(iter_valen(path, check_media=check_media, allow_absolute_media=allow_absolute_media))


def iter_valen(path: str | Path, check_media: bool = True, allow_absolute_media: bool = False) -> Iterator[ValenRecord]:
    """The records of one Valen JSONL file, reading one line at a time.

    Yields each record that has no problem; after the last line raises one FormatError if any line
    (or the file) had a problem, so a consumer that runs to the end never accepts a bad file.
    `allow_absolute_media`: admit absolute media paths and paths leaving the JSONL's folder
    (seed 000 "local absolute paths also work"; `media_paths`); refused by default.
    """
    for number, obj, checked in _checked_lines(Path(path), check_media, allow_absolute_media):
        yield _build(str(path), number, obj, checked)


def check_valen(path: str | Path, check_media: bool = True, allow_absolute_media: bool = False) -> ValenCounts:
    """Counts of a valid file, or a FormatError: every rule of `iter_valen`, no records built.

    Memory stays flat however long the file is; the validate CLI uses this.
    """
    path = Path(path)
    source = str(path)
    problems = ProblemLog(source)
    media = MediaFiles(path.absolute().parent, check_media, allow_absolute_media)
    check = RecordCheck(source, media)
    records = questions = labeled = 0
    with _collector_paused():
        for number, obj in iter_jsonl_objects(path, source, problems):
            # The hot loop of `validate`: plain records skip RecordCheck (see valen_check).
            counts = plain_counts(obj, media)
            if counts is None:
                checked = check.explain(number, obj)
                if checked is None:
                    problems.extend(check.problems)
                    continue
                counts = checked.questions, checked.labeled
            records += 1
            questions += counts[0]
            labeled += counts[1]
    problems.raise_if_any()
    return ValenCounts(records, questions, labeled)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a file is checked.

    The duplicate-key hook of `jsonl.loads_strict` allocates a list and a tuple per JSON key; they
    die young by reference counting but trip a generation-0 collection every ~700 allocations,
    about 7% of validation time (benchmarks/validate.py). Parsed JSON holds no reference cycles, so
    nothing is freed later than it would be. Only for `check_valen`, which runs to completion: a
    generator would pause the collector for its consumer too.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _checked_lines(path: Path, check_media: bool, allow_absolute_media: bool) -> Iterator[tuple[int, dict, Checked]]:
    source = str(path)
    problems = ProblemLog(source)
    check = RecordCheck(source, MediaFiles(path.absolute().parent, check_media, allow_absolute_media))
    for number, obj in iter_jsonl_objects(path, source, problems):
        checked = check.check(number, obj)
        if checked is None:
            problems.extend(check.problems)
        else:
            yield number, obj, checked  # type: ignore[misc]  # a checked record is a dict
    problems.raise_if_any()


def _build(source: str, line: int, obj: dict, checked: Checked) -> ValenRecord:
    """The typed record of a line that passed every check (so no check is repeated here)."""
    questions = []
    for qid, spec in obj["request"]["questions"].items():
        kind = spec["type"]
        if kind == "choice":
            candidates = tuple(spec["criteria"].items())
        elif kind == "score":
            candidates = tuple(zip(GRADE_KEYS, spec["criteria"], strict=False))  # the first K keys
        else:
            candidates = NOUL_CANDIDATES
        questions.append(Question(qid, kind, spec["instructions"], candidates))
    targets = obj.get("targets") or {}
    labels = tuple(_label(question, targets.get(question.id)) for question in questions)
    return ValenRecord(
        source,
        line,
        obj["group_id"],
        checked.state,
        tuple(questions),
        labels,
        checked.assets,
        obj.get("meta", {}),
        checked.media,
    )


def _label(question: Question, target: dict | None) -> Label | None:
    if target is None or target.get("probabilities") is None:
        return None  # seed 000: a null or omitted target or probabilities is unlabeled
    given = target["probabilities"]
    values = [float(given[key]) for key, _ in question.candidates]
    # Seed 000: "One candidate at 1 and the rest at 0 is a hard label".
    hard = values.count(1.0) == 1 and values.count(0.0) == len(values) - 1
    extra = {key: value for key, value in target.items() if key != "probabilities"}
    return Label(dict(zip(question.keys, values, strict=True)), hard, extra)
