"""Comparing a generated assistant answer with the reference assistant message (seed 003: "During an
evaluation, the grader compares the model's answer with the assistant message").

Two comparisons, both of whole messages:
- exact: the generated text (end-of-turn token removed) equals the reference text character for
  character;
- normalised: the two are equal after `normalise_answer`, which is, in this order,
  1. Unicode NFKC (full-width digits and letters, ligatures and compatibility forms fold to their
     plain forms, so "１２９０" equals "1290");
  2. case folding (`str.casefold`: "Straße" equals "STRASSE");
  3. every run of whitespace becomes one space;
  4. leading and trailing whitespace and punctuation (Unicode categories P* — `.`, `!`, `"`, `¿`,
     `「`, … — and whitespace) are stripped, repeatedly, so "It is 2C." equals "it is 2c" and
     "«Yes!»" equals "yes". Punctuation inside the text is kept ("2,167" ≠ "2167").
The seeds define no answer normalisation; this is the usual loose form of exact match (SQuAD-style,
without dropping articles, which is English-only).
"""

from __future__ import annotations

import re
import unicodedata

_SPACE = re.compile(r"\s+")


def _is_edge(char: str) -> bool:
    return char.isspace() or unicodedata.category(char).startswith("P")


def normalise_answer(text: str) -> str:
    """The normalised form of the module docstring."""
    text = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())
    text = _SPACE.sub(" ", text)
    start, stop = 0, len(text)
    while start < stop and _is_edge(text[start]):
        start += 1
    while stop > start and _is_edge(text[stop - 1]):
        stop -= 1
    return text[start:stop]


def answer_matches(reference: str, generated: str) -> tuple[bool, bool]:
    """(exact, normalised) match of one generated answer with its reference."""
    return reference == generated, normalise_answer(reference) == normalise_answer(generated)
