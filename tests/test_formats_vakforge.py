"""vakforge manifests (seed 002): each validation and provenance rule with a passing and a failing case.

`base()` is a conversation that passes every rule (real, redacted, dual-channel audio, tools, an
entity with offsets, an overlapping turn); each test changes one thing and names the problems it
expects by (line, field), so an unexpected extra problem fails the test too.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from jsonschema import Draft202012Validator

from data_pipeline.formats.errors import FormatError, Problem
from data_pipeline.formats.vakforge import (
    VakforgeConversation,
    export_schema,
    manifest_hash,
    read_vakforge,
)
from data_pipeline.formats.vakforge_pii import PACKS
from data_pipeline.formats.vakforge_schema import json_schema

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "data" / "smoke" / "vakforge"
BAD = Path(__file__).resolve().parent / "bad_inputs" / "vakforge"

CHECK_STATUS = {
    "name": "check_status",
    "description": "Look up an installation",
    "parameters": {"type": "object", "properties": {"customer_id": {"type": "string"}}, "required": ["customer_id"]},
}
BOOK = {
    "name": "book_appointment",
    "parameters": {
        "type": "object",
        "properties": {
            "customer_id": {"type": "string"},
            "date": {"type": "string", "format": "date"},
            "slot": {"type": "string", "enum": ["morning", "afternoon"]},
        },
        "required": ["customer_id", "date", "slot"],
    },
}


def spoken(speaker, start, end, text, lang="hi-Latn", **extra):
    return {"speaker": speaker, "start": start, "end": end, "text": text, "lang": lang, **extra}


def call(at, cid="call_1", name="check_status", arguments=None):
    args = {"customer_id": "SC-4471"} if arguments is None else arguments
    return {"speaker": "agent", "start": at, "end": at, "tool_call": {"id": cid, "name": name, "arguments": args}}


def result(at, cid="call_1", content=None):
    return {"speaker": "tool", "start": at, "end": at, "tool_result": {"id": cid, "content": content or {"status": "ok"}}}


def base(cid: str = "c1") -> dict:
    text = "Customer ID SC-4471 hai."
    return {
        "id": cid,
        "schema_version": "0.1",
        "audio": {
            "path": f"audio/{cid}.wav",
            "sample_rate": 8000,
            "channels": 2,
            "channel_map": {"0": "user", "1": "agent"},
            "duration_s": 2.0,
            "condition": "phone",
        },
        "locale": "hi-Latn-IN",
        "language": {"primary": "hi-Latn", "mix": ["hi", "en"]},
        "domain": "field_service_support",
        "scenario": "check_ticket",
        "system_prompt": "You are Priya from SunCare Solar support.",
        "tools": [copy.deepcopy(CHECK_STATUS), copy.deepcopy(BOOK)],
        "turns": [
            spoken("agent", 0.0, 0.5, "Namaste, kaise madad karoon?"),
            spoken("user", 0.6, 1.0, text, entities=[{"type": "customer_id", "text": "SC-4471", "start_char": 12, "end_char": 19}]),
            call(1.0),
            result(1.0),
            spoken("agent", 1.1, 1.6, "Sab theek hai."),
            spoken("user", 1.5, 1.9, "Thanks a lot.", "en", overlap=True),
        ],
        "meta": {
            "source": "real",
            "consent": "recorded_verbal",
            "consent_ref": "policy-v3",
            "voice_consent_ref": "voice-v1",
            "license": "proprietary-internal",
            "pii_redacted": True,
            "redaction_log": f"redactions/{cid}.json",
            "speakers": {"agent": f"agent_{cid}", "user": f"user_{cid}"},
            "split": "train",
        },
    }


def write_wav(path: Path, rate: int = 8000, channels: int = 2, seconds: float = 2.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = round(rate * seconds)
    tone = (1000 * np.sin(np.arange(n) * 0.05)).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.repeat(tone, channels).tobytes())
    return path


def write(folder: Path, *convs: dict | str, splits: object = "auto", media: bool = True) -> Path:
    """A dataset folder: manifest, splits.json, and the audio and redaction logs the records name."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [c if isinstance(c, str) else json.dumps(c, ensure_ascii=False) for c in convs]
    (folder / "vakforge.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    records = [c for c in convs if isinstance(c, dict)]
    for conv in records:
        audio, log = conv.get("audio"), conv.get("meta", {}).get("redaction_log")
        if media and isinstance(audio, dict) and not (folder / audio["path"]).exists() and ".." not in audio["path"]:
            write_wav(folder / audio["path"], audio["sample_rate"], audio["channels"], audio["duration_s"])
        if isinstance(log, str) and ".." not in log and not (folder / log).exists():
            (folder / log).parent.mkdir(parents=True, exist_ok=True)
            (folder / log).write_text(json.dumps({"conversation_id": conv["id"], "spans": []}))
    if splits == "auto":
        splits = {"seed": 7, "splits": {}}
        for conv in records:
            splits["splits"].setdefault(conv["meta"].get("split", "train"), []).append(conv["id"])
    if splits is not None:
        text = splits if isinstance(splits, str) else json.dumps(splits, indent=1)
        (folder / "splits.json").write_text(text, encoding="utf-8")
    return folder / "vakforge.jsonl"


def problems_of(path: Path, **kwargs) -> list[Problem]:
    with pytest.raises(FormatError) as info:
        read_vakforge(path, **kwargs)
    return list(info.value.problems)


def fields_of(path: Path, **kwargs) -> list[tuple[int, str]]:
    return [(p.line, p.field) for p in problems_of(path, **kwargs)]


def only(path: Path, field: str, **kwargs) -> Problem:
    """The single problem of a one-record manifest, which must be at `field` of conversation c1."""
    problems = problems_of(path, **kwargs)
    assert [(p.line, p.field) for p in problems] == [(1, f"id=c1: {field}")], [str(p) for p in problems]
    return problems[0]


@pytest.fixture
def ds(tmp_path):
    """write() into tmp_path."""
    return lambda *convs, **kw: write(tmp_path, *convs, **kw)


# --------------------------------------------------------------------------- whole files


def test_base_record_and_smoke_data_pass(ds):
    [conv] = read_vakforge(ds(base()))
    assert isinstance(conv, VakforgeConversation) and conv.turns[2].tool_call.name == "check_status"
    smoke = read_vakforge(SMOKE / "vakforge.jsonl")
    assert {c.locale for c in smoke} == {"en-US", "en-GB", "en-IN", "hi-Latn-IN", "zh-CN"}
    assert {c.meta.source for c in smoke} == {"real", "synthetic", "public"}


def test_smoke_data_is_regenerated_byte_identical_and_small(tmp_path):
    spec = importlib.util.spec_from_file_location("make_vakforge_smoke", REPO / "data" / "make_vakforge_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path / "v")])
    ours = {p.relative_to(tmp_path / "v"): p.read_bytes() for p in (tmp_path / "v").rglob("*") if p.is_file()}
    committed = {p.relative_to(SMOKE): p.read_bytes() for p in SMOKE.rglob("*") if p.is_file()}
    assert ours == committed
    assert sum(len(b) for b in committed.values()) < 300_000


def test_missing_and_empty_manifest(tmp_path):
    assert [str(p) for p in problems_of(tmp_path / "absent.jsonl")] == [f"{tmp_path / 'absent.jsonl'}:0: file: no such file"]
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert [p.field for p in problems_of(tmp_path / "empty.jsonl")] == ["file"]


def test_problem_line_format(ds):
    conv = base()
    conv["turns"][2]["end"] = 1.5
    problem = only(ds(conv), "turns[2].end")
    assert str(problem) == (
        f"{problem.path}:1: id=c1: turns[2].end: a tool call turn has zero duration; set end = start (1.0)"
    )


def test_all_problems_of_the_file_are_collected_in_line_order(ds):
    a, b = base("a"), base("b")
    a["turns"][0]["lang"] = None
    b["meta"]["consent_ref"] = None
    fields = fields_of(ds("not json", a, b))
    assert fields == [(1, "record"), (2, "id=a: turns[0].lang"), (3, "id=b: meta.consent_ref")]


def test_problems_shown_are_capped(ds):
    problems = problems_of(ds(*["[]"] * 1005))
    assert len(problems) == 1001 and problems[-1].message == "… 5 more problems not shown"


def test_splits_path_can_be_given(ds, tmp_path):
    path = ds(base(), splits=None)
    (tmp_path / "elsewhere.json").write_text(json.dumps({"seed": 1, "splits": {"train": ["c1"]}}))
    assert len(read_vakforge(path, splits_path=tmp_path / "elsewhere.json")) == 1


# --------------------------------------------------------------------------- schema


def test_schema_unknown_missing_and_strict_types(ds):
    conv = base()
    conv["colour"] = "blue"
    del conv["meta"]["source"]
    conv["audio"]["sample_rate"] = "8000"
    conv["audio"]["channels"] = 2.0
    problems = problems_of(ds(conv, media=False), check_media=False)
    got = {p.field: p.message for p in problems}
    assert set(got) == {"id=c1: colour", "id=c1: meta.source", "id=c1: audio.sample_rate", "id=c1: audio.channels"}
    assert got["id=c1: colour"].startswith("unknown key; allowed here: id, schema_version, audio")
    assert got["id=c1: meta.source"] == "required"


def test_schema_version_turns_and_enums(ds):
    conv = base()
    conv["schema_version"] = "0.2"
    conv["turns"][0]["speaker"] = "robot"
    conv["meta"]["consent"] = "verbal"
    assert {f for _, f in fields_of(ds(conv))} == {
        "id=c1: schema_version", "id=c1: turns[0].speaker", "id=c1: meta.consent",
    }


def test_invalid_id_is_reported_as_question_mark(ds):
    conv = base()
    conv["id"] = "conv 1: x"
    problems = problems_of(ds(conv, splits={"seed": 1, "splits": {"train": []}}))
    assert [p.field for p in problems] == ["id=?: id"]


def test_not_an_object_and_not_json(ds):
    assert fields_of(ds("[1, 2]", '{"id": ')) == [(1, "record"), (2, "record")]


def test_duplicate_conversation_ids(ds):
    assert fields_of(ds(base(), base(), splits={"seed": 1, "splits": {"train": ["c1"]}})) == [(2, "id=c1: id")]


@pytest.mark.parametrize("path,ok", [("redactions/a.json", True), ("redactions/../../a.json", False)])
def test_redaction_log_path_is_inside_the_dataset(ds, path, ok):
    conv = base()
    conv["meta"]["redaction_log"] = path
    if ok:
        read_vakforge(ds(conv))
    else:
        assert "..'" not in only(ds(conv), "meta.redaction_log").message


def test_exported_schema_accepts_smoke_records_and_refuses_unknown_keys(tmp_path):
    schema = json.loads(export_schema(tmp_path / "s.json").read_text())
    assert schema == json_schema() == json.loads((SMOKE / "vakforge.schema.json").read_text())
    validator = Draft202012Validator(schema)
    for line in (SMOKE / "vakforge.jsonl").read_text(encoding="utf-8").splitlines():
        validator.validate(json.loads(line))
    assert not validator.is_valid({**base(), "colour": "blue"})


# --------------------------------------------------------------------------- locale and languages


def test_locale_must_be_a_registered_pack(ds):
    conv = base()
    conv["locale"] = "fr-FR"
    assert "registered: en-US, en-GB, en-IN, hi-Latn-IN, zh-CN" in only(ds(conv), "locale").message


def test_lang_must_be_declared_by_the_pack(ds):
    conv = base()
    conv["turns"][0]["lang"] = "zh-CN"
    conv["language"]["mix"].append("zh")
    assert "not declared by the hi-Latn-IN locale pack" in only(ds(conv), "turns[0].lang").message


def test_lang_of_a_sibling_pack_in_the_manifest_is_allowed(ds):
    conv, other = base(), base("c2")
    conv["turns"][0]["lang"] = "zh-CN"
    conv["language"]["mix"].append("zh")
    other["locale"], other["language"] = "zh-CN", {"primary": "zh-CN", "mix": ["zh", "en"]}
    for k in (0, 1, 4):
        other["turns"][k]["lang"] = "zh-CN"
    other["meta"]["pii_redacted"] = True
    assert len(read_vakforge(ds(conv, other))) == 2


def test_language_tags_are_bcp47(ds):
    conv = base()
    conv["turns"][0]["lang"] = "Hinglish"
    assert "BCP-47" in only(ds(conv), "turns[0].lang").message


def test_language_mix_lists_every_language(ds):
    conv = base()
    conv["language"]["mix"] = ["hi"]
    assert "'en', used by turns[5].lang" in only(ds(conv), "language.mix").message
    conv["language"]["mix"] = None
    read_vakforge(ds(conv))  # mix is optional


# --------------------------------------------------------------------------- audio


@pytest.mark.parametrize("path", ["/data/a.wav", "../a.wav", "audio/../../a.wav", "C:/a.wav", "audio\\a.wav",
                                  "https://x.org/a.wav"])
def test_audio_path_must_be_relative_without_dotdot(ds, path):
    conv = base()
    conv["audio"]["path"] = path
    # A lexical rule: it holds without media checks too.
    only(ds(conv, media=False), "audio.path", check_media=False)


def test_audio_file_must_exist_unless_media_checks_are_off(ds):
    path = ds(base(), media=False)
    assert only(path, "audio.path").message.startswith("file not found: audio/c1.wav")
    assert len(read_vakforge(path, check_media=False)) == 1


def test_audio_must_decode(ds, tmp_path):
    (tmp_path / "audio").mkdir()
    (tmp_path / "audio" / "c1.wav").write_bytes(b"RIFF not really a wave file" * 10)
    assert only(ds(base()), "audio.path").message.startswith("does not decode: ")


def test_audio_must_match_declared_rate_channels_duration(ds, tmp_path):
    write_wav(tmp_path / "audio" / "c1.wav", rate=16000, channels=1, seconds=3.0)
    assert {f for _, f in fields_of(ds(base()))} == {
        "id=c1: audio.sample_rate", "id=c1: audio.channels", "id=c1: audio.duration_s",
    }


@pytest.mark.parametrize("seconds,ok", [(2.45, True), (1.55, True), (2.6, False), (1.4, False)])
def test_audio_duration_tolerance_is_half_a_second(ds, tmp_path, seconds, ok):
    write_wav(tmp_path / "audio" / "c1.wav", seconds=seconds)
    if ok:
        read_vakforge(ds(base()))
    else:
        assert "tolerance ±0.5 s" in only(ds(base()), "audio.duration_s").message


def test_flac_audio_decodes():
    conv = read_vakforge(SMOKE / "vakforge.jsonl")[0]
    assert conv.audio.path.endswith(".flac")


def test_turns_must_end_within_the_audio(ds):
    conv = base()
    conv["turns"][5]["end"] = 2.4  # within the tolerance
    read_vakforge(ds(conv))
    conv["turns"][5]["end"] = 2.6
    only(ds(conv), "turns[5].end")


def test_stereo_needs_a_channel_map(ds):
    conv = base()
    del conv["audio"]["channel_map"]
    assert "required for 2-channel audio" in only(ds(conv), "audio.channel_map").message


def test_channel_map_needs_one_user_and_one_agent(ds):
    conv = base()
    conv["audio"]["channel_map"] = {"0": "agent", "1": "agent"}
    assert "one channel to user and the other to agent" in only(ds(conv), "audio.channel_map").message
    conv["audio"]["channel_map"] = {"0": "agent", "1": "user"}
    read_vakforge(ds(conv))
    conv["audio"]["channel_map"] = {"0": "agent"}
    assert "both channels" in only(ds(conv), "audio.channel_map").message
    conv["audio"]["channel_map"] = {"0": "agent", "2": "user"}
    only(ds(conv), "audio.channel_map.2")


def test_mono_audio_has_no_channel_map(ds, tmp_path):
    conv = base()
    conv["audio"]["channels"] = 1
    write_wav(tmp_path / "audio" / "c1.wav", channels=1)
    only(ds(conv), "audio.channel_map")
    del conv["audio"]["channel_map"]
    read_vakforge(ds(conv))


def test_audio_is_optional(ds):
    conv = base()
    del conv["audio"]
    del conv["meta"]["voice_consent_ref"]  # no recording: no voice to consent to
    read_vakforge(ds(conv))


# --------------------------------------------------------------------------- turns


def test_turns_sorted_by_start(ds):
    conv = base()
    conv["turns"][4].update(start=0.9, end=1.0, overlap=True)
    conv["turns"][5]["overlap"] = False
    assert "turns are sorted by start" in only(ds(conv), "turns[4].start").message


def test_end_not_before_start(ds):
    conv = base()
    conv["turns"][0]["end"] = 0.0  # a zero-length spoken turn: end == start
    read_vakforge(ds(conv))
    conv["turns"][0].update(start=0.5, end=0.3)
    assert "end >= start" in only(ds(conv), "turns[0].end").message


@pytest.mark.parametrize("text", [None, "", "   "])
def test_spoken_turns_need_text(ds, text):
    conv = base()
    conv["turns"][0]["text"] = text
    only(ds(conv), "turns[0].text")


def test_spoken_turns_need_lang(ds):
    conv = base()
    del conv["turns"][0]["lang"]
    assert "detect_lang" in only(ds(conv), "turns[0].lang").message


def test_tool_call_turn_has_zero_duration_and_is_the_agents(ds):
    conv = base()
    conv["turns"][2]["speaker"] = "user"
    only(ds(conv), "turns[2].tool_call")
    conv = base()
    conv["turns"][2]["end"] = 1.05
    only(ds(conv), "turns[2].end")


def test_tool_turn_needs_a_result_and_nothing_spoken(ds):
    conv = base()
    conv["turns"][3] = {"speaker": "tool", "start": 1.0, "end": 1.0, "text": "ok", "lang": "en"}
    fields = [f for _, f in fields_of(ds(conv))]
    assert fields[:3] == ["id=c1: turns[3].tool_result", "id=c1: turns[3].text", "id=c1: turns[3].lang"]


def test_call_turn_carries_no_text(ds):
    conv = base()
    conv["turns"][2]["text"] = "checking"
    only(ds(conv), "turns[2].text")


def test_result_on_a_spoken_turn_is_refused(ds):
    conv = base()
    conv["turns"][4]["tool_result"] = {"id": "call_9", "content": 1}
    only(ds(conv), "turns[4].tool_result")


def test_overlap_flag_matches_the_timing(ds):
    conv = base()
    conv["turns"][5]["overlap"] = False
    assert "required: true" in only(ds(conv), "turns[5].overlap").message
    conv = base()
    conv["turns"][4]["overlap"] = True
    assert "drop it" in only(ds(conv), "turns[4].overlap").message


# --------------------------------------------------------------------------- tools


def test_tool_call_ids_are_unique(ds):
    conv = base()
    conv["turns"][4:4] = [call(1.05), result(1.05)]
    for t in conv["turns"][2:6]:
        t["start"] = t["end"] = 1.0
    problems = problems_of(ds(conv))
    assert [p.field for p in problems] == ["id=c1: turns[4].tool_call.id", "id=c1: turns[5].tool_result.id"]
    assert "already issued by turns[2]" in problems[0].message
    assert "already answered by turns[3]" in problems[1].message


def test_result_must_answer_an_earlier_call(ds):
    conv = base()
    conv["turns"][3]["tool_result"]["id"] = "call_7"
    fields = [f for _, f in fields_of(ds(conv))]
    assert fields == ["id=c1: turns[3].tool_result.id", "id=c1: turns[2].tool_call.id"]  # call_1 now hangs
    conv = base()
    conv["turns"][2], conv["turns"][3] = result(1.0), call(1.0)
    problems = problems_of(ds(conv))
    assert "its call comes later, at turns[3]" in problems[0].message


def test_hanging_call_is_refused(ds):
    conv = base()
    del conv["turns"][3]
    message = only(ds(conv), "turns[2].tool_call.id").message
    assert "unanswered when turns[3] continues the conversation" in message


def test_spoken_turn_between_call_and_result_is_refused(ds):
    conv = base()
    conv["turns"][3], conv["turns"][4] = conv["turns"][4], conv["turns"][3]
    conv["turns"][3]["start"] = 1.0
    conv["turns"][4]["start"] = conv["turns"][4]["end"] = 1.6
    conv["turns"][5]["start"] = 1.6
    conv["turns"][5]["overlap"] = False
    only(ds(conv), "turns[2].tool_call.id")


def test_unanswered_calls_after_the_last_spoken_turn_are_allowed(ds):
    conv = base()
    args = {"customer_id": "SC-4471", "date": "2026-09-17", "slot": "morning"}
    conv["turns"] += [call(1.9, "call_2", "book_appointment", args), call(1.9, "call_3")]
    read_vakforge(ds(conv))


def test_call_must_name_a_declared_tool(ds):
    conv = base()
    conv["turns"][2]["tool_call"]["name"] = "cancel_order"
    assert "declare it in tools[]" in only(ds(conv), "turns[2].tool_call.name").message


def test_tool_names_are_unique(ds):
    conv = base()
    conv["tools"].append(copy.deepcopy(CHECK_STATUS))
    only(ds(conv), "tools[2].name")


def test_parameters_must_be_valid_json_schema(ds):
    conv = base()
    conv["tools"][0]["parameters"]["properties"]["customer_id"]["type"] = "strng"
    assert "not a valid JSON Schema" in only(ds(conv), "tools[0].parameters").message


def test_arguments_validate_against_parameters_without_echoing_values(ds):
    conv = base()
    args = {"customer_id": "SC-4471", "date": "17/09/2026", "slot": "evening-secret"}
    conv["turns"][4:4] = [call(1.0, "call_2", "book_appointment", args), result(1.0, "call_2")]
    problems = problems_of(ds(conv))
    assert [p.field for p in problems] == [
        "id=c1: turns[4].tool_call.arguments.date", "id=c1: turns[4].tool_call.arguments.slot",
    ]
    assert problems[0].message == "does not satisfy 'format': \"date\" (tool book_appointment)"
    assert "evening-secret" not in str(problems) and "17/09" not in str(problems)
    del args["slot"]
    args["date"] = "2026-09-17"
    assert "'slot' is a required property" in only(ds(conv), "turns[4].tool_call.arguments").message


SECRET_KEY = "Priya Sharma"  # PII a caller used as an argument key (issue 19, item 6)


@pytest.mark.parametrize(("extra_schema", "field", "message"), [
    ({"additionalProperties": False}, "turns[2].tool_call.arguments",
     "has argument keys the tool's parameters do not allow ({key 1}): additionalProperties"),
    ({"additionalProperties": {"type": "integer"}}, "turns[2].tool_call.arguments{key 1}",
     "does not satisfy 'type': \"integer\""),
    ({"propertyNames": {"pattern": "^[a-z_]+$"}}, "turns[2].tool_call.arguments",
     "an argument key does not satisfy propertyNames 'pattern': \"^[a-z_]+$\""),
    ({"patternProperties": {"^P": {"maxLength": 2}}}, "turns[2].tool_call.arguments{key 1}",
     "does not satisfy 'maxLength': 2"),
])
def test_schema_errors_never_echo_argument_keys_or_values(ds, extra_schema, field, message):
    conv = base()
    conv["tools"][0]["parameters"].update(extra_schema)
    conv["turns"][2]["tool_call"]["arguments"] = {"customer_id": "SC-4471", SECRET_KEY: "Priya Sharma, 12 MG Road"}
    problem = only(ds(conv), field)
    assert problem.message == f"{message} (tool check_status)"
    assert "priya" not in str(problem).lower() and "MG Road" not in str(problem)


def test_remote_refs_are_not_fetched(ds):
    conv = base()
    conv["tools"][0]["parameters"]["properties"]["customer_id"] = {"$ref": "https://example.invalid/id.json"}
    assert "$ref" in only(ds(conv), "turns[2].tool_call.arguments").message


@pytest.mark.parametrize("content", [[1, 2], "done", 3.5, None, {"nested": {"list": []}}])
def test_tool_result_content_is_any_json(ds, content):
    conv = base()
    conv["turns"][3]["tool_result"]["content"] = content
    read_vakforge(ds(conv))


# --------------------------------------------------------------------------- entities


def test_entity_offsets_slice_to_the_entity_text(ds):
    conv = base()
    conv["turns"][1]["entities"][0].update(start_char=11, end_char=18)
    message = only(ds(conv), "turns[1].entities[0].start_char").message
    assert message.endswith("the entity text occurs at [12:19]") and "SC-4471" not in message


def test_entity_offsets_come_in_pairs(ds):
    conv = base()
    del conv["turns"][1]["entities"][0]["end_char"]
    only(ds(conv), "turns[1].entities[0]")
    del conv["turns"][1]["entities"][0]["start_char"]
    read_vakforge(ds(conv))  # neither is fine


def test_entity_offsets_past_the_text(ds):
    conv = base()
    conv["turns"][1]["entities"][0].update(start_char=12, end_char=90)
    only(ds(conv), "turns[1].entities[0].start_char")


# --------------------------------------------------------------------------- provenance


def test_consent_none_only_with_allow_unconsented(ds):
    conv = base()
    conv["meta"]["consent"] = "none"
    del conv["meta"]["consent_ref"]
    assert "--allow-unconsented" in only(ds(conv), "meta.consent").message
    assert len(read_vakforge(ds(conv), allow_unconsented=True)) == 1


@pytest.mark.parametrize("consent", ["recorded_verbal", "written"])
def test_recorded_consent_needs_a_reference(ds, consent):
    conv = base()
    conv["meta"]["consent"] = consent
    read_vakforge(ds(conv))
    del conv["meta"]["consent_ref"]
    only(ds(conv), "meta.consent_ref")


def test_public_license_needs_a_license(ds):
    conv = base()
    conv["meta"].update(source="public", consent="public_license", license="CC-BY-4.0")
    read_vakforge(ds(conv))
    del conv["meta"]["license"]
    only(ds(conv), "meta.license")


def test_synthetic_consent_needs_synthetic_source(ds):
    conv = base()
    conv["meta"]["consent"] = "synthetic"
    only(ds(conv), "meta.consent")
    conv["meta"]["source"] = "synthetic"
    read_vakforge(ds(conv))


def test_real_data_must_be_redacted_with_a_log(ds):
    conv = base()
    conv["meta"]["pii_redacted"] = False
    del conv["meta"]["redaction_log"]
    assert [f for _, f in fields_of(ds(conv))] == ["id=c1: meta.pii_redacted", "id=c1: meta.redaction_log"]


def test_synthetic_rows_are_exempt_from_redaction(ds):
    conv = base()
    conv["meta"] = {"source": "synthetic", "consent": "synthetic", "pii_redacted": False}
    conv["turns"][0]["text"] = "Call me on 9876543210."
    read_vakforge(ds(conv))


def test_real_audio_needs_voice_consent(ds):
    conv = base()
    del conv["meta"]["voice_consent_ref"]
    assert "biometric" in only(ds(conv), "meta.voice_consent_ref").message


def test_redaction_log_must_exist(ds, tmp_path):
    conv = base()
    conv["meta"]["redaction_log"] = "logs/missing.json"
    path = ds(conv)
    (tmp_path / "logs" / "missing.json").unlink()
    assert only(path, "meta.redaction_log").message.startswith("file not found: logs/missing.json")


@pytest.mark.parametrize("log,expected", [
    ([], "top level"),
    ({"conversation_id": "c1"}, "spans: required"),
    ({"spans": [{"turn": 1, "field": "text", "type": "phone", "start": 4}]}, "spans[0].end: required"),
    ("{not json", "invalid JSON"),
])
def test_redaction_log_is_an_object_with_spans(ds, tmp_path, log, expected):
    (tmp_path / "redactions").mkdir()
    (tmp_path / "redactions" / "c1.json").write_text(log if isinstance(log, str) else json.dumps(log))
    message = only(ds(base()), "meta.redaction_log").message
    assert message.startswith("redactions/c1.json: ") and (expected in message or "Invalid JSON" in message)


def test_redaction_log_belongs_to_the_conversation_and_its_turns(ds, tmp_path):
    (tmp_path / "redactions").mkdir()
    span = {"turn": 1, "field": "text", "type": "phone", "start": 18, "end": 28, "placeholder": "<PHONE_1>",
            "audio": {"start_s": 0.7, "end_s": 0.9, "method": "tone"}}
    log = tmp_path / "redactions" / "c1.json"
    log.write_text(json.dumps({"conversation_id": "c1", "spans": [span]}))
    read_vakforge(ds(base()))
    log.write_text(json.dumps({"conversation_id": "c2", "spans": [{**span, "turn": 6}]}))
    messages = [p.message for p in problems_of(ds(base()))]
    assert messages == [
        "redactions/c1.json is the log of c2, not of this conversation",
        "redactions/c1.json: spans[0].turn: 6 is past the last turn (turns[5])",
    ]


# --------------------------------------------------------------------------- PII re-check

PII = [
    ("en-US", "call (415) 555-0123 now", "phone"),
    ("en-US", "or +1 415-555-0123", "phone"),
    ("en-US", "ssn 123-45-6789 ok", "ssn"),
    ("en-US", "card 4111 1111 1111 1111", "payment_card"),
    ("en-US", "mail jane.doe@example.com please", "email"),
    ("en-GB", "ring 07700 900123", "phone"),
    ("en-GB", "or +44 20 7946 0958", "phone"),
    ("en-GB", "NI number AB 12 34 56 C", "national_insurance_number"),
    ("en-GB", "NHS number 943 476 5919", "nhs_number"),
    ("en-IN", "+91 98765 43210 pe call karo", "phone"),
    ("en-IN", "PAN is ABCPE1234F", "pan"),
    ("en-IN", "aadhaar 2345 6789 0124", "aadhaar"),
    ("hi-Latn-IN", "mera number 9876543210 hai", "phone"),
    ("hi-Latn-IN", "ya ९८७६५४३२१० pe", "phone"),
    ("hi-Latn-IN", "date 2026-09-17 9876543210", "phone"),
    ("zh-CN", "我的手机是13812345678。", "phone"),
    ("zh-CN", "或者+86 138 1234 5678", "phone"),
    ("zh-CN", "身份证11010519491231002X", "resident_id"),
    ("zh-CN", "邮箱wang@example.cn", "email"),
]
NOT_PII = [
    "customer ID SC-4471 on 2026-09-17 at 10:30",
    "Charge ₹500 hoga, order NW-20417, ticket 4471",
    "mera number <PHONE_1> hai, email <EMAIL_1>",
    "aadhaar 2345 6789 0123",  # Verhoeff check digit wrong
    "card 4111 1111 1111 1112",  # Luhn check digit wrong
    "订单号 SD1234，2026年9月17日",
]


@pytest.mark.parametrize("locale,text,kind", PII)
def test_pii_redacted_is_rechecked_without_repeating_the_value(ds, locale, text, kind):
    conv = base()
    conv["turns"][0]["text"] = text
    found = [f for f in PACKS[locale].find_pii(text)]
    assert [f.type for f in found] == [kind]
    conv["locale"] = locale
    conv["language"] = {"primary": sorted(PACKS[locale].langs)[0]}
    for k in (0, 1, 4, 5):
        conv["turns"][k]["lang"] = "en"
    problem = only(ds(conv), "turns[0].text")
    value = text[found[0].start:found[0].end]
    assert value not in str(problem) and kind in problem.message
    assert f"[{found[0].start}:{found[0].end}]" in problem.message


@pytest.mark.parametrize("text", NOT_PII)
def test_pii_recheck_passes_redacted_text(ds, text):
    assert not any(pack.find_pii(text) for pack in PACKS.values())
    conv = base()
    conv["turns"][0]["text"] = text
    read_vakforge(ds(conv))


def test_pii_recheck_covers_system_prompt_and_tool_json(ds):
    conv = base()
    conv["system_prompt"] = "Escalate to priya@suncare.in."
    conv["tools"][0]["parameters"]["properties"]["phone"] = {"type": "string"}
    conv["turns"][2]["tool_call"]["arguments"]["phone"] = "+91 98765 43210"
    conv["turns"][3]["tool_result"]["content"] = {"contacts": [{"mobile": 9876543210}], "98765 43210": 1}
    problems = problems_of(ds(conv))
    assert [p.field for p in problems] == [
        "id=c1: system_prompt",
        "id=c1: turns[2].tool_call.arguments.phone",
        "id=c1: turns[3].tool_result.content.contacts[0].mobile",
        "id=c1: turns[3].tool_result.content{key 1}",
    ]
    text = "\n".join(str(p) for p in problems)
    for value in ("priya@suncare.in", "98765", "9876543210"):
        assert value not in text


def test_pii_is_not_rechecked_without_the_claim(ds):
    conv = base()
    conv["meta"].update(source="public", consent="public_license", pii_redacted=False)
    conv["turns"][0]["text"] = "mera number 9876543210 hai"
    read_vakforge(ds(conv))


# --------------------------------------------------------------------------- splits


def test_splits_file_is_required(ds, tmp_path):
    problems = problems_of(ds(base(), splits=None))
    assert [(p.path, p.line, p.field) for p in problems] == [(str(tmp_path / "splits.json"), 0, "file")]


def test_every_conversation_is_in_exactly_one_split(ds, tmp_path):
    splits = {"seed": 1, "splits": {"train": ["a", "b"], "test": ["b", "ghost"]}}
    problems = problems_of(ds(base("a"), base("b"), base("c"), splits=splits))
    manifest, split_file = str(tmp_path / "vakforge.jsonl"), str(tmp_path / "splits.json")
    assert [(p.path, p.line, p.field) for p in problems] == [
        (manifest, 3, "id=c: id"),
        (split_file, 9, "splits.test[0]"),
        (split_file, 10, "splits.test[1]"),
    ]
    assert "already in split 'train'" in problems[1].message and "not a conversation of" in problems[2].message


def test_meta_split_agrees_with_splits_json(ds):
    conv = base()
    conv["meta"]["split"] = "test"
    assert "assigns it to 'train'" in only(ds(conv, splits={"seed": 1, "splits": {"train": ["c1"]}}), "meta.split").message


@pytest.mark.parametrize("role", ["agent", "user"])
def test_a_speaker_stays_in_one_split(ds, role):
    a, b = base("a"), base("b")
    b["meta"]["split"] = "test"
    b["meta"]["speakers"][role] = a["meta"]["speakers"][role]
    problems = problems_of(ds(a, b))
    assert [(p.line, p.field) for p in problems] == [(2, f"id=b: meta.speakers.{role}")]
    assert "split 'test' here and in split 'train' in id=a (line 1)" in problems[0].message
    assert "agent_a" not in problems[0].message and "user_a" not in problems[0].message
    b["meta"]["split"] = "train"
    read_vakforge(ds(a, b))  # same speaker, same split


@pytest.mark.parametrize("text,field", [("{", "file"), ('{"splits": {"train": ["c1"]}}', "seed"),
                                        ('{"seed": 1, "splits": {"Train!": ["c1"]}}', "splits.Train!")])
def test_malformed_splits_json(ds, tmp_path, text, field):
    problems = problems_of(ds(base(), splits=text))
    assert [(p.path, p.field) for p in problems][0] == (str(tmp_path / "splits.json"), field)


# --------------------------------------------------------------------------- manifest_hash


def test_manifest_hash_covers_manifest_splits_and_audio(ds, tmp_path):
    path = ds(base())
    first = manifest_hash(path)
    assert first.startswith("sha256:") and len(first) == 7 + 64
    assert manifest_hash(path, read_vakforge(path)) == first
    write_wav(tmp_path / "audio" / "c1.wav", seconds=1.9)
    second = manifest_hash(path)
    assert second != first
    (tmp_path / "splits.json").write_text(json.dumps({"seed": 8, "splits": {"train": ["c1"]}}))
    assert manifest_hash(path) != second


def test_manifest_hash_refuses_invalid_data(ds):
    conv = base()
    conv["turns"][0]["lang"] = None
    with pytest.raises(FormatError):
        manifest_hash(ds(conv))


# --------------------------------------------------------------------------- bad inputs corpus

EXPECTED = json.loads((BAD / "expected.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("manifest", sorted(EXPECTED))
def test_bad_inputs(manifest, monkeypatch):
    monkeypatch.chdir(BAD)
    with pytest.raises(FormatError) as info:
        read_vakforge(manifest)
    assert [str(p) for p in info.value.problems] == EXPECTED[manifest]


def test_bad_inputs_corpus_is_complete():
    on_disk = {str(p.relative_to(BAD)) for p in BAD.rglob("vakforge.jsonl")}
    assert on_disk == set(EXPECTED)


# --------------------------------------------------------------------------- CLI


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "data_pipeline.validate", *args],
        cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.slow
def test_cli_export_schema_default_and_given_path(tmp_path):
    result = cli("--format=vakforge", "--export-schema", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads((tmp_path / "vakforge.schema.json").read_text()) == json_schema()
    result = cli("--format=vakforge", "--export-schema", "out/s.json", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("validate: cannot write out/s.json")
    (tmp_path / "out").mkdir()
    result = cli("--format=vakforge", "--export-schema", "out/s.json", cwd=tmp_path)
    assert result.returncode == 0 and (tmp_path / "out" / "s.json").is_file()


def test_cli_export_schema_is_vakforge_only(tmp_path):
    result = cli("--format=vflash", "--export-schema", cwd=tmp_path)
    assert result.returncode == 2 and "--export-schema" in result.stderr


@pytest.mark.slow
def test_cli_allow_unconsented(tmp_path):
    conv = base()
    conv["meta"]["consent"] = "none"
    write(tmp_path, conv)
    refused = cli("--format=vakforge", "vakforge.jsonl", cwd=tmp_path)
    assert refused.returncode == 1
    assert refused.stderr.startswith("vakforge.jsonl:1: id=c1: meta.consent: \"none\" is accepted only with")
    allowed = cli("--format=vakforge", "--allow-unconsented", "vakforge.jsonl", cwd=tmp_path)
    assert (allowed.returncode, allowed.stdout) == (0, "vakforge.jsonl: 1 conversations OK\n")
    other = cli("--format=vflash", "--allow-unconsented", "vakforge.jsonl", cwd=tmp_path)
    assert other.returncode == 2 and "applies to --format=vakforge only" in other.stderr


@pytest.mark.slow
def test_cli_validates_the_smoke_set_and_reports_json(tmp_path):
    ok = cli("--format=vakforge", str(SMOKE / "vakforge.jsonl"), cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    conv = base()
    conv["turns"][0]["lang"] = None
    write(tmp_path, conv)
    bad = cli("--format=vakforge", "--json", "vakforge.jsonl", cwd=tmp_path)
    assert bad.returncode == 1 and json.loads(bad.stdout)[0]["field"] == "id=c1: turns[0].lang"
