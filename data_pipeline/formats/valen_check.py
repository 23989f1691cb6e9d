"""The rules of one Valen record (seed 000, "Records and questions", "Labels and missing values").

`RecordCheck.check` finds every problem of a parsed JSONL line and builds nothing but the state
and media; `valen.py` builds the typed record from a line that passed.

Two paths: `plain_counts` is a fast path that accepts only plainly valid records (text state, no
assets), building no message; everything else goes to `RecordCheck.explain`, which holds every
rule and says what is wrong. The fast path accepts a strict subset of what the explaining
path accepts (tests/test_fuzz_readers.py checks this on mutated records), so correctness never
depends on it; it exists because validating a file must keep pace with `json.loads` of it
(benchmarks/validate.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

# Question types and noul keys (seed 000) are part of the shard encoding: declared once there.
from data_pipeline.examples import NOUL_KEYS, QUESTION_TYPES
from data_pipeline.formats import valen_state
from data_pipeline.formats.errors import RECORD_FIELD, LineProblems, describe, member, quote
from data_pipeline.formats.valen_state import Asset, MediaFiles, ResolvedMedia, StateMessages, is_text

RECORD_KEYS = ("group_id", "request", "targets", "assets", "meta")
CHOICE_CANDIDATES = (1, 255)  # seed 000 "Records and questions": "Mapping of 1–255 candidate names"
SCORE_GRADES = (2, 10)  # seed 000: "List of 2–10 non-empty grade descriptions"
GRADE_KEYS = tuple(str(k) for k in range(SCORE_GRADES[1]))  # score label keys "0" … "K-1"
SUM_ABS_TOL = 1e-6  # seed 000 "Labels and missing values": "abs_tol=1e-6"

_RECORD_KEYS = frozenset(RECORD_KEYS)
_REQUEST_KEYS = frozenset({"state", "questions"})
_QUESTION_KEYS = frozenset({"type", "instructions", "criteria"})
_NUMBER_TYPES = frozenset({int, float})  # bool is neither: `true` is not a probability
_SHOWN_IDS = 20  # longest list of ids or keys quoted in one message
_EMPTY_OBJECT: dict = {}
_NO_ASSETS: list = []
_NOUL_KEYSET = frozenset(NOUL_KEYS)
_GRADE_KEYSETS = [frozenset(GRADE_KEYS[:k]) for k in range(SCORE_GRADES[1] + 1)]


class Checked(NamedTuple):
    """What checking a record found besides its problems."""

    state: str | StateMessages
    assets: tuple[Asset, ...]
    media: tuple[ResolvedMedia, ...]
    questions: int
    labeled: int


class RecordCheck(LineProblems):
    """Checks the records of one file; `problems` holds those of the last checked line."""

    def __init__(self, source: str, media: MediaFiles):
        super().__init__(source, 0)
        self.media_files = media

    def check(self, line: int, obj: object) -> Checked | None:
        """Checked facts of a valid record; None, with `problems` filled, otherwise."""
        counts = plain_counts(obj, self.media_files)
        if counts is not None and type(obj["request"]["state"]) is str and not obj.get("assets"):  # type: ignore[index]
            self.line, self.problems = line, []
            return Checked(obj["request"]["state"], (), (), *counts)  # type: ignore[index]
        return self.explain(line, obj)  # also for plain records with media: it builds their objects

    def explain(self, line: int, obj: object) -> Checked | None:
        """`check` without the fast path: every rule, every problem with its message."""
        self.line, self.problems = line, []
        if type(obj) is not dict:
            self.problem(RECORD_FIELD, f"a record must be a JSON object, got {describe(obj)}")
            return None
        if not obj.keys() <= _RECORD_KEYS:
            for key in sorted(obj.keys() - _RECORD_KEYS):
                self.problem(member("", key), f"unknown key; a Valen record has {', '.join(RECORD_KEYS)}")
        group_id = obj.get("group_id")
        if type(group_id) is not str or not group_id or group_id.isspace():
            self.group_id(obj)
        request = obj.get("request")
        state, refs, keys = None, [], None
        if type(request) is not dict:
            self.problem("request", f"required: an object with state and questions, got {describe(request)}")
        else:
            if not request.keys() <= _REQUEST_KEYS:
                for key in sorted(request.keys() - _REQUEST_KEYS):
                    self.problem(member("request", key), "unknown key; a request has state and questions")
            if "state" not in request:
                self.problem("request.state", 'required: a text string or {"messages": [...]}')
            else:
                state = request["state"]
                if type(state) is not str:
                    state = valen_state.read_state(self, state, refs)
            keys = self.questions(request.get("questions"))
        labeled = self.targets(obj["targets"], keys) if "targets" in obj else 0
        assets = obj.get("assets")
        assets = valen_state.read_assets(self, obj, self.media_files) if assets != [] else ()
        meta = obj.get("meta")
        if type(meta) is not dict and "meta" in obj:
            hint = "; omit it or use {}" if meta is None else ""
            self.problem("meta", f"must be an object, got {describe(meta)}{hint}")
        media = valen_state.resolve_media(self, refs, assets, self.media_files) if refs else ()
        if self.problems or keys is None or state is None:
            return None
        return Checked(state, assets, media, len(keys), labeled)

    def group_id(self, obj: dict) -> None:
        # Seed 000: "Required, non-empty group identifier, preferably a string".
        if "group_id" not in obj:
            self.problem("group_id", "required: a non-empty group identifier, preferably a string")
            return
        value = obj["group_id"]
        if (
            value is None
            or (isinstance(value, (str, list, dict)) and not value)
            or (isinstance(value, str) and value.isspace())
        ):
            self.problem(
                "group_id", f"must be a non-empty identifier, preferably a string; got {describe(value)}"
            )

    # -- questions -------------------------------------------------------------------------------

    def questions(self, questions: object) -> dict[str, tuple[str, ...] | None] | None:
        """The label keys of each question (None for a question with problems); None for no mapping."""
        if type(questions) is not dict or not questions:
            self.problem(
                "request.questions",
                f"required: a non-empty mapping of question id → question, got {describe(questions)}",
            )
            return None
        return {qid: self.question(qid, spec) for qid, spec in questions.items()}

    def question(self, qid: str, spec: object) -> tuple[str, ...] | None:
        field = member("request.questions", qid)
        before = len(self.problems)
        if not is_text(qid):
            self.problem(field, "a question id must be a non-empty string")
        if type(spec) is not dict:
            self.problem(
                field, f"a question is an object with type, instructions, criteria; got {describe(spec)}"
            )
            return None
        for key in sorted(spec.keys() - _QUESTION_KEYS):
            self.problem(member(field, key), "unknown key; a question has type, instructions and criteria")
        instructions = spec.get("instructions")
        if not is_text(instructions):
            self.problem(
                f"{field}.instructions", f"required: a non-empty string, got {describe(instructions)}"
            )
        kind = spec.get("type")
        if kind == "choice":
            keys = self.choice(field, spec.get("criteria"))
        elif kind == "score":
            keys = self.score(field, spec.get("criteria"))
        elif kind == "noul":
            keys = NOUL_KEYS  # seed 000: criteria, if provided, is not used
        else:
            hint = ""
            if isinstance(kind, str) and kind.lower() in QUESTION_TYPES:
                hint = f"; types are lowercase: {quote(kind.lower())}"
            self.problem(f"{field}.type", f"must be one of choice, noul, score; got {describe(kind)}{hint}")
            keys = None
        return keys if len(self.problems) == before else None

    def choice(self, field: str, criteria: object) -> tuple[str, ...] | None:
        low, high = CHOICE_CANDIDATES
        if type(criteria) is not dict or not low <= len(criteria) <= high:
            # An object of the wrong size here is empty (described as such) or has over 255 entries.
            size = f" with {len(criteria)} entries" if type(criteria) is dict and criteria else ""
            self.problem(
                f"{field}.criteria",
                f"a choice question needs an object of {low} to {high} candidate names → descriptions; "
                f"got {describe(criteria)}{size}",
            )
            return None
        for name, text in criteria.items():
            if not is_text(name):
                self.problem(member(f"{field}.criteria", name), "a candidate name must be a non-empty string")
            if not is_text(text):
                self.problem(
                    member(f"{field}.criteria", name),
                    f"must be a non-empty description, got {describe(text)}",
                )
        return tuple(criteria)

    def score(self, field: str, criteria: object) -> tuple[str, ...] | None:
        low, high = SCORE_GRADES
        if type(criteria) is not list or not low <= len(criteria) <= high:
            count = len(criteria) if type(criteria) is list else 0
            size = f" with {count} item{'s' if count > 1 else ''}" if count else ""
            self.problem(
                f"{field}.criteria",
                f"a score question needs a list of {low} to {high} grade descriptions; got {describe(criteria)}{size}",
            )
            return None
        for k, text in enumerate(criteria):
            if not is_text(text):
                self.problem(
                    f"{field}.criteria[{k}]", f"must be a non-empty grade description, got {describe(text)}"
                )
        return GRADE_KEYS[: len(criteria)]

    # -- targets ---------------------------------------------------------------------------------

    def targets(self, targets: object, keys: dict[str, tuple[str, ...] | None] | None) -> int:
        """The number of labeled questions."""
        if type(targets) is not dict:
            if targets is None:  # seed 000: "do not set the whole targets to null"
                self.problem(
                    "targets", "null is not allowed; omit targets or use {} when a record has no labels"
                )
            else:
                self.problem("targets", f"must be a mapping of question id → label, got {describe(targets)}")
            return 0
        return sum(self.target(qid, target, keys) for qid, target in targets.items())

    def target(self, qid: str, target: object, keys: dict | None) -> bool:
        """Whether the target labels its question."""
        field = member("targets", qid)
        if keys is not None and qid not in keys:
            known = ", ".join(list(keys)[:_SHOWN_IDS]) + (", …" if len(keys) > _SHOWN_IDS else "")
            self.problem(field, f"unknown question id; the questions are {known}")
            return False
        if target is None:
            return False  # seed 000: a null target marks the question unlabeled
        if type(target) is not dict:
            self.problem(
                field, f'must be an object {{"probabilities": {{…}}}} or null, got {describe(target)}'
            )
            return False
        probabilities = target.get("probabilities")
        question_keys = keys.get(qid) if keys is not None else None
        if probabilities is None:
            return False  # seed 000: omitted or null probabilities mark the question unlabeled
        if question_keys is None:
            return False  # the question has its own problem, so its label keys are unknown
        return self.label(f"{field}.probabilities", question_keys, probabilities)

    def label(self, field: str, keys: tuple[str, ...], probabilities: object) -> bool:
        if type(probabilities) is not dict:
            self.problem(
                field,
                f"must be an object of candidate key → probability, or null; got {describe(probabilities)}",
            )
            return False
        if len(probabilities) != len(keys) or not all(key in probabilities for key in keys):
            self.coverage(field, keys, probabilities)
            return False
        before = len(self.problems)
        for key in keys:
            value = probabilities[key]
            if type(value) not in _NUMBER_TYPES:
                self.problem(member(field, key), f"must be a number, got {describe(value)}")
                continue
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an int too large for a float
                finite = False
            if not finite:
                self.problem(member(field, key), f"must be a finite number, got {describe(value)}")
            elif value < 0:
                self.problem(member(field, key), f"must be >= 0, got {describe(value)}")
        if len(self.problems) > before:
            return False
        total = math.fsum(probabilities.values())
        if not math.isclose(total, 1.0, abs_tol=SUM_ABS_TOL):
            self.problem(field, f"sums to {total!r}; probabilities must sum to 1 (abs_tol=1e-6)")
            return False
        return True

    def coverage(self, field: str, keys: tuple[str, ...], probabilities: dict) -> None:
        if keys == NOUL_KEYS:
            wanted = 'label keys are "true" and "false"'
        elif keys == GRADE_KEYS[: len(keys)]:
            wanted = f'score label keys are "0" to "{len(keys) - 1}"'
        else:
            wanted = f"candidates are {', '.join(keys[:_SHOWN_IDS])}" + (
                ", …" if len(keys) > _SHOWN_IDS else ""
            )
        for key in probabilities:
            if key not in keys:
                self.problem(member(field, key), f"not a candidate of this question; {wanted}")
        missing = [key for key in keys if key not in probabilities]
        if missing:
            shown = ", ".join(quote(key) for key in missing[:_SHOWN_IDS]) + (
                ", …" if len(missing) > _SHOWN_IDS else ""
            )
            self.problem(field, f"missing {shown}; probabilities must cover every candidate ({wanted})")


def plain_counts(obj: object, files: MediaFiles) -> tuple[int, int] | None:
    """(questions, labeled) of a record that plainly passes every rule; None for anything else,
    which the explaining path then decides."""
    if type(obj) is not dict or not obj.keys() <= _RECORD_KEYS:
        return None
    group_id, request = obj.get("group_id"), obj.get("request")
    if type(group_id) is not str or not group_id or group_id.isspace():
        return None
    if type(request) is not dict or not request.keys() <= _REQUEST_KEYS:
        return None
    questions = request.get("questions")
    if type(questions) is not dict or not questions:
        return None
    keys_of: dict[str, object] = {}  # question id -> its label keys as a set-like (dict keys or frozenset)
    # Loops stay inline: for a handful of items they beat map/all and any helper call.
    for qid, spec in questions.items():
        if not qid or qid.isspace() or type(spec) is not dict or not spec.keys() <= _QUESTION_KEYS:
            return None
        instructions = spec.get("instructions")
        if type(instructions) is not str or not instructions or instructions.isspace():
            return None
        kind = spec.get("type")
        if kind == "noul":
            keys_of[qid] = _NOUL_KEYSET
            continue
        criteria = spec.get("criteria")
        if kind == "choice":
            if type(criteria) is not dict or not 0 < len(criteria) <= CHOICE_CANDIDATES[1]:
                return None
            for name, text in criteria.items():
                if not name or name.isspace() or type(text) is not str or not text or text.isspace():
                    return None
            keys_of[qid] = criteria.keys()
        elif kind == "score":
            if type(criteria) is not list or not SCORE_GRADES[0] <= len(criteria) <= SCORE_GRADES[1]:
                return None
            for text in criteria:
                if type(text) is not str or not text or text.isspace():
                    return None
            keys_of[qid] = _GRADE_KEYSETS[len(criteria)]
        else:
            return None
    labeled = 0
    targets = obj.get("targets", _EMPTY_OBJECT)
    if type(targets) is not dict:
        return None
    for qid, target in targets.items():
        keys = keys_of.get(qid)
        if keys is None:
            return None
        if target is None:
            continue
        if type(target) is not dict:
            return None
        probabilities = target.get("probabilities")
        if probabilities is None:
            continue
        if type(probabilities) is not dict or probabilities.keys() != keys:  # set equality, in C
            return None
        values = probabilities.values()
        if not _NUMBER_TYPES.issuperset(map(type, values)):
            return None
        try:
            total = math.fsum(values)
        except (OverflowError, ValueError):  # a huge int; inf + -inf
            return None
        # The same test as math.isclose(total, 1, abs_tol=1e-6) near 1, without a call; a NaN or
        # infinite total fails it, so each value is finite once the total passes.
        if not -SUM_ABS_TOL <= total - 1.0 <= SUM_ABS_TOL or min(values) < 0:
            return None
        labeled += 1
    if type(obj.get("meta", _EMPTY_OBJECT)) is not dict:
        return None
    state, assets = request.get("state"), obj.get("assets", _NO_ASSETS)
    if (type(state) is not str or assets != _NO_ASSETS) and not valen_state.plain_media(state, assets, files):
        return None
    return len(keys_of), labeled
