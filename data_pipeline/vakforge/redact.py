"""PII redaction of one vakforge conversation (seed 002, "Provenance claims must carry their evidence").

    new_record, spans = redact_record(record, "hi-Latn-IN")

Where personal data is looked for: `system_prompt`, every `turns[].text`, and every string, number and
non-identifier key of `tool_call.arguments` and `tool_result.content` — the texts `vakforge validate`
re-checks — plus the `text` of entities. Three finders, their hits merged (overlaps joined):

- the locale pack (`vakforge_pii`): the validator's own detectors, so the re-check passes by
  construction, and it is asserted after redaction (`RedactionError` otherwise);
- Presidio's pattern and phonenumbers recognisers (maintained; checksums for cards, IBAN, Aadhaar,
  NHS), every locale's national ones for every record, since a US SSN in an Indian call is still
  personal data. No NER: Presidio's spaCy models are downloads, so its NLP engine is a blank spaCy
  pipeline (tokens only), and tldextract reads its bundled suffix list, never the network;
- the record's own annotations: every `turns[].entities` value of a personal type (`PII_ENTITY_TYPES`)
  is redacted wherever it occurs in the record. This is how names and addresses are found without NER.

Decisions where the seed leaves room:
- Placeholders are `<TYPE_N>`, numbered per type in record order (system prompt, then turns; in a
  turn: text, entities, tool call, tool result). The same value gets the same placeholder everywhere
  in the record (phones compared as E.164, other numbers by digits, the rest case-folded). Numbering
  starts after any placeholder the record already holds, and a redacted record yields no hit, so
  redacting twice changes nothing.
- customer_id, order_id, amounts and dates are business data, not personal data: seed 002's own
  redacted record keeps `customer ID SC-4471`.
- An entity whose range overlaps a redaction becomes the redacted slice: its `text` is the
  placeholder (offsets moved, `text[start_char:end_char] == text` still holds) and a `normalized`
  value is replaced by that text too, since it would carry the value in another spelling.
- A number in tool JSON that holds personal data becomes its placeholder string (a string where the
  tool schema may want a number: the value cannot stay).
- Spans (the seed's redaction_log format, without `audio`) give the ORIGINAL range in the field's
  text, `turn` (null for system_prompt) and `field`: `text`, `system_prompt`, `entities[k].text`, or
  the JSON path (`tool_call.arguments.email`, `tool_result.content[0].phone`, `…{key 2}` for a key).
  Only `field == "text"` spans are spoken, so only those have audio to tone.
- Nothing here logs, and no message repeats a value: type, field and range only.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from data_pipeline.formats.vakforge_pii import PACKS, LocalePack

# Entity types (seed 002, "turns[].entities") whose value is personal data; the rest are business keys.
PII_ENTITY_TYPES = frozenset({"phone", "email", "person_name", "address"})

# Presidio entity -> the pack's type name (the validator's vocabulary, so one value has one name).
PRESIDIO_TYPES = {
    "PHONE_NUMBER": "phone",
    "EMAIL_ADDRESS": "email",
    "CREDIT_CARD": "payment_card",
    "IBAN_CODE": "iban",
    "IP_ADDRESS": "ip_address",
    "US_SSN": "ssn",
    "UK_NHS": "nhs_number",
    "UK_NINO": "national_insurance_number",
    "IN_PAN": "pan",
    "IN_AADHAAR": "aadhaar",
}
# Presidio's pattern scores: validated checksums score 1.0, phonenumbers matches 0.4, strong patterns
# 0.5; the "weak" patterns (any 9 digits as an SSN, 0.05; any 4-4-4 digits as an Aadhaar, 0.01) stay out.
SCORE_THRESHOLD = 0.4
# phonenumbers reads national formats for these regions; international (+CC) ones for any region.
PHONE_REGIONS = ("US", "GB", "IN", "CN")
_LOCALE_REGION = {"en-US": "US", "en-GB": "GB", "en-IN": "IN", "hi-Latn-IN": "IN", "zh-CN": "CN"}

# Same as the validator's (vakforge_provenance): keys it does not scan are not redacted either.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLACEHOLDER = re.compile(r"<([A-Z][A-Z0-9_]*)_(\d+)>")


class RedactionError(ValueError):
    """Redaction could not make the record clean; the message names field, type and range, never a value."""


@dataclass(frozen=True, order=True)
class _Hit:
    start: int
    end: int
    type: str


def redact_record(record: dict, locale: str) -> tuple[dict, list[dict]]:
    """(redacted copy of `record`, redaction_log spans); `record` is not mutated."""
    pack = PACKS.get(locale)
    if pack is None:
        raise ValueError(f"locale {locale[:40]!r} is not a registered locale pack; registered: {', '.join(PACKS)}")
    out = copy.deepcopy(record)
    redactor = _Redactor(pack, _annotated_values(record), _Placeholders(record, locale))
    if isinstance(out.get("system_prompt"), str):
        out["system_prompt"] = redactor.text(out["system_prompt"], None, "system_prompt")[0]
    for i, turn in enumerate(out.get("turns") or []):
        if isinstance(turn.get("text"), str):
            turn["text"], moves = redactor.text(turn["text"], i, "text")
            for entity in turn.get("entities") or []:
                _move_entity(entity, moves, turn["text"])
        for k, entity in enumerate(turn.get("entities") or []):
            if entity.get("start_char") is None and isinstance(entity.get("text"), str):
                new = redactor.text(entity["text"], i, f"entities[{k}].text")[0]
                if new != entity["text"]:
                    entity["text"] = new
                    if "normalized" in entity:
                        entity["normalized"] = new
        if isinstance(turn.get("tool_call"), dict) and "arguments" in turn["tool_call"]:
            turn["tool_call"]["arguments"] = redactor.json(turn["tool_call"]["arguments"], i, "tool_call.arguments")
        if isinstance(turn.get("tool_result"), dict) and "content" in turn["tool_result"]:
            turn["tool_result"]["content"] = redactor.json(turn["tool_result"]["content"], i, "tool_result.content")
    return out, redactor.spans


# (original start, original end, new start, new end) of each replacement in one text, in order.
_Moves = list[tuple[int, int, int, int]]


class _Redactor:
    def __init__(self, pack: LocalePack, annotated: list[tuple[str, str]], placeholders: _Placeholders):
        self.pack = pack
        self.annotated = annotated
        self.placeholders = placeholders
        self.spans: list[dict] = []

    def text(self, text: str, turn: int | None, field: str) -> tuple[str, _Moves]:
        pieces, moves, last, shift = [], [], 0, 0
        for hit in _merge(self._hits(text)):
            placeholder = self.placeholders.of(hit.type, text[hit.start : hit.end])
            self.spans.append({"turn": turn, "field": field, "type": hit.type, "start": hit.start,
                               "end": hit.end, "placeholder": placeholder})
            pieces += [text[last : hit.start], placeholder]
            moves.append((hit.start, hit.end, hit.start + shift, hit.start + shift + len(placeholder)))
            shift += len(placeholder) - (hit.end - hit.start)
            last = hit.end
        new = "".join(pieces) + text[last:]
        for left in self.pack.find_pii(new):
            where = "system_prompt" if turn is None else f"turns[{turn}].{field}"
            raise RedactionError(f"{where}: the {self.pack.locale} pack still finds {left.type} at chars "
                                 f"[{left.start}:{left.end}] after redaction")
        return new, moves

    def json(self, value, turn: int, field: str):
        """A copy of a JSON value with every scanned text redacted; key order kept."""
        if isinstance(value, dict):
            out = {}
            for n, (key, item) in enumerate(value.items()):
                if _IDENTIFIER.fullmatch(key):
                    new_key, path = key, f"{field}.{key}"
                else:
                    path = f"{field}{{key {n}}}"
                    new_key = self.text(key, turn, path)[0]
                if new_key in out:
                    raise RedactionError(f"turns[{turn}].{path}: two keys redact to the same placeholder")
                out[new_key] = self.json(item, turn, path)
            return out
        if isinstance(value, list):
            return [self.json(item, turn, f"{field}[{k}]") for k, item in enumerate(value)]
        if isinstance(value, str):
            return self.text(value, turn, field)[0]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            new = self.text(repr(value), turn, field)[0]  # repr: the text the validator checks
            return value if new == repr(value) else new
        return value

    def _hits(self, text: str) -> list[tuple[_Hit, int]]:
        """Every finder's hits with its rank (lower wins a tie on the same range)."""
        hits = [(_Hit(f.start, f.end, f.type), 1) for f in self.pack.find_pii(text)]
        for result in _analyzer().analyze(text, language="en", score_threshold=SCORE_THRESHOLD):
            if result.entity_type in PRESIDIO_TYPES:
                hits.append((_Hit(result.start, result.end, PRESIDIO_TYPES[result.entity_type]), 2))
        for value, kind in self.annotated:
            for m in _occurrences(value).finditer(text):
                hits.append((_Hit(m.start(), m.end(), kind), 0))
        return hits


@cache
def _occurrences(value: str) -> re.Pattern[str]:
    """Where an annotated value occurs as a whole: a Latin letter or digit at its edge must not touch
    another ("Ravi" is not in "Ravindra"); Chinese is written without spaces, so a Han edge may."""
    before = r"(?<![A-Za-z0-9])" if value[0].isascii() and value[0].isalnum() else ""
    after = r"(?![A-Za-z0-9])" if value[-1].isascii() and value[-1].isalnum() else ""
    return re.compile(before + re.escape(value) + after)


def _merge(hits: list[tuple[_Hit, int]]) -> list[_Hit]:
    """Overlapping hits joined into one (the earliest, longest, best-ranked hit names the type)."""
    kept: list[_Hit] = []
    for hit, _ in sorted(hits, key=lambda h: (h[0].start, -h[0].end, h[1])):
        if kept and hit.start < kept[-1].end:
            if hit.end > kept[-1].end:
                kept[-1] = _Hit(kept[-1].start, hit.end, kept[-1].type)
        else:
            kept.append(hit)
    return kept


def _move_entity(entity: dict, moves: _Moves, new_text: str) -> None:
    """Shift an entity's offsets past the replacements; one overlapping a replacement takes its slice."""
    start, end = entity.get("start_char"), entity.get("end_char")
    if start is None or end is None:
        return
    new_start, new_end, touched = start, end, False
    for old_start, old_end, placed_start, placed_end in moves:
        delta = (placed_end - placed_start) - (old_end - old_start)
        if old_end <= start:
            new_start += delta
            new_end += delta
        elif old_start < end:  # overlaps the entity: it now covers the whole placeholder
            touched = True
            if old_start < start:
                new_start = placed_start
            if old_end > end:
                new_end = placed_end
            else:
                new_end += delta
    entity["start_char"], entity["end_char"] = new_start, new_end
    if touched:
        entity["text"] = new_text[new_start:new_end]
        if "normalized" in entity:
            entity["normalized"] = entity["text"]


def _annotated_values(record: dict) -> list[tuple[str, str]]:
    """(value, type) of every entity of a personal type in the record, longest first."""
    found = {}
    for turn in record.get("turns") or []:
        for entity in turn.get("entities") or []:
            text = entity.get("text")
            if entity.get("type") in PII_ENTITY_TYPES and isinstance(text, str) and text.strip():
                if not _PLACEHOLDER.fullmatch(text):
                    found.setdefault(text, entity["type"])
    return sorted(found.items(), key=lambda item: -len(item[0]))


class _Placeholders:
    """`<TYPE_N>` per value: one number per type and distinct value, after those the record holds."""

    def __init__(self, record: dict, locale: str):
        self.key = _value_key(_LOCALE_REGION[locale])
        self.by_value: dict[str, str] = {}
        self.counts: dict[str, int] = {}
        for m in _PLACEHOLDER.finditer(repr(record)):
            self.counts[m.group(1)] = max(self.counts.get(m.group(1), 0), int(m.group(2)))

    def of(self, kind: str, value: str) -> str:
        key = self.key(kind, value)
        if key not in self.by_value:
            name = re.sub(r"[^A-Z0-9]+", "_", kind.upper())
            self.counts[name] = self.counts.get(name, 0) + 1
            self.by_value[key] = f"<{name}_{self.counts[name]}>"
        return self.by_value[key]


def _value_key(region: str) -> Callable[[str, str], str]:
    phonenumbers = _import("phonenumbers")

    def key(kind: str, value: str) -> str:
        if kind == "phone":
            try:
                number = phonenumbers.parse(value, region)
                return "phone:" + phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
            except phonenumbers.NumberParseException:
                pass
        digits = "".join(str(int(c)) for c in value if c.isdecimal())
        if len(digits) >= 7 and not any(c.isalpha() for c in value):
            return "digits:" + digits
        return "text:" + " ".join(value.casefold().split())

    return key


def _import(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(f"PII redaction needs {name}: pip install 'valen-jax[vakforge]'") from err


@cache
def _analyzer():
    """Presidio's AnalyzerEngine with recognisers that need no download, built once per process."""
    spacy = _import("spacy")
    tldextract = _import("tldextract")
    _import("presidio_analyzer")
    from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
    from presidio_analyzer.nlp_engine import SpacyNlpEngine
    from presidio_analyzer.predefined_recognizers import (
        CreditCardRecognizer,
        EmailRecognizer,
        IbanRecognizer,
        InAadhaarRecognizer,
        InPanRecognizer,
        IpRecognizer,
        NhsRecognizer,
        PhoneRecognizer,
        UkNinoRecognizer,
        UsSsnRecognizer,
    )

    # The bundled public-suffix snapshot only: no suffix list URL, no cache written to $HOME.
    offline_tld = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)

    class OfflineEmailRecognizer(EmailRecognizer):
        def validate_result(self, pattern_text: str) -> bool:
            return offline_tld(pattern_text).fqdn != ""

    # A blank spaCy pipeline is a tokenizer only: Presidio's engine wants one, the named models are
    # downloads (en_core_web_lg), and the pattern recognisers need tokens at most.
    nlp_engine = SpacyNlpEngine(models=[{"lang_code": "en", "model_name": "blank:en"}])
    nlp_engine.nlp = {"en": spacy.blank("en")}
    recognizers = [
        OfflineEmailRecognizer(), PhoneRecognizer(supported_regions=PHONE_REGIONS), CreditCardRecognizer(),
        IbanRecognizer(), IpRecognizer(), UsSsnRecognizer(), NhsRecognizer(), UkNinoRecognizer(),
        InPanRecognizer(), InAadhaarRecognizer(),
    ]
    registry = RecognizerRegistry(recognizers=recognizers, supported_languages=["en"])
    return AnalyzerEngine(registry=registry, nlp_engine=nlp_engine, supported_languages=["en"])
