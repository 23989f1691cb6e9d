"""Entity accuracy of generated agent turns (seed 002, "turns[].entities": "Entity accuracy is one of
the headline eval metrics"), as all-reducible sums.

What is scored: every entity of a trained agent message (`turns[].entities` of the agent's spoken
turns; user-turn entities are the prompt, not an answer). The message is generated from the
conversation before it, and the entity is *correct* when the generated message — its text, or the
arguments of the tool calls it makes — contains it by one of these rules (any one suffices):

- surface: the entity's `text` occurs in the generated text or in a string argument, compared after
  Unicode NFKC and case folding, and not as part of a longer word or number: where the entity
  begins or ends with a letter or digit, the neighbouring character must not be one ("₹500" is not
  found in "₹5000", "NW-20417" not in "NW-204171");
- normalised value (`normalized`, when the record gives one): a number is found when a number of
  the generated text or a numeric argument has the same value ("four thousand five hundred and
  twelve" is not read; "04512", "4,512" and 4512.0 are); a string is found like `text` (e.g. the
  ISO date "2026-09-20" in a call's arguments);
- by type, as the locale packs write these values differently from the reference:
  - `amount*` (amount_inr, amount_usd, …): the amount as a number — `normalized`, or the one number
    its text holds — equals a number of the generated message ("₹500" ≙ "Rs. 500" ≙ "500.00");
  - `phone`: digits only ("+91 98765-43210" ≙ "9876543210"): the reference digits equal the digits
    of a number run of the generated message (groups joined by one space, `-`, `.` or parentheses,
    the locale packs' phone shape), or one is the other behind a country code of up to 3 digits;
  - `*_id` (customer_id, order_id, …): letters and digits in order, any one of `- _ . /` or a space
    allowed between them ("SC-4471" ≙ "sc 4471" ≙ "SC4471"), with the boundary rule above.
Numbers are read from text as digit groups (any Unicode decimal digits: Devanagari and full-width
too) with `,` grouping thousands (lakh grouping "1,00,000" included) and `.` before decimals.

Sums per group: `entities` (scored) and `correct`; `accuracy = correct / entities`. Groups:
`overall`, `type:<entity type>`, `locale:<locale>`, `source:<meta.source>` (seed 002: eval always
breaks down by locale and by source), `(missing)` where a record lacks one.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from valen_jax.evaluation.metrics import MISSING, GroupedSums, ratio

BREAKDOWN_KEYS = ("type", "locale", "source")
_ALNUM_BEFORE, _ALNUM_AFTER = r"(?<![^\W_])", r"(?![^\W_])"
_NUMBER = re.compile(r"(?<![\d.,])\d+(?:,\d+)*(?:\.\d+)?")
# The number runs of seed 002's locale packs (data_pipeline.formats.vakforge_pii): "+91 98765-43210".
_NUMBER_RUN = re.compile(r"\+?\(?\d+\)?(?:[ .\-]\(?\d+\)?|\(\d+\))*")
_ID_SEPARATOR = r"[-_./ ]?"
_COUNTRY_CODE_DIGITS, _PHONE_MIN_DIGITS = 3, 7


def fold(text: str) -> str:
    """NFKC and case folding (NFKC again: folding can leave compatibility forms)."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())


def _digits(text: str) -> str:
    return "".join(str(int(c)) for c in text if c.isdecimal())  # int() reads any decimal digit


def numbers_in(text: str) -> list[float]:
    """The numbers written in `text` (module docstring: `,` groups, `.` decimals)."""
    out = []
    for m in _NUMBER.finditer(text):
        whole, _, decimals = m.group().replace(",", "").partition(".")
        value = _digits(whole) + ("." + _digits(decimals) if decimals else "")
        out.append(float(value))
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Generated:
    """What one generated message offers: its text and its calls' arguments, folded."""

    texts: tuple[str, ...]  # the message text, then every string argument value
    numbers: frozenset[float]  # in the texts, and every numeric argument value
    digit_runs: frozenset[str]  # digits of each number run in the texts

    @classmethod
    def of(cls, text: str, calls: Sequence = ()) -> Generated:
        """`text`: the generated message as decoded; `calls`: its parsed tool calls (dicts, or the raw
        text of a call that did not parse, which is searched as text)."""
        strings, numbers = [text], []
        for call in calls:
            if isinstance(call, Mapping):
                body = call.get("function", call)
                args = body.get("arguments") if isinstance(body, Mapping) else None
                if isinstance(args, str):  # the OpenAI wire form: JSON inside a string
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                _leaves(args, strings, numbers)
            else:
                strings.append(str(call))
        texts = tuple(fold(s) for s in strings)
        for t in texts:
            numbers.extend(numbers_in(t))
        runs = frozenset(d for t in texts for m in _NUMBER_RUN.finditer(t) if (d := _digits(m.group())))
        return cls(texts, frozenset(float(n) for n in numbers), runs)


def _leaves(value, strings: list[str], numbers: list[float]) -> None:
    if isinstance(value, str):
        strings.append(value)
    elif _is_number(value):
        numbers.append(float(value))
    elif isinstance(value, Mapping):
        for v in value.values():
            _leaves(v, strings, numbers)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _leaves(v, strings, numbers)


def _bounded(pattern: str, first: str, last: str) -> re.Pattern[str]:
    before = _ALNUM_BEFORE if first.isalnum() else ""
    after = _ALNUM_AFTER if last.isalnum() else ""
    return re.compile(before + pattern + after)


def _occurs(text: str, generated: Generated) -> bool:
    text = fold(text).strip()
    if not text:
        return False
    pattern = _bounded(re.escape(text), text[0], text[-1])
    return any(pattern.search(t) for t in generated.texts)


def _identifier_occurs(text: str, generated: Generated) -> bool:
    chars = [c for c in fold(text) if c.isalnum()]
    if not chars:
        return False
    pattern = _bounded(_ID_SEPARATOR.join(map(re.escape, chars)), chars[0], chars[-1])
    return any(pattern.search(t) for t in generated.texts)


def _phone_occurs(reference: str, generated: Generated) -> bool:
    ref = _digits(fold(reference))
    if len(ref) < _PHONE_MIN_DIGITS:
        return ref in generated.digit_runs
    for run in generated.digit_runs:
        short, long = sorted((ref, run), key=len)
        if long.endswith(short) and len(short) >= _PHONE_MIN_DIGITS and len(long) - len(short) <= _COUNTRY_CODE_DIGITS:
            return True
    return False


def entity_found(entity: Mapping, generated: Generated) -> bool:
    """Whether the generated message holds the reference entity (rules in the module docstring)."""
    kind, text, normalized = entity["type"], entity["text"], entity.get("normalized")
    if _occurs(text, generated):
        return True
    if _is_number(normalized) and float(normalized) in generated.numbers:
        return True
    if isinstance(normalized, str) and _occurs(normalized, generated):
        return True
    if kind.startswith("amount"):
        if _is_number(normalized):
            amount = float(normalized)
        else:
            found = numbers_in(fold(text))
            amount = found[0] if len(found) == 1 else None
        return amount is not None and amount in generated.numbers
    if kind == "phone":
        return _phone_occurs(normalized if isinstance(normalized, str) else text, generated)
    if kind.endswith("_id"):
        return _identifier_occurs(text, generated) or (
            isinstance(normalized, str) and _identifier_occurs(normalized, generated))
    return False


class EntityStats(GroupedSums):
    FIELDS = ("entities", "correct")

    def add_message(self, entities: Iterable[Mapping], generated: Generated,
                    breakdown: Mapping[str, str | None] | None = None) -> None:
        """The reference entities of one agent message against what was generated for it."""
        for entity in entities:
            found = entity_found(entity, generated)
            self._add(self._keys(entity["type"], breakdown), entities=1, correct=float(found))

    @staticmethod
    def _keys(kind: str, breakdown: Mapping[str, str | None] | None) -> list[str]:
        # The type comes from the entity itself; a caller breaks down by locale and source only.
        keys = GroupedSums._breakdown_keys(breakdown, BREAKDOWN_KEYS[1:])
        return [keys[0], f"type:{kind or MISSING}", *keys[1:]]

    def report(self) -> dict:
        """{"overall": {entities, correct, accuracy}, "by_type": {…}, "by_locale": {…}, "by_source": {…}}."""
        return self._grouped_report(BREAKDOWN_KEYS, _metrics)


def _metrics(s: Mapping[str, float]) -> dict:
    return {"entities": int(s["entities"]), "correct": int(s["correct"]),
            "accuracy": ratio(s["correct"], s["entities"])}
