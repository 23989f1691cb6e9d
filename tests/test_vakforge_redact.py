"""PII redaction of vakforge records (data_pipeline.vakforge.redact) with real Presidio, offline.

Every record here is checked by the real validator afterwards (read_vakforge: the locale pack's
re-check of pii_redacted rows, entity offsets, tool schemas, the redaction log).
"""

import copy
import json
import logging
import re
import socket
from pathlib import Path

import pytest

from data_pipeline.formats.vakforge import read_vakforge
from data_pipeline.formats.vakforge_pii import PACKS
from data_pipeline.vakforge.redact import _analyzer, redact_record

SMOKE = Path(__file__).resolve().parents[1] / "data" / "smoke" / "vakforge"

# Every PII type of every pack, plus Presidio's extras (IBAN, IP address), as (type, value) per locale.
VALUES = {
    "en-US": [("phone", "(415) 555-0132"), ("ssn", "536-22-8197"), ("payment_card", "4111 1111 1111 1111"),
              ("email", "jane.roe@example.com"), ("iban", "GB82WEST12345698765432")],
    "en-GB": [("phone", "07700 900123"), ("national_insurance_number", "AB 12 34 56 C"),
              ("nhs_number", "943 476 5919"), ("email", "tom.hale@example.co.uk"), ("ip_address", "192.168.1.20")],
    "en-IN": [("phone", "98765 43210"), ("aadhaar", "2345 6789 0124"), ("pan", "ABCPE1234F"),
              ("email", "ravi.k@example.in"), ("payment_card", "5555 5555 5555 4444")],
    "hi-Latn-IN": [("phone", "+91 91234 56789"), ("aadhaar", "4991 1866 5246"), ("pan", "BNZPM2501F"),
                   ("email", "sunita@example.org")],
    "zh-CN": [("phone", "138 1234 5678"), ("resident_id", "11010519491231002X"), ("email", "wei.zhang@example.cn"),
              ("payment_card", "6011 1111 1111 1117")],
}
PRESIDIO_ONLY = {"iban", "ip_address"}  # the packs do not know these; Presidio's recognisers do
NAME = "Meera Iyer"  # found only through its person_name annotation: no NER runs offline
LANG = {"en-US": "en-US", "en-GB": "en-GB", "en-IN": "en-IN", "hi-Latn-IN": "en-IN", "zh-CN": "en"}


def _record(locale: str) -> dict:
    """A valid real conversation holding every value of `locale` in text, tool arguments and result."""
    values = VALUES[locale]
    said = "My details: " + ", ".join(f"{kind} {value}" for kind, value in values) + f". I am {NAME}."
    name_at = said.index(NAME)
    phone = values[0][1]
    turns = [
        {"speaker": "user", "start": 0.0, "end": 3.0, "text": said, "lang": LANG[locale],
         "entities": [
             {"type": "phone", "text": phone, "normalized": phone.replace(" ", ""),
              "start_char": said.index(phone), "end_char": said.index(phone) + len(phone)},
             {"type": "person_name", "text": NAME, "start_char": name_at, "end_char": name_at + len(NAME)},
             {"type": "order_id", "text": "NW-20417"},
         ]},
        {"speaker": "user", "start": 3.1, "end": 4.0, "text": f"Order NW-20417, again {phone}, thanks {NAME}.",
         "lang": LANG[locale],
         "entities": [{"type": "order_id", "text": "NW-20417", "start_char": 6, "end_char": 14},
                      {"type": "person_name", "text": NAME}]},
        {"speaker": "agent", "start": 4.1, "end": 4.1, "tool_call": {"id": "call_1", "name": "lookup", "arguments": {
            "order_id": "NW-20417", "phone": phone, "digits": int("".join(c for c in phone if c.isdigit())),
            "contacts": [{"name": NAME, "email": dict(values)["email"]}],
            "date": "2026-09-17"}}},
        {"speaker": "tool", "start": 4.1, "end": 4.1, "tool_result": {"id": "call_1", "content": {
            "status": "shipped", values[1][1]: "on file", "notes": [f"{kind}: {value}" for kind, value in values]}}},
        {"speaker": "agent", "start": 4.2, "end": 5.0, "text": "Thanks, it ships on September 20.", "lang": LANG[locale]},
    ]
    return {
        "id": f"conv_{locale.replace('-', '_').lower()}", "schema_version": "0.1", "locale": locale,
        "language": {"primary": LANG[locale], "mix": ["en"]},
        "system_prompt": f"You are support. Escalate to {values[0][1]} if needed.",
        "tools": [{"name": "lookup", "description": "Look up an order", "parameters": {"type": "object"}}],
        "turns": turns,
        "meta": {"source": "real", "consent": "written", "consent_ref": "policy-v3", "pii_redacted": True,
                 "redaction_log": f"redactions/conv_{locale.replace('-', '_').lower()}.json"},
    }


def _smoke_records() -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (SMOKE / "vakforge.jsonl").read_text().splitlines())}


def _smoke_unredacted() -> list[dict]:
    """The smoke set's two real records with the values their redaction logs name put back."""
    records = _smoke_records()
    hi, en = copy.deepcopy(records["conv_hi_0002"]), copy.deepcopy(records["conv_en_in_0005"])
    hi["turns"][1]["text"] = hi["turns"][1]["text"].replace("<PHONE_1>", "9876543210")
    hi["turns"][1]["entities"][0].update(start_char=46, end_char=53)  # the phone is 1 char longer
    en["turns"][0]["text"] = en["turns"][0]["text"].replace("<EMAIL_1>", "asha.rao@example.in")
    en["turns"][3]["tool_call"]["arguments"]["email"] = "asha.rao@example.in"
    return [hi, en]


@pytest.fixture(scope="module")
def redacted():
    """(original, redacted, spans) of every locale's record and the smoke set's real records."""
    out = []
    for record in [_record(locale) for locale in VALUES] + _smoke_unredacted():
        before = copy.deepcopy(record)
        new, spans = redact_record(record, record["locale"])
        assert record == before  # the input is not mutated
        out.append((record, new, spans))
    return out


def test_the_validator_accepts_every_redacted_record(redacted, tmp_path):
    (tmp_path / "redactions").mkdir()
    lines, ids = [], []
    for _, new, spans in redacted:
        log = {"conversation_id": new["id"], "spans": spans}
        (tmp_path / new["meta"]["redaction_log"]).write_text(json.dumps(log))
        new = copy.deepcopy(new)
        new.pop("audio", None)  # media are not what this test checks
        new["meta"].pop("voice_consent_ref", None)
        new["meta"].pop("split", None)
        lines.append(json.dumps(new, ensure_ascii=False))
        ids.append(new["id"])
    (tmp_path / "vakforge.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "splits.json").write_text(json.dumps({"seed": 1, "splits": {"train": ids}}))
    assert len(read_vakforge(tmp_path / "vakforge.jsonl", check_media=False)) == len(redacted)


def test_before_redaction_the_validator_finds_every_pack_value(redacted):
    for record, _, _ in redacted[: len(VALUES)]:
        found = {f.type for f in PACKS[record["locale"]].find_pii(record["turns"][0]["text"])}
        assert found == {kind for kind, _ in VALUES[record["locale"]] if kind not in PRESIDIO_ONLY}


def test_no_value_survives_in_the_record_or_the_spans(redacted):
    for record, new, spans in redacted[: len(VALUES)]:
        dump = json.dumps([new, spans], ensure_ascii=False)
        for kind, value in VALUES[record["locale"]] + [("person_name", NAME)]:
            assert value not in dump, (record["locale"], kind)
            assert value.replace(" ", "") not in dump, (record["locale"], kind)
        assert all(set(span) == {"turn", "field", "type", "start", "end", "placeholder"} for span in spans)


def test_every_type_gets_its_placeholder_and_the_same_value_the_same_one(redacted):
    for record, new, _ in redacted[: len(VALUES)]:
        locale = record["locale"]
        text = new["turns"][0]["text"]
        for kind, _ in VALUES[locale]:
            assert f"{kind} <{kind.upper()}_1>" in text, (locale, kind)
        assert text.endswith("I am <PERSON_NAME_1>.")
        # The phone first appears in the system prompt: <PHONE_1> there, in both turns and in the tools.
        assert new["system_prompt"].endswith("Escalate to <PHONE_1> if needed.")
        assert new["turns"][1]["text"] == "Order NW-20417, again <PHONE_1>, thanks <PERSON_NAME_1>."
        arguments = new["turns"][2]["tool_call"]["arguments"]
        assert list(arguments) == ["order_id", "phone", "digits", "contacts", "date"]  # order kept
        assert arguments["order_id"] == "NW-20417" and arguments["date"] == "2026-09-17"  # business data kept
        assert arguments["phone"] == "<PHONE_1>"
        assert arguments["digits"] == "<PHONE_1>"  # a number holding a phone becomes the placeholder string
        assert arguments["contacts"][0]["name"] == "<PERSON_NAME_1>"
        assert arguments["contacts"][0]["email"] == "<EMAIL_1>"
        content = new["turns"][3]["tool_result"]["content"]
        second = VALUES[locale][1][0].upper()
        assert list(content) == ["status", f"<{second}_1>", "notes"]  # a key holding PII, renamed in place
        assert content["notes"] == [f"{kind}: <{kind.upper()}_1>" for kind, _ in VALUES[locale]]


def test_spans_name_the_original_range_turn_and_field(redacted):
    for record, _, spans in redacted[: len(VALUES)]:
        for span in spans:
            if span["turn"] is None:
                assert span["field"] == "system_prompt"
                original = record["system_prompt"]
            else:
                turn = record["turns"][span["turn"]]
                original = _field_text(turn, span["field"])
            value = original[span["start"] : span["end"]]
            kinds = {v: k for k, v in VALUES[record["locale"]]} | {NAME: "person_name"}
            # the `digits` argument is the phone as a JSON number: no separators, no leading zero
            digits = {"".join(c for c in v if c.isdigit()).lstrip("0"): k for k, v in VALUES[record["locale"]]}
            assert kinds.get(value, digits.get(value)) == span["type"], span
        fields = {(s["turn"], s["field"]) for s in spans}
        assert (2, "tool_call.arguments.contacts[0].email") in fields
        assert (3, "tool_result.content{key 1}") in fields
        assert (1, "entities[1].text") in fields  # the name annotated without offsets


def _field_text(turn: dict, field: str) -> str:
    """The original text a span's field path names: `text`, `entities[1].text`, `tool_call.arguments.a[0].b`,
    `tool_result.content{key 1}` (the key itself)."""
    value = turn
    for name, index, key in re.findall(r"\.(\w+)|\[(\d+)\]|\{key (\d+)\}", "." + field):
        if key:
            return list(value)[int(key)]
        value = value[int(index)] if index else value[name]
    return value if isinstance(value, str) else repr(value)


def test_entity_offsets_move_and_a_pii_entity_becomes_its_placeholder(redacted):
    for _, new, _ in redacted:
        for turn in new["turns"]:
            for entity in turn.get("entities") or []:
                if entity.get("start_char") is not None:
                    assert turn["text"][entity["start_char"] : entity["end_char"]] == entity["text"]
    first = redacted[0][1]["turns"][0]["entities"]
    assert first[0] == {"type": "phone", "text": "<PHONE_1>", "normalized": "<PHONE_1>",
                        "start_char": first[0]["start_char"], "end_char": first[0]["start_char"] + 9}
    assert first[1]["text"] == "<PERSON_NAME_1>"
    assert first[2] == {"type": "order_id", "text": "NW-20417"}
    assert redacted[0][1]["turns"][1]["entities"][1] == {"type": "person_name", "text": "<PERSON_NAME_1>"}


def test_smoke_records_redact_to_the_logs_the_smoke_set_ships(redacted):
    smoke = _smoke_records()
    for _, new, spans in redacted[len(VALUES):]:
        shipped = json.loads((SMOKE / smoke[new["id"]]["meta"]["redaction_log"]).read_text())
        assert spans == [{k: v for k, v in span.items() if k != "audio"} for span in shipped["spans"]]
        assert new == smoke[new["id"]]  # text, entity offsets and tool JSON exactly as shipped


def test_smoke_set_has_no_false_positive_and_redacting_twice_changes_nothing(redacted):
    for record in _smoke_records().values():  # order ids, customer ids, OTPs, dates, amounts stay
        assert redact_record(record, record["locale"]) == (record, [])
    for _, new, _ in redacted:
        assert redact_record(new, new["locale"]) == (new, [])


def test_numbering_continues_after_placeholders_already_there(redacted):
    record = copy.deepcopy(redacted[-1][1])  # holds <EMAIL_1>
    record["turns"][1]["text"] = "Haan, doosra email mira@example.in hai."
    new, spans = redact_record(record, record["locale"])
    assert new["turns"][1]["text"] == "Haan, doosra email <EMAIL_2> hai."
    assert spans == [{"turn": 1, "field": "text", "type": "email", "start": 19, "end": 34, "placeholder": "<EMAIL_2>"}]


def test_nothing_is_logged_with_a_value(caplog):
    caplog.set_level(logging.DEBUG)
    redact_record(_record("en-IN"), "en-IN")
    for _, value in VALUES["en-IN"]:
        assert value not in caplog.text


def test_unknown_locale():
    with pytest.raises(ValueError, match="not a registered locale pack"):
        redact_record(_record("en-US"), "fr-FR")


def test_chinese_names_are_found_inside_unspaced_text():
    record = _record("zh-CN")
    record["turns"][4]["text"] = "好的，王伟先生，快递明天到。"
    record["turns"][4]["entities"] = [{"type": "person_name", "text": "王伟", "start_char": 3, "end_char": 5}]
    record["system_prompt"] = "客户王伟的快递。"
    new, _ = redact_record(record, "zh-CN")
    # The system prompt comes first in record order, so the name is <PERSON_NAME_1> everywhere.
    assert new["system_prompt"] == "客户<PERSON_NAME_1>的快递。"
    assert new["turns"][4]["text"] == "好的，<PERSON_NAME_1>先生，快递明天到。"
    assert new["turns"][4]["entities"][0] == {"type": "person_name", "text": "<PERSON_NAME_1>",
                                              "start_char": 3, "end_char": 18}
    assert new["turns"][0]["text"].endswith("I am <PERSON_NAME_2>.")


def test_a_latin_name_is_redacted_as_a_whole_word_only():
    record = _record("en-IN")
    record["turns"][4]["text"] = "Ravindra and Ravi both called."
    record["turns"][4]["entities"] = [{"type": "person_name", "text": "Ravi", "start_char": 13, "end_char": 17}]
    new, _ = redact_record(record, "en-IN")
    assert new["turns"][4]["text"] == "Ravindra and <PERSON_NAME_2> both called."


def test_building_and_running_the_analyzer_opens_no_connection(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("redaction tried to open a network connection")

    # Name lookup comes first (and fails quietly offline), so refuse it too, not only connections.
    for name in ("getaddrinfo", "gethostbyname", "create_connection"):
        monkeypatch.setattr(socket, name, refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    _analyzer.cache_clear()  # a fresh Presidio engine and tldextract: nothing may be fetched
    new, _ = redact_record(_record("en-GB"), "en-GB")
    assert "tom.hale@example.co.uk" not in json.dumps(new)


def test_an_entity_around_a_redaction_keeps_its_words_and_takes_the_placeholder():
    text = "Note: call 98765 43210 after six, order NW-20417."
    record = {"id": "c", "locale": "en-IN", "turns": [{"speaker": "user", "text": text, "entities": [
        {"type": "instruction", "text": "call 98765 43210 after six", "normalized": {"phone": "9876543210"},
         "start_char": 6, "end_char": 32},
        {"type": "order_id", "text": "NW-20417", "start_char": 40, "end_char": 48},
    ]}]}
    new, spans = redact_record(record, "en-IN")
    turn = new["turns"][0]
    assert turn["text"] == "Note: call <PHONE_1> after six, order NW-20417."
    assert turn["entities"] == [
        {"type": "instruction", "text": "call <PHONE_1> after six", "normalized": "call <PHONE_1> after six",
         "start_char": 6, "end_char": 30},
        {"type": "order_id", "text": "NW-20417", "start_char": 38, "end_char": 46},
    ]
    assert spans == [{"turn": 0, "field": "text", "type": "phone", "start": 11, "end": 22, "placeholder": "<PHONE_1>"}]
