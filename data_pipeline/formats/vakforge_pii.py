"""Locale packs of vakforge manifests: declared languages and PII detectors (seed 002, "locale").

A locale pack governs, for the conversations that name it, which `turns[].lang` values exist and
which personal data `vakforge validate` still recognises in text that claims `pii_redacted: true`
("a flag is a claim and the text is the evidence", seed 002, "Provenance claims…").

A finding carries its type and character range only. Nothing here returns or formats the matched
text, so no caller can print it into a terminal or a CI log by accident.

Detectors work on Python code points and match any Unicode decimal digit (Devanagari, full-width),
because transcripts of Hinglish or Chinese speech write numbers in those scripts too. Numbers with
a checksum (cards, Aadhaar, NHS numbers, Chinese resident ids) must pass it, to keep order ids and
amounts from being flagged.

Decisions where the seed leaves room:
- Every pack finds e-mail addresses and payment card numbers; the national ones are
  en-US: phone (NANP), ssn; en-GB: phone, national_insurance_number, nhs_number;
  en-IN and hi-Latn-IN: phone, aadhaar, pan; zh-CN: phone (mobile), resident_id.
- Declared languages include the code-switching partners the seed names (Hinglish, Spanglish,
  Chinese–English), so a code-switched turn is labelled with its own language.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class PiiFinding:
    """Personal data still present: `type` at text[start:end]. Never holds the text itself."""

    start: int
    end: int
    type: str


@dataclass(frozen=True)
class _Pattern:
    type: str
    regex: re.Pattern[str]
    valid: Callable[[str], bool] = lambda _: True


@dataclass(frozen=True)
class _NumberRule:
    """A type of number recognised from its digits alone, whatever separators the text used."""

    type: str
    valid: Callable[[str], bool]


@dataclass(frozen=True)
class LocalePack:
    locale: str
    langs: frozenset[str]
    patterns: tuple[_Pattern, ...]
    numbers: tuple[_NumberRule, ...]

    def find_pii(self, text: str) -> list[PiiFinding]:
        """Every recognised piece of personal data in `text`, in order, without overlaps."""
        found: list[PiiFinding] = []
        for pattern in self.patterns:
            for m in pattern.regex.finditer(text):
                if pattern.valid(m.group()):
                    found.append(PiiFinding(m.start(), m.end(), pattern.type))
        for start, end, kind in _number_findings(text, self.numbers):
            found.append(PiiFinding(start, end, kind))
        kept: list[PiiFinding] = []
        for finding in sorted(found):
            if not kept or finding.start >= kept[-1].end:
                kept.append(finding)
        return kept


def _digits(text: str) -> str:
    # int() reads any Unicode decimal digit, so "९८७" and "９８７" become "987".
    return "".join(str(int(c)) for c in text if c.isdecimal())


# A run of digit groups joined by single separators, e.g. "+91 98765-43210" or "(555) 123 4567".
# Letters or digits next to it end the run, so "SC-4471" or "A1234567" are not numbers here.
_NUMBER_GROUP = re.compile(r"\+?\(?\d+\)?")
_NUMBER_RUN = re.compile(r"(?<![\dA-Za-z+])\+?\(?\d+\)?(?:[ .\-]\(?\d+\)?|\(\d+\))*(?![\dA-Za-z])")
_MAX_GROUPS = 12
# No rule recognises fewer or more digits than this (phones have 7+, cards at most 19).
_MIN_DIGITS, _MAX_DIGITS = 7, 19


def _number_findings(text: str, rules: tuple[_NumberRule, ...]) -> list[tuple[int, int, str]]:
    """Spans of digit-group windows that a rule recognises, longest window first from the left.

    Windows matter because separators also join unrelated numbers ("17-09-2026 98765 43210").
    """
    found = []
    for run in _NUMBER_RUN.finditer(text):
        groups = [(m.start() + run.start(), m.end() + run.start()) for m in _NUMBER_GROUP.finditer(run.group())]
        digits = [_digits(text[start:end]) for start, end in groups]
        i = 0
        while i < len(groups):
            for j in range(min(len(groups), i + _MAX_GROUPS) - 1, i - 1, -1):
                window = "".join(digits[i : j + 1])
                if len(window) > _MAX_DIGITS:
                    continue
                if len(window) < _MIN_DIGITS:
                    break  # shorter windows have fewer digits still
                kind = next((r.type for r in rules if r.valid(window)), None)
                if kind is not None:
                    found.append((groups[i][0], groups[j][1], kind))
                    i = j
                    break
            i += 1
    return found


def _luhn(digits: str) -> bool:
    total = 0
    for k, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if k % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


_VERHOEFF_D = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 6, 7, 8, 9, 5], [2, 3, 4, 0, 1, 7, 8, 9, 5, 6],
    [3, 4, 0, 1, 2, 8, 9, 5, 6, 7], [4, 0, 1, 2, 3, 9, 5, 6, 7, 8], [5, 9, 8, 7, 6, 0, 4, 3, 2, 1],
    [6, 5, 9, 8, 7, 1, 0, 4, 3, 2], [7, 6, 5, 9, 8, 2, 1, 0, 4, 3], [8, 7, 6, 5, 9, 3, 2, 1, 0, 4],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
]
_VERHOEFF_P = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 5, 7, 6, 2, 8, 3, 0, 9, 4], [5, 8, 0, 3, 7, 9, 6, 1, 4, 2],
    [8, 9, 1, 6, 0, 4, 3, 5, 2, 7], [9, 4, 5, 3, 1, 2, 6, 8, 7, 0], [4, 2, 8, 6, 5, 7, 3, 9, 0, 1],
    [2, 7, 9, 3, 8, 0, 6, 4, 1, 5], [7, 0, 4, 6, 9, 1, 3, 2, 5, 8],
]


def _verhoeff(digits: str) -> bool:
    c = 0
    for k, ch in enumerate(reversed(digits)):
        c = _VERHOEFF_D[c][_VERHOEFF_P[k % 8][int(ch)]]
    return c == 0


def _aadhaar(digits: str) -> bool:
    # UIDAI: 12 digits, never starting with 0 or 1, Verhoeff check digit last.
    return len(digits) == 12 and digits[0] not in "01" and _verhoeff(digits)


def _nhs_number(digits: str) -> bool:
    # NHS: 10 digits, weights 10..2 over the first nine, check = 11 - sum mod 11 (10 is invalid).
    if len(digits) != 10:
        return False
    check = 11 - sum(int(d) * w for d, w in zip(digits[:9], range(10, 1, -1), strict=True)) % 11
    return (0 if check == 11 else check) == int(digits[9]) and check != 10


def _cn_resident_id(text: str) -> bool:
    # GB 11643-1999: ISO 7064 MOD 11-2 over the first 17 digits; check value 10 is written X.
    body = _digits(text[:17])
    weights = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
    check = (12 - sum(int(d) * w for d, w in zip(body, weights, strict=True)) % 11) % 11
    return text[17].upper() == ("X" if check == 10 else str(check))


def _ssn(text: str) -> bool:
    area, group, serial = _digits(text[:3]), _digits(text[4:6]), _digits(text[7:])
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def _card(digits: str) -> bool:
    return 13 <= len(digits) <= 19 and _luhn(digits)


def _phone_us(digits: str) -> bool:
    return re.fullmatch(r"(?:1)?[2-9]\d\d[2-9]\d{6}", digits) is not None


def _phone_gb(digits: str) -> bool:
    # +44 / 0044 / 0 prefix; mobiles 07…, geographic 01…/02…, non-geographic 03….
    return re.fullmatch(r"(?:0044|44|0)(?:7\d{9}|[123]\d{8,9})", digits) is not None


def _phone_in(digits: str) -> bool:
    # Mobiles start 6–9 (10 digits, optional +91/0 prefix); landlines are 0 + STD code + number.
    return re.fullmatch(r"(?:0091|91|0)?[6-9]\d{9}|0[1-9]\d{9}", digits) is not None


def _phone_cn(digits: str) -> bool:
    return re.fullmatch(r"(?:0086|86)?1[3-9]\d{9}", digits) is not None


# Starts only where a local part starts, and possessive: linear time on long runs of letters or digits.
_EMAIL = _Pattern(
    "email",
    re.compile(r"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9._%+\-]++@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}"),
)
_CARD = _NumberRule("payment_card", _card)
_SSN = _Pattern("ssn", re.compile(r"(?<![\dA-Za-z])\d{3}[- ]\d{2}[- ]\d{4}(?![\dA-Za-z])"), _ssn)
_NINO = _Pattern(
    "national_insurance_number",
    re.compile(
        r"(?<![A-Za-z0-9])(?!BG|GB|NK|KN|TN|NT|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]"
        r" ?\d{2} ?\d{2} ?\d{2} ?[A-D](?![A-Za-z0-9])",
        re.IGNORECASE,
    ),
)
# PAN: five letters (fourth is the holder type), four digits, a letter.
_PAN = _Pattern("pan", re.compile(r"(?<![A-Za-z0-9])[A-Z]{3}[ABCFGHJLPT][A-Z]\d{4}[A-Z](?![A-Za-z0-9])"))
_CN_ID = _Pattern("resident_id", re.compile(r"(?<![\dA-Za-z])\d{17}[\dXx](?![\dA-Za-z])"), _cn_resident_id)

_EN = frozenset({"en"})
PACKS: dict[str, LocalePack] = {
    pack.locale: pack
    for pack in (
        LocalePack(
            "en-US", _EN | {"en-US", "es", "es-US"}, (_EMAIL, _SSN),
            (_NumberRule("phone", _phone_us), _CARD),
        ),
        LocalePack(
            "en-GB", _EN | {"en-GB"}, (_EMAIL, _NINO),
            (_NumberRule("phone", _phone_gb), _NumberRule("nhs_number", _nhs_number), _CARD),
        ),
        LocalePack(
            "en-IN", _EN | {"en-IN", "hi", "hi-Latn"}, (_EMAIL, _PAN),
            (_NumberRule("phone", _phone_in), _NumberRule("aadhaar", _aadhaar), _CARD),
        ),
        LocalePack(
            "hi-Latn-IN", _EN | {"en-IN", "hi", "hi-Latn"}, (_EMAIL, _PAN),
            (_NumberRule("phone", _phone_in), _NumberRule("aadhaar", _aadhaar), _CARD),
        ),
        LocalePack(
            "zh-CN", _EN | {"zh", "zh-CN", "zh-Hans", "zh-Hans-CN"}, (_EMAIL, _CN_ID),
            (_NumberRule("phone", _phone_cn), _CARD),
        ),
    )
}
