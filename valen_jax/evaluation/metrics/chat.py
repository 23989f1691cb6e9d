"""Chat and vakforge metrics: tool-call exact match and assistant-token loss/accuracy, as sums.

Tool calls (seed 003 `messages[].tool_calls`, seed 002 `turns[].tool_call`). A call is read from
either shape — `{"function": {"name", "arguments"}, …}` (OpenAI/chat) or `{"name", "arguments", …}`
(vakforge) — and `arguments` may be a JSON value or a string holding JSON (the OpenAI wire form).
Call ids are ignored: they are invented per conversation. Two calls are equal when their names are
equal and their arguments are equal as JSON values:
- objects compare as key → value mappings, so argument (key) order does not matter;
- arrays compare element by element, in order;
- numbers compare by value (1 == 1.0: JSON has one number type), but true ≠ 1 and "1" ≠ 1;
- strings compare exactly (no case or whitespace folding).
A predicted call that cannot be read (no name, arguments missing or not JSON) is `malformed` and
equals nothing; a reference call that cannot be read is an error.

For one assistant message with reference calls R and predicted calls C (`add_tool_calls`):
    exact   = [len(R) = len(C) and R_i = C_i for every i]      (calls of a message keep their order)
    matched = #{i < min(len R, len C) : R_i = C_i},  name_matched likewise on names only
Group metrics: `exact_match` = Σ exact / messages, `call_precision` = Σ matched / Σ len(C),
`call_recall` = Σ matched / Σ len(R).

Answers (`add_answer`, seed 003: "the grader compares the model's answer with the assistant
message"): each trained assistant message with text, against the text generated for it (rules in
`valen_jax.evaluation.metrics.answer_match`):
    answer_exact_match = Σ [generated = reference] / answers,
    answer_normalised_match = Σ [normalise(generated) = normalise(reference)] / answers,
    unfinished = answers whose generation reached max_new_tokens before the end-of-turn token.
A message that only calls tools has no text (seed 003 refuses an assistant message with both) and
is compared by its calls alone; it is not an answer here.

Assistant tokens (`add_tokens`), with the loss weights w_t of the assistant tokens:
    token_loss = Σ w_t · (−ln q_t(target_t)) / Σ w_t,  token_accuracy = Σ w_t · [argmax q_t = target_t] / Σ w_t,
    perplexity = exp(token_loss).
Groups: `overall`, `locale:<locale>` and `source:<meta.source>` (seed 002: eval always breaks down
by locale and by source); a record without one of them counts under `(missing)`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

from valen_jax.evaluation.metrics import GroupedSums, ratio
from valen_jax.evaluation.metrics.answer_match import answer_matches

BREAKDOWN_KEYS = ("locale", "source")

FIELDS = (
    "messages", "exact", "ref_calls", "pred_calls", "matched_calls", "name_matched", "malformed_calls",
    "tokens", "token_nll_sum", "token_correct", "answers", "answer_exact", "answer_normalised",
    "unfinished_answers",
)


class ToolCallError(ValueError):
    """A tool call that cannot be read as a name and JSON arguments."""


def canonical_json(value):
    """A hashable form of a JSON value whose equality is the JSON equality of the module docstring."""
    if isinstance(value, bool):  # before numbers: bool is an int subclass in Python
        return ("bool", value)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolCallError(f"{value} is not a JSON number")
        return ("number", value)
    if isinstance(value, str):
        return ("string", value)
    if value is None:
        return ("null",)
    if isinstance(value, Mapping):
        return ("object", tuple(sorted((str(k), canonical_json(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("array", tuple(canonical_json(v) for v in value))
    raise ToolCallError(f"{type(value).__name__} is not a JSON value")


def normalise_call(call) -> tuple[str, object]:
    """(name, canonical arguments) of one call in chat or vakforge shape."""
    if not isinstance(call, Mapping):
        raise ToolCallError(f"a tool call is a JSON object, got {type(call).__name__}")
    body = call.get("function", call)
    if not isinstance(body, Mapping):
        raise ToolCallError('"function" of a tool call must be an object')
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError('a tool call needs a non-empty string "name"')
    if "arguments" not in body:
        raise ToolCallError(f'tool call {name!r} has no "arguments"')
    args = body["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as err:
            raise ToolCallError(f"arguments of {name!r} are not JSON: {err}") from None
    return name, canonical_json(args)


def match_calls(reference: Sequence, predicted: Sequence) -> tuple[list, list, int, int, int, float]:
    """One message's reference and predicted calls compared position by position (the definition of
    tool-call exact match, which reinforcement's `tool_call` reward shares): (normalised references,
    normalised predictions with None for an unreadable call, malformed count, calls equal at their
    position, names equal at their position, exact: 1.0 when both lists are equal)."""
    refs = [normalise_call(c) for c in reference]
    preds, malformed = [], 0
    for call in predicted:
        try:
            preds.append(normalise_call(call))
        except ToolCallError:
            preds.append(None)  # keeps its position, equals nothing
            malformed += 1
    pairs = list(zip(refs, preds, strict=False))  # positions past the shorter list never match
    matched = sum(1 for r, p in pairs if p is not None and r == p)
    names = sum(1 for r, p in pairs if p is not None and r[0] == p[0])
    return refs, preds, malformed, matched, names, float(len(refs) == len(preds) and matched == len(refs))


class ChatStats(GroupedSums):
    FIELDS = FIELDS

    def add_tool_calls(
        self, reference: Sequence, predicted: Sequence, breakdown: Mapping[str, str] | None = None
    ) -> None:
        """One assistant message: its reference tool calls and the predicted ones (either may be empty)."""
        refs, preds, malformed, matched, names, exact = match_calls(reference, predicted)
        self._add(
            self._keys(breakdown), messages=1, exact=exact, ref_calls=len(refs), pred_calls=len(preds),
            matched_calls=matched, name_matched=names, malformed_calls=malformed,
        )

    def add_answer(self, reference: str, generated: str, finished: bool = True,
                   breakdown: Mapping[str, str] | None = None) -> None:
        """One assistant message with text: its reference text and the generated one; `finished`:
        generation stopped at the end-of-turn token (not at max_new_tokens)."""
        exact, normalised = answer_matches(reference, generated)
        self._add(self._keys(breakdown), answers=1, answer_exact=float(exact),
                  answer_normalised=float(normalised), unfinished_answers=float(not finished))

    def add_tokens(
        self, nll_sum: float, correct: float, weight: float, breakdown: Mapping[str, str] | None = None
    ) -> None:
        """Weighted sums over assistant tokens: Σ w·nll, Σ w·[argmax = target], Σ w."""
        values = (nll_sum, correct, weight)
        if not all(math.isfinite(float(v)) and float(v) >= 0 for v in values) or correct > weight + 1e-6:
            raise ValueError(f"token sums must be finite, non-negative, correct ≤ weight; got {values}")
        self._add(self._keys(breakdown), tokens=weight, token_nll_sum=nll_sum, token_correct=correct)

    @staticmethod
    def _keys(breakdown: Mapping[str, str] | None) -> list[str]:
        return GroupedSums._breakdown_keys(breakdown, BREAKDOWN_KEYS)

    def report(self) -> dict:
        """{"overall": metrics, "by_locale": {…}, "by_source": {…}}; formulas in the module docstring."""
        return self._grouped_report(BREAKDOWN_KEYS, _metrics)


def _metrics(s: dict[str, float]) -> dict:
    loss = ratio(s["token_nll_sum"], s["tokens"])
    return {
        "messages": int(s["messages"]),
        "exact_match": ratio(s["exact"], s["messages"]),
        "tool_calls": {
            "reference": int(s["ref_calls"]), "predicted": int(s["pred_calls"]),
            "matched": int(s["matched_calls"]), "name_matched": int(s["name_matched"]),
            "malformed": int(s["malformed_calls"]),
            "call_precision": ratio(s["matched_calls"], s["pred_calls"]),
            "call_recall": ratio(s["matched_calls"], s["ref_calls"]),
        },
        "answers": {
            "messages": int(s["answers"]), "exact": int(s["answer_exact"]),
            "normalised": int(s["answer_normalised"]), "unfinished": int(s["unfinished_answers"]),
            "exact_match": ratio(s["answer_exact"], s["answers"]),
            "normalised_match": ratio(s["answer_normalised"], s["answers"]),
        },
        "tokens": s["tokens"],
        "token_loss": loss,
        "token_accuracy": ratio(s["token_correct"], s["tokens"]),
        "perplexity": None if loss is None else math.exp(loss),
    }
