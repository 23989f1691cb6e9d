"""Valen JSONL reader (seed 000, "Data format"): each rule with a passing and a failing record."""

from __future__ import annotations

import copy
import hashlib
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from data_pipeline.formats.errors import PROBLEM_CAP, FormatError, Problem
from data_pipeline.formats.valen import (
    NOUL_CANDIDATES,
    Label,
    Message,
    Part,
    Question,
    StateMessages,
    check_valen,
    iter_valen,
    read_valen,
)

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "data" / "smoke" / "valen"

# The seed 000 example record, collapsed onto one line by `write`.
SEED = {
    "group_id": "traffic-light-001",
    "request": {
        "state": "The traffic light is green.",
        "questions": {
            "color": {
                "type": "choice",
                "instructions": "Choose the observed traffic light color.",
                "criteria": {"red": "Red light", "green": "Green light", "unknown": "Not visible"},
            },
            "go": {
                "type": "noul",
                "instructions": "Only a green light permits crossing. Is crossing permitted?",
            },
            "risk": {
                "type": "score",
                "instructions": "Rate the risk of crossing under this light.",
                "criteria": ["Low: green light", "Medium: light not visible", "High: red light"],
            },
        },
    },
    "targets": {
        "color": {"probabilities": {"red": 0.0, "green": 1.0, "unknown": 0.0}},
        "go": {"probabilities": {"true": 1.0, "false": 0.0}},
        "risk": {"probabilities": {"0": 1.0, "1": 0.0, "2": 0.0}},
    },
    "assets": [],
    "meta": {"domain": "traffic", "modality": "text", "language_bucket": "en"},
}
def png(colour: tuple[int, int, int]) -> bytes:
    # A real image: image parts are decoded as the training loader decodes them (issue 54).
    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), colour).save(buffer, "PNG")
    return buffer.getvalue()


PNG = png((0, 160, 0))


def seed(**changes: object) -> dict:
    """The seed record with top-level keys replaced (a value of ... removes the key)."""
    out = copy.deepcopy(SEED)
    for key, value in changes.items():
        if value is ...:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_KEEP = object()


def with_request(state: object = _KEEP, questions: object = _KEEP, **changes: object) -> dict:
    """The seed record with `request.state`/`request.questions` replaced (... removes it)."""
    out = seed(**changes)
    for key, value in (("state", state), ("questions", questions)):
        if value is ...:
            del out["request"][key]
        elif value is not _KEEP:
            out["request"][key] = value
    return out


def one_question(spec: object, target: object = ...) -> dict:
    out = with_request(questions={"q": spec}, targets={} if target is ... else {"q": target})
    return out


def write(path: Path, *rows: object) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def problems_of(path: Path, **kwargs) -> list[Problem]:
    with pytest.raises(FormatError) as info:
        read_valen(path, **kwargs)
    # The streaming check finds exactly the same problems.
    with pytest.raises(FormatError) as streamed:
        check_valen(path, **kwargs)
    assert streamed.value.problems == info.value.problems
    return list(info.value.problems)


def fields_of(path: Path, **kwargs) -> list[tuple[int, str]]:
    return [(p.line, p.field) for p in problems_of(path, **kwargs)]


def only_problem(tmp_path: Path, record: object, **kwargs) -> Problem:
    (problem,) = problems_of(write(tmp_path / "one.jsonl", record), **kwargs)
    return problem


def reads(tmp_path: Path, *records: object, **kwargs):
    path = write(tmp_path / "ok.jsonl", *records)
    found = read_valen(path, **kwargs)
    counts = check_valen(path, **kwargs)
    assert (counts.records, counts.questions, counts.labeled) == (
        len(found),
        sum(len(r.questions) for r in found),
        sum(r.labeled for r in found),
    )
    return found


# -- the smoke set and the seed record -------------------------------------------------------------


def test_smoke_set_validates():
    records = read_valen(SMOKE / "train.jsonl")
    assert len(records) == 6
    assert sum(len(r.questions) for r in records) == 15
    assert sum(r.labeled for r in records) == 13
    counts = check_valen(SMOKE / "train.jsonl")
    assert str(counts) == "6 records, 15 questions, 13 labeled"
    assert len(read_valen(SMOKE / "text.jsonl")) == 4
    media = [m for r in records for m in r.media]
    assert [(m.kind, m.url) for m in media] == [("image", "assets/shapes.png"), ("video", "assets/clip.mp4")]
    for m in media:
        assert m.path == (SMOKE / m.url).resolve()
        assert m.sha256 == hashlib.sha256(m.path.read_bytes()).hexdigest()


def test_seed_record_reads_into_typed_records(tmp_path):
    (rec,) = reads(tmp_path, SEED)
    assert (rec.line, rec.group_id, rec.group_key, rec.state) == (
        1,
        "traffic-light-001",
        "traffic-light-001",
        SEED["request"]["state"],
    )
    assert rec.questions == (
        Question(
            "color",
            "choice",
            "Choose the observed traffic light color.",
            (("red", "Red light"), ("green", "Green light"), ("unknown", "Not visible")),
        ),
        Question(
            "go", "noul", "Only a green light permits crossing. Is crossing permitted?", NOUL_CANDIDATES
        ),
        Question(
            "risk",
            "score",
            "Rate the risk of crossing under this light.",
            (("0", "Low: green light"), ("1", "Medium: light not visible"), ("2", "High: red light")),
        ),
    )
    assert NOUL_CANDIDATES == (("true", "true"), ("false", "false"))
    assert rec.questions[2].keys == ("0", "1", "2")
    assert rec.targets[0] == Label({"red": 0.0, "green": 1.0, "unknown": 0.0}, True, {})
    assert rec.target("go") == Label({"true": 1.0, "false": 0.0}, True, {})
    assert (rec.assets, rec.media, rec.meta) == ((), (), SEED["meta"])


# -- file level ------------------------------------------------------------------------------------


def test_utf8_text_reads_and_invalid_bytes_are_refused(tmp_path):
    chinese = with_request(
        state="窗外乌云密布。",
        questions={"伞": {"type": "noul", "instructions": "出门需要带伞吗？"}},
        targets={},
    )
    assert reads(tmp_path, chinese)[0].questions[0].id == "伞"
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(SEED).encode() + b"\n" + b'{"group_id": "\xff"}\n')
    assert [(p.line, p.field, p.message) for p in problems_of(path)] == [
        (2, "record", "not UTF-8: invalid byte at column 15")
    ]


def test_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(SEED).encode() + b"\n")
    assert len(read_valen(path)) == 1


def test_blank_lines_ignored_and_line_numbers_kept(tmp_path):
    path = write(tmp_path / "a.jsonl", "", SEED, "   ", "\t", seed(group_id=None))
    assert fields_of(path) == [(5, "group_id")]
    path = write(tmp_path / "b.jsonl", SEED, "", "  ", SEED)
    assert [r.line for r in read_valen(path)] == [1, 4]


def test_crlf_line_ends_read(tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(json.dumps(SEED).encode() + b"\r\n\r\n" + json.dumps(SEED).encode() + b"\r\n")
    assert [r.line for r in read_valen(path)] == [1, 3]


def test_empty_missing_and_folder_files_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert problems_of(empty) == [Problem(str(empty), 0, "file", "empty file: no records")]
    empty.write_text("\n  \n\n")
    assert problems_of(empty) == [Problem(str(empty), 0, "file", "empty file: no records")]
    assert problems_of(tmp_path / "nope.jsonl")[0].message == "no such file"
    assert problems_of(tmp_path)[0].message.startswith("cannot read")


def test_undecodable_lines_become_problems(tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [
        json.dumps(SEED)[:-5],  # truncated
        "[" * 100_000 + "]" * 100_000,  # deeper than the parser's stack
        '{"group_id": ' + "9" * 10_000 + "}",  # over Python's int/str digit limit
        '{"group_id": NaN}',
        '{"group_id": -Infinity}',
        '{"group_id": "a", "group_id": "b"}',
        "[1, 2]",
        "{not json",
    ]
    write(path, *rows)
    problems = problems_of(path)
    assert [(p.line, p.field) for p in problems] == [(n, "record") for n in range(1, 9)]
    messages = [p.message for p in problems]
    assert messages[0].startswith("invalid JSON: ")
    assert messages[1] == "invalid JSON: nested too deeply for the JSON parser"
    assert messages[2] == "invalid JSON: an integer with more than 4300 digits"
    assert messages[3] == "invalid JSON: NaN is not JSON"
    assert messages[4] == "invalid JSON: -Infinity is not JSON"
    assert messages[5] == "invalid JSON: duplicate key 'group_id'"
    assert messages[6] == "a record must be a JSON object, got a list"


def test_every_problem_of_the_file_is_reported_up_to_the_cap(tmp_path):
    bad = seed(group_id="")
    path = write(tmp_path / "many.jsonl", *([bad] * (PROBLEM_CAP + 5)))
    problems = problems_of(path)
    assert len(problems) == PROBLEM_CAP + 1
    assert [p.line for p in problems[:3]] == [1, 2, 3]
    assert problems[-1] == Problem(str(path), 0, "file", "… 5 more problems not shown")


def test_iter_valen_streams_and_raises_after_the_last_line(tmp_path):
    path = write(tmp_path / "a.jsonl", SEED, seed(group_id=None), SEED)
    seen = []
    with pytest.raises(FormatError) as info:
        for record in iter_valen(path):
            seen.append(record.line)
    assert seen == [1, 3]
    assert [(p.line, p.field) for p in info.value.problems] == [(2, "group_id")]


# -- record level ----------------------------------------------------------------------------------


def test_only_the_seed_top_level_keys(tmp_path):
    minimal = {"group_id": "g", "request": SEED["request"]}
    (rec,) = reads(tmp_path, minimal)
    assert (rec.targets, rec.assets, rec.meta) == ((None, None, None), (), {})
    path = write(tmp_path / "a.jsonl", seed(id="x"), seed(split="train", **{"a b": 1}))
    assert fields_of(path) == [(1, "id"), (2, '["a b"]'), (2, "split")]
    assert (
        problems_of(path)[0].message
        == "unknown key; a Valen record has group_id, request, targets, assets, meta"
    )


@pytest.mark.parametrize("group_id", ["g", 7, 0, ["a"], {"source": "x"}, True])
def test_group_id_any_non_empty_value(tmp_path, group_id):
    (rec,) = reads(tmp_path, seed(group_id=group_id))
    assert rec.group_id == group_id
    assert rec.group_key == (
        group_id if isinstance(group_id, str) else json.dumps(group_id, separators=(",", ":"))
    )


@pytest.mark.parametrize("group_id", [None, "", "  ", [], {}, ...])
def test_group_id_required_and_non_empty(tmp_path, group_id):
    problem = only_problem(tmp_path, seed(group_id=group_id))
    assert problem.field == "group_id"
    assert "non-empty" in problem.message and "preferably a string" in problem.message


def test_request_shape(tmp_path):
    path = write(
        tmp_path / "r.jsonl",
        seed(request=...),
        seed(request="hello"),
        with_request(state=...),
        seed(request={**SEED["request"], "answers": {}}),
    )
    assert fields_of(path) == [(1, "request"), (2, "request"), (3, "request.state"), (4, "request.answers")]


def test_meta_optional_object(tmp_path):
    assert reads(tmp_path, seed(meta=...), seed(meta={}), seed(meta={"record_id": 3}))[2].meta == {
        "record_id": 3
    }
    path = write(tmp_path / "m.jsonl", seed(meta=None), seed(meta=["x"]))
    problems = problems_of(path)
    assert [(p.line, p.field) for p in problems] == [(1, "meta"), (2, "meta")]
    assert problems[0].message == "must be an object, got null; omit it or use {}"


# -- state -----------------------------------------------------------------------------------------


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def messages(*items: dict) -> dict:
    return {"messages": list(items)}


@pytest.fixture
def media(tmp_path) -> Path:
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "light.png").write_bytes(PNG)
    (tmp_path / "assets" / "clip.mp4").write_bytes(b"\0\0\0 ftyp")
    return tmp_path


def test_state_text_or_messages(tmp_path, media):
    state = messages(
        {"role": "system", "content": "You judge traffic."},
        {
            "role": "user",
            "content": [text("Determine the light."), image("assets/light.png"), video("assets/clip.mp4")],
        },
        {"role": "assistant", "content": ""},
    )
    empty, rec = reads(tmp_path, with_request(state=""), with_request(state=state))
    assert empty.state == ""
    assert rec.state == StateMessages(
        (
            Message("system", "You judge traffic."),
            Message(
                "user",
                (
                    Part("text", text="Determine the light."),
                    Part("image_url", url="assets/light.png"),
                    Part("video_url", url="assets/clip.mp4"),
                ),
            ),
            Message("assistant", ""),
        )
    )
    assert [(m.kind, m.url, m.path) for m in rec.media] == [
        ("image", "assets/light.png", (media / "assets" / "light.png").resolve()),
        ("video", "assets/clip.mp4", (media / "assets" / "clip.mp4").resolve()),
    ]
    assert rec.media[0].sha256 == hashlib.sha256(PNG).hexdigest()


def test_state_shapes_refused(tmp_path, media):
    user = {"role": "user", "content": "hi"}
    path = write(
        tmp_path / "s.jsonl",
        with_request(state=3),
        with_request(state={"messages": []}),
        with_request(state={"messages": [user], "images": []}),
        with_request(state=messages("hi")),
        with_request(state=messages({"role": "User", "content": "hi"})),
        with_request(state=messages({"role": "tool", "content": "hi"})),
        with_request(state=messages({"role": "user", "content": []})),
        with_request(state=messages({"role": "user", "content": None})),
        with_request(state=messages({**user, "name": "x"})),
        with_request(state=messages({"role": "user"})),
    )
    assert fields_of(path) == [
        (1, "request.state"),
        (2, "request.state.messages"),
        (3, "request.state.images"),
        (4, "request.state.messages[0]"),
        (5, "request.state.messages[0].role"),
        (6, "request.state.messages[0].role"),
        (7, "request.state.messages[0].content"),
        (8, "request.state.messages[0].content"),
        (9, "request.state.messages[0].name"),
        (10, "request.state.messages[0].content"),
    ]
    assert (
        problems_of(path)[4].message
        == 'must be user, assistant or system; got "User"; roles are lowercase: "user"'
    )


def test_content_part_shapes_refused(tmp_path, media):
    def part(p: object) -> dict:
        return with_request(state=messages({"role": "user", "content": [p]}))

    path = write(
        tmp_path / "p.jsonl",
        part("just text"),
        part({"type": "text"}),
        part({"type": "text", "text": 5}),
        part({"type": "Image_url", "image_url": {"url": "assets/light.png"}}),
        part({"type": "image", "image": "assets/light.png"}),
        part({"type": "image_url", "image_url": "assets/light.png"}),
        part({"type": "image_url", "image_url": {"url": "assets/light.png", "detail": "high"}}),
        part({"type": "image_url", "image_url": {"url": ""}}),
        part({"type": "text", "text": "a", "image_url": {"url": "assets/light.png"}}),
        part({"type": "video_url", "image_url": {"url": "assets/clip.mp4"}}),
    )
    prefix = "request.state.messages[0].content[0]"
    assert fields_of(path) == [
        (1, prefix),
        (2, f"{prefix}.text"),
        (3, f"{prefix}.text"),
        (4, f"{prefix}.type"),
        (5, f"{prefix}.type"),
        (6, f"{prefix}.image_url"),
        (7, f"{prefix}.image_url.detail"),
        (8, f"{prefix}.image_url.url"),
        (9, f"{prefix}.image_url"),
        (10, f"{prefix}.image_url"),
        (10, f"{prefix}.video_url"),
    ]
    assert problems_of(path)[3].message.endswith('; types are lowercase: "image_url"')


def test_media_paths_relative_to_the_jsonl_or_absolute(tmp_path, media, monkeypatch):
    absolute = str((media / "assets" / "light.png").resolve())
    sub = tmp_path / "data"
    sub.mkdir()
    (sub / "assets").mkdir()
    (sub / "assets" / "light.png").write_bytes(png((160, 0, 0)))
    path = write(
        sub / "train.jsonl",
        with_request(state=messages({"role": "user", "content": [image("assets/light.png")]})),
        with_request(state=messages({"role": "user", "content": [image(absolute)]})),
        with_request(state=messages({"role": "user", "content": [image("../assets/light.png")]})),
    )
    monkeypatch.chdir(media / "assets")  # the working folder plays no part
    # Seed 000: "local absolute paths also work" -- with the converter option; outside the JSONL's
    # folder, absolute or by "..", they are refused by default (issue 19: shards would carry them).
    assert [(p.line, "is absolute" in p.message, "leads outside" in p.message) for p in problems_of(path)] == [
        (2, True, False), (3, False, True)]
    first, second, third = read_valen(path, allow_absolute_media=True)
    assert first.media[0].path == (sub / "assets" / "light.png").resolve()
    assert second.media[0].path == third.media[0].path == (media / "assets" / "light.png").resolve()


@pytest.mark.parametrize(
    "url", ["http://example.com/a.png", "https://x/y.mp4", "file:///tmp/a.png", "s3://b/a.png"]
)
def test_urls_refused(tmp_path, url):
    problem = only_problem(tmp_path, with_request(state=messages({"role": "user", "content": [image(url)]})))
    assert problem.field == "request.state.messages[0].content[0].image_url.url"
    assert problem.message == f'"{url}" is a URL; save the media locally and give its path'
    problem = only_problem(tmp_path, seed(assets=[{"path": url, "sha256": "0" * 64}]))
    assert (
        problem.field,
        problem.message.endswith("is a URL; save the media locally and give its path"),
    ) == (
        "assets[0].path",
        True,
    )


def test_missing_media_refused_unless_check_media_is_off(tmp_path, media):
    record = with_request(
        state=messages({"role": "user", "content": [image("assets/nope.png"), image("assets")]})
    )
    problems = problems_of(write(tmp_path / "m.jsonl", record))
    assert [p.message for p in problems] == [
        f"file not found: {(media / 'assets' / 'nope.png').resolve()}",
        f"file not found: {(media / 'assets').resolve()}",  # a folder is not a media file
    ]
    (rec,) = read_valen(tmp_path / "m.jsonl", check_media=False)
    assert [(m.path, m.sha256) for m in rec.media] == [
        ((media / "assets" / "nope.png").resolve(), None),
        ((media / "assets").resolve(), None),
    ]


def test_assets_digests_compared_only_for_matching_paths(tmp_path, media):
    digest = hashlib.sha256(PNG).hexdigest()
    state = messages({"role": "user", "content": [image("assets/light.png")]})
    good = [
        with_request(state=state, assets=[{"path": "assets/light.png", "sha256": digest}]),
        with_request(
            state=state, assets=[{"path": "./assets/../assets/light.png", "sha256": digest.upper()}]
        ),
        with_request(state=state, assets=...),  # unlisted media is read and its digest recorded
        # entries for media the record does not use are not checked against any file
        with_request(state=state, assets=[{"path": "assets/unused.png", "sha256": "1" * 64}]),
    ]
    records = reads(tmp_path, *good)
    assert [r.media[0].sha256 for r in records] == [digest] * 4
    assert records[1].assets[0].sha256 == digest
    problem = only_problem(
        tmp_path, with_request(state=state, assets=[{"path": "assets/light.png", "sha256": "0" * 64}])
    )
    assert problem.field == "request.state.messages[0].content[0].image_url.url"
    assert problem.message == f"the file's sha256 is {digest}, but assets lists {'0' * 64}"


def test_assets_entries_refused(tmp_path):
    path = write(
        tmp_path / "a.jsonl",
        seed(assets=None),
        seed(assets={"path": "a.png"}),
        seed(assets=["a.png"]),
        seed(assets=[{"path": "a.png"}]),
        seed(assets=[{"path": "a.png", "sha256": "abc"}]),
        seed(assets=[{"path": "a.png", "sha256": "0" * 64, "size": 3}]),
        seed(assets=[{"path": "", "sha256": "0" * 64}]),
        seed(assets=[{"path": "a.png", "sha256": "0" * 64}, {"path": "./a.png", "sha256": "1" * 64}]),
    )
    assert fields_of(path) == [
        (1, "assets"),
        (2, "assets"),
        (3, "assets[0]"),
        (4, "assets[0].sha256"),
        (5, "assets[0].sha256"),
        (6, "assets[0].size"),
        (7, "assets[0].path"),
        (8, "assets[1].sha256"),
    ]
    problems = problems_of(path)
    assert problems[0].message == "must be a list of {path, sha256} entries, got null; omit it or use []"
    assert problems[7].message == "assets[0] names the same file with another sha256"


# -- questions -------------------------------------------------------------------------------------


def test_questions_non_empty_mapping(tmp_path):
    path = write(
        tmp_path / "q.jsonl",
        with_request(questions=...),
        with_request(questions={}),
        with_request(questions=[]),
    )
    problems = problems_of(path)
    assert [(p.line, p.field) for p in problems] == [(n, "request.questions") for n in (1, 2, 3)]
    # targets naming questions of a missing mapping are not reported again as unknown ids
    assert all("mapping of question id" in p.message for p in problems)


def test_question_shape(tmp_path):
    noul = {"type": "noul", "instructions": "Is it?"}
    path = write(
        tmp_path / "q.jsonl",
        one_question("noul"),
        one_question({**noul, "weight": 2}),
        with_request(questions={"": noul}, targets={}),
        with_request(questions={" ": noul}, targets={}),
    )
    assert fields_of(path) == [
        (1, "request.questions.q"),
        (2, "request.questions.q.weight"),
        (3, 'request.questions[""]'),
        (4, 'request.questions[" "]'),
    ]


@pytest.mark.parametrize("kind", ["Choice", "NOUL", "Score"])
def test_type_lowercase_hint(tmp_path, kind):
    problem = only_problem(
        tmp_path, one_question({"type": kind, "instructions": "x", "criteria": ["a", "b"]})
    )
    assert problem.field == "request.questions.q.type"
    assert (
        problem.message
        == f'must be one of choice, noul, score; got "{kind}"; types are lowercase: "{kind.lower()}"'
    )


@pytest.mark.parametrize("kind", [None, "multi", 1, ...])
def test_type_required_and_known(tmp_path, kind):
    spec = {"instructions": "x"} if kind is ... else {"type": kind, "instructions": "x"}
    problem = only_problem(tmp_path, one_question(spec))
    assert (
        problem.field == "request.questions.q.type"
        and "must be one of choice, noul, score" in problem.message
    )


@pytest.mark.parametrize("instructions", ["", "   ", None, 3, ["Is it?"], ...])
def test_instructions_required_non_empty_string(tmp_path, instructions):
    spec = {"type": "noul"} if instructions is ... else {"type": "noul", "instructions": instructions}
    problem = only_problem(tmp_path, one_question(spec))
    assert problem.field == "request.questions.q.instructions"
    assert problem.message.startswith("required: a non-empty string, got ")


def test_choice_criteria_1_to_255(tmp_path):
    one = {f"c{i}": f"Candidate {i}" for i in range(1)}
    most = {f"c{i}": f"Candidate {i}" for i in range(255)}
    records = reads(
        tmp_path,
        one_question({"type": "choice", "instructions": "x", "criteria": one}, {"probabilities": {"c0": 1}}),
        one_question({"type": "choice", "instructions": "x", "criteria": most}),
    )
    assert records[0].targets == (Label({"c0": 1.0}, True, {}),)
    assert len(records[1].questions[0].candidates) == 255
    too_many = {f"c{i}": f"Candidate {i}" for i in range(256)}
    path = write(
        tmp_path / "c.jsonl",
        one_question({"type": "choice", "instructions": "x", "criteria": {}}),
        one_question({"type": "choice", "instructions": "x", "criteria": too_many}),
        one_question({"type": "choice", "instructions": "x"}),
        one_question({"type": "choice", "instructions": "x", "criteria": ["a", "b"]}),
    )
    problems = problems_of(path)
    assert [(p.line, p.field) for p in problems] == [
        (n, "request.questions.q.criteria") for n in (1, 2, 3, 4)
    ]
    assert problems[1].message.endswith("got an object with 256 entries")
    assert "object of 1 to 255 candidate names → descriptions" in problems[0].message


def test_choice_descriptions_and_names_non_empty(tmp_path):
    path = write(
        tmp_path / "c.jsonl",
        one_question(
            {"type": "choice", "instructions": "x", "criteria": {"a": "", "b": " ", "c": 3, "": "d"}}
        ),
    )
    assert fields_of(path) == [
        (1, "request.questions.q.criteria.a"),
        (1, "request.questions.q.criteria.b"),
        (1, "request.questions.q.criteria.c"),
        (1, 'request.questions.q.criteria[""]'),
    ]


def test_score_criteria_2_to_10(tmp_path):
    records = reads(
        tmp_path,
        one_question(
            {"type": "score", "instructions": "x", "criteria": ["low", "high"]},
            {"probabilities": {"0": 0.25, "1": 0.75}},
        ),
        one_question({"type": "score", "instructions": "x", "criteria": [f"g{k}" for k in range(10)]}),
    )
    assert records[0].questions[0].candidates == (("0", "low"), ("1", "high"))
    assert records[1].questions[0].keys == tuple(str(k) for k in range(10))
    path = write(
        tmp_path / "s.jsonl",
        one_question({"type": "score", "instructions": "x", "criteria": ["only"]}),
        one_question({"type": "score", "instructions": "x", "criteria": [f"g{k}" for k in range(11)]}),
        one_question({"type": "score", "instructions": "x", "criteria": {"0": "a", "1": "b"}}),
        one_question({"type": "score", "instructions": "x", "criteria": ["a", "", 3]}),
    )
    assert fields_of(path) == [
        (1, "request.questions.q.criteria"),
        (2, "request.questions.q.criteria"),
        (3, "request.questions.q.criteria"),
        (4, "request.questions.q.criteria[1]"),
        (4, "request.questions.q.criteria[2]"),
    ]


def test_noul_criteria_ignored(tmp_path):
    records = reads(
        tmp_path,
        one_question({"type": "noul", "instructions": "Is it?"}),
        one_question({"type": "noul", "instructions": "Is it?", "criteria": {"yes": "Yes"}}),
        one_question({"type": "noul", "instructions": "Is it?", "criteria": None}),
    )
    assert {r.questions[0].candidates for r in records} == {NOUL_CANDIDATES}


# -- targets and labels ----------------------------------------------------------------------------


def test_targets_optional_and_empty(tmp_path):
    records = reads(tmp_path, seed(targets=...), seed(targets={}))
    assert all(r.targets == (None, None, None) and r.labeled == 0 for r in records)


def test_targets_null_refused_with_hint(tmp_path):
    problem = only_problem(tmp_path, seed(targets=None))
    assert (problem.field, problem.message) == (
        "targets",
        "null is not allowed; omit targets or use {} when a record has no labels",
    )
    assert only_problem(tmp_path, seed(targets=[])).field == "targets"


def test_unknown_question_ids_refused(tmp_path):
    targets = {**SEED["targets"], "colour": {"probabilities": {"red": 1.0}}}
    problem = only_problem(tmp_path, seed(targets=targets))
    assert (problem.field, problem.message) == (
        "targets.colour",
        "unknown question id; the questions are color, go, risk",
    )


def test_unlabeled_forms(tmp_path):
    targets = {"color": None, "go": {}, "risk": {"probabilities": None, "label_source": "pending"}}
    (rec,) = reads(tmp_path, seed(targets=targets))
    assert rec.targets == (None, None, None) and rec.labeled == 0
    (rec,) = reads(tmp_path, seed(targets={"go": SEED["targets"]["go"]}))  # omitted targets
    assert rec.targets[0] is None and rec.targets[2] is None and rec.labeled == 1


def test_target_shapes_refused(tmp_path):
    path = write(
        tmp_path / "t.jsonl",
        seed(targets={"go": [1.0, 0.0]}),
        seed(targets={"go": {"probabilities": [1.0, 0.0]}}),
        seed(targets={"go": {"probabilities": 1}}),
    )
    assert fields_of(path) == [
        (1, "targets.go"),
        (2, "targets.go.probabilities"),
        (3, "targets.go.probabilities"),
    ]


def test_probabilities_cover_exactly_the_candidate_keys(tmp_path):
    path = write(
        tmp_path / "k.jsonl",
        seed(targets={"color": {"probabilities": {"red": 0.0, "green": 1.0}}}),
        seed(targets={"color": {"probabilities": {"red": 0.0, "green": 1.0, "unknown": 0.0, "blue": 0.0}}}),
        seed(targets={"go": {"probabilities": {"yes": 1.0, "no": 0.0}}}),
        seed(targets={"risk": {"probabilities": {"1": 1.0, "2": 0.0, "3": 0.0}}}),
    )
    problems = problems_of(path)
    assert [(p.line, p.field, p.message) for p in problems] == [
        (
            1,
            "targets.color.probabilities",
            'missing "unknown"; probabilities must cover every candidate (candidates are red, green, unknown)',
        ),
        (
            2,
            "targets.color.probabilities.blue",
            "not a candidate of this question; candidates are red, green, unknown",
        ),
        (
            3,
            "targets.go.probabilities.yes",
            'not a candidate of this question; label keys are "true" and "false"',
        ),
        (
            3,
            "targets.go.probabilities.no",
            'not a candidate of this question; label keys are "true" and "false"',
        ),
        (
            3,
            "targets.go.probabilities",
            'missing "true", "false"; probabilities must cover every candidate (label keys are "true" and "false")',
        ),
        (
            4,
            "targets.risk.probabilities.3",
            'not a candidate of this question; score label keys are "0" to "2"',
        ),
        (
            4,
            "targets.risk.probabilities",
            'missing "0"; probabilities must cover every candidate (score label keys are "0" to "2")',
        ),
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1e400", "the number 1e400 is too large for a 64-bit float (it would read as Infinity, which is not JSON)"),
        ("1" + "0" * 400, "must be a finite number, got 1000000000000000000000000000000000000000…"),
        ("-0.5", "must be >= 0, got -0.5"),
        ('"1.0"', 'must be a number, got "1.0"'),
        ("true", "must be a number, got true"),
        ("null", "must be a number, got null"),
        ("[1.0]", "must be a number, got a list"),
    ],
)
def test_probability_values_finite_non_negative_numbers(tmp_path, value, message):
    line = json.dumps(seed(targets={})).replace(
        '"targets": {}', '"targets": {"go": {"probabilities": {"true": ' + value + ', "false": 0.0}}}'
    )
    problem = only_problem(tmp_path, line)
    assert (problem.field, problem.message) == ("targets.go.probabilities.true", message)


def test_nan_and_infinity_never_reach_a_label(tmp_path):
    for token in ("NaN", "Infinity", "-Infinity"):
        line = json.dumps(seed(targets={})).replace(
            '"targets": {}', '"targets": {"go": {"probabilities": {"true": ' + token + ', "false": 0.0}}}'
        )
        assert only_problem(tmp_path, line).message == f"invalid JSON: {token} is not JSON"


def test_probabilities_sum_to_one_within_1e_6(tmp_path):
    def go(true: float, false: float) -> dict:
        return seed(targets={"go": {"probabilities": {"true": true, "false": false}}})

    records = reads(tmp_path, go(0.7, 0.3), go(1 - 9e-7, 0.0), go(0.5, 0.5 + 9e-7), go(1, 0))
    assert [r.target("go").is_hard for r in records] == [False, False, False, True]
    assert records[3].target("go").probabilities == {"true": 1.0, "false": 0.0}
    path = write(
        tmp_path / "sum.jsonl", go(0.7, 0.2), go(1 - 2e-6, 0.0), go(1.0, 1.0), go(0.0, 0.0), go(1.5, -0.5)
    )
    problems = problems_of(path)
    assert [(p.line, p.field) for p in problems] == [
        (1, "targets.go.probabilities"),
        (2, "targets.go.probabilities"),
        (3, "targets.go.probabilities"),
        (4, "targets.go.probabilities"),
        (5, "targets.go.probabilities.false"),
    ]
    assert problems[0].message == "sums to 0.8999999999999999; probabilities must sum to 1 (abs_tol=1e-6)"


def test_labels_follow_candidate_order_and_keep_extra_fields(tmp_path):
    votes = {"unknown": 1, "green": 3}
    target = {
        "probabilities": {"unknown": 0.25, "green": 0.75, "red": 0},
        "label_source": "annotators",
        "votes": votes,
    }
    (rec,) = reads(tmp_path, seed(targets={"color": target}))
    label = rec.target("color")
    assert list(label.probabilities) == ["red", "green", "unknown"]  # criteria order, not the label's
    assert label == Label(
        {"red": 0.0, "green": 0.75, "unknown": 0.25}, False, {"label_source": "annotators", "votes": votes}
    )


def test_labels_of_a_broken_question_are_not_reported_twice(tmp_path):
    record = seed()
    record["request"]["questions"]["color"]["criteria"] = {}
    problem = only_problem(tmp_path, record)
    assert problem.field == "request.questions.color.criteria"


def test_problems_with_odd_characters_print(tmp_path):
    line = json.dumps(seed(extra="x")).replace('"extra"', '"\\ud800 x"')
    problem = only_problem(tmp_path, line)
    assert problem.field == '["\\ud800 x"]'
    str(problem).encode("utf-8")  # a lone surrogate is escaped, so printing cannot fail


# -- the command line ------------------------------------------------------------------------------


def test_validate_cli(tmp_path, capsys, monkeypatch):
    from data_pipeline.validate import main

    monkeypatch.chdir(tmp_path)
    write(tmp_path / "good.jsonl", SEED, seed(targets={}))
    write(tmp_path / "bad.jsonl", SEED, seed(targets=None))
    assert main(["--format=valen", "good.jsonl"]) == 0
    assert capsys.readouterr().out == "good.jsonl: 2 records, 6 questions, 3 labeled OK\n"
    assert main(["--format=valen", "good.jsonl", "bad.jsonl"]) == 1
    assert capsys.readouterr().err == (
        "bad.jsonl:2: targets: null is not allowed; omit targets or use {} when a record has no labels\n"
    )


# -- the bad-input corpus: each file with the exact problem lines it must give ---------------------

BAD_INPUTS = Path(__file__).parent / "bad_inputs" / "valen"
# `{folder}` stands for the corpus folder's absolute path (messages about missing files name it).
EXPECTED = json.loads((BAD_INPUTS / "expected.json").read_text(encoding="utf-8"))


def test_bad_input_corpus_lists_every_file():
    assert sorted(EXPECTED) == sorted(p.name for p in BAD_INPUTS.glob("*.jsonl"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input(name, monkeypatch):
    monkeypatch.chdir(BAD_INPUTS)  # problems name the path as given: the bare file name
    with pytest.raises(FormatError) as info:
        read_valen(Path(name))
    folder = str(BAD_INPUTS.resolve())
    assert [str(p) for p in info.value.problems] == [
        line.replace("{folder}", folder) for line in EXPECTED[name]
    ]
