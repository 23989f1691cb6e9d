"""VFlash JSONL reader (seed 004, "Data Format"): each rule with a passing and a failing record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipeline.formats.errors import FormatError, Problem
from data_pipeline.formats.vflash import MediaRef, VFlashTurn, read_vflash

ROBOT_ANSWER = (
    "<action>Pull the drawer open.</action>"
    '<tool_call>{"name":"atomic_decoding","arguments":{"block_size":32}}</tool_call>'
    "<robot_single><521><489><61><520><488><64><518><487><67><517><485><70><516><483><73><515><480><76>"
    "<513><478><78><512><475><80><510><473><83><509><470><85></robot>"
)
BOXES = "<ref>cup</ref><objects><box><102><340><218><505></box><box><640><322><731><480></box></objects>"
NO_BOX = "<ref>dog</ref><objects>None</objects>"
POINT = "<point><218><365></point>"


def conv(*pairs: str) -> list[dict[str, str]]:
    roles = ("human", "gpt")
    return [{"from": roles[i % 2], "value": v} for i, v in enumerate(pairs)]


def record(image: object = "img.png", *values: str, **extra: object) -> dict:
    values = values or ("<image>\nPoint at the cup.", POINT)
    out = (
        {"image": image, "conversations": conv(*values)}
        if image is not None
        else {"conversations": conv(*values)}
    )
    out.update(extra)
    return out


def write(path: Path, *rows: object) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def problems_of(path: Path, **kwargs) -> list[Problem]:
    with pytest.raises(FormatError) as info:
        read_vflash(path, **kwargs)
    return list(info.value.problems)


def fields_of(path: Path, **kwargs) -> list[tuple[int, str]]:
    return [(p.line, p.field) for p in problems_of(path, **kwargs)]


@pytest.fixture
def img(make_png):
    return make_png("img.png")


# -- a full record --------------------------------------------------------------------------------------


def test_seed_robot_record_reads(tmp_path, make_png):
    video = tmp_path / "videos" / "episode_000042.mp4"
    video.parent.mkdir()
    video.write_bytes(b"not decoded by the validator")
    path = write(
        tmp_path / "robot.jsonl",
        {
            "image": [{"video": "videos/episode_000042.mp4", "frame_index": 120}],
            "conversations": conv("<image>\nThe input image shows the current scene.", ROBOT_ANSWER),
            "atom_loss_masks": ["1" * 30],
            "id": "ep42",
        },
    )
    (rec,) = read_vflash(path)
    assert rec.source == str(path) and rec.line == 1 and rec.record_id == "ep42"
    assert rec.media == (MediaRef("video_frame", video.resolve(), frame_index=120, written="videos/episode_000042.mp4"),)
    assert rec.turns[1] == VFlashTurn("gpt", ROBOT_ANSWER)
    assert rec.primitives[0] == () and rec.primitives[1][0].kind == "robot_single"
    assert rec.calls[1][0].block_size == 32
    assert rec.atom_loss_masks == ("1" * 30,)


def test_multi_turn_boxes_record(tmp_path, img):
    path = write(tmp_path / "b.jsonl", record("img.png", "<image>\nFind cup.", BOXES, "Find dog.", NO_BOX))
    (rec,) = read_vflash(path)
    assert [len(p) for p in rec.primitives] == [0, 2, 0, 1] and rec.atom_loss_masks is None


# -- file level ----------------------------------------------------------------------------------------


def test_blank_lines_ignored_and_line_numbers_kept(tmp_path, img):
    path = write(tmp_path / "a.jsonl", record(), "", "   ", record())
    assert [r.line for r in read_vflash(path)] == [1, 4]


def test_empty_and_missing_files_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert problems_of(empty) == [Problem(str(empty), 0, "file", "empty file: no records")]
    assert problems_of(tmp_path / "nope.jsonl")[0].message == "no such file"


def test_bad_lines_are_all_reported(tmp_path, img):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        json.dumps(record()).encode()
        + b"\n"
        + b'{"conversations": \xff}\n'
        + b"{not json\n"
        + b"[1, 2]\n"
        + b'{"image": "img.png", "image": "img.png", "conversations": []}\n'
    )
    problems = problems_of(path)
    assert [(p.line, p.field) for p in problems] == [
        (2, "record"),
        (3, "record"),
        (4, "record"),
        (5, "record"),
    ]
    assert "not UTF-8" in problems[0].message and "invalid JSON" in problems[1].message
    assert "JSON object" in problems[2].message and "duplicate key 'image'" in problems[3].message


def test_unknown_top_level_keys_refused(tmp_path, img):
    path = write(tmp_path / "a.jsonl", record(meta={"x": 1}), record(video="v.mp4"), record(id=True))
    assert fields_of(path) == [(1, "meta"), (2, "video"), (3, "id")]


# -- conversations --------------------------------------------------------------------------------------


def test_conversation_shape(tmp_path, img):
    path = write(
        tmp_path / "c.jsonl",
        {"image": "img.png"},
        {"image": "img.png", "conversations": []},
        {"image": "img.png", "conversations": [{"from": "gpt", "value": "<image>" + POINT}]},
        record("img.png", "<image>a", POINT, "b"),
        {
            "image": "img.png",
            "conversations": [{"from": "human", "value": "<image>"}, {"from": "human", "value": "x"}],
        },
        {
            "image": "img.png",
            "conversations": [{"from": "user", "value": "<image>"}, {"from": "gpt", "value": "x"}],
        },
        {
            "image": "img.png",
            "conversations": [{"from": "human", "value": ["<image>"]}, {"from": "gpt", "value": "x"}],
        },
        {
            "image": "img.png",
            "conversations": [
                {"from": "human", "value": "<image>", "loss": 1},
                {"from": "gpt", "value": "x"},
            ],
        },
        {"image": "img.png", "conversations": ["<image>", {"from": "gpt", "value": "x"}]},
    )
    assert fields_of(path) == [
        (1, "conversations"),
        (2, "conversations"),
        (3, "conversations[0].from"),
        (3, "conversations[0].value"),  # <image> in a gpt turn
        (3, "conversations"),  # odd number of turns; no knock-on placeholder count problem
        (4, "conversations"),
        (5, "conversations[1].from"),
        (6, "conversations[0].from"),
        (7, "conversations[0].value"),
        (8, "conversations[0].loss"),
        (9, "conversations[0]"),
    ]


def test_primitive_error_names_turn_and_offset(tmp_path, img):
    path = write(tmp_path / "p.jsonl", record("img.png", "<image>x", "See <point><1></point>"))
    (problem,) = problems_of(path)
    assert (problem.line, problem.field) == (1, "conversations[1].value")
    assert problem.message == "at char 4: <point> needs 2 numbers (x, y), got 1"


# -- media -----------------------------------------------------------------------------------------------


def test_every_media_form_reads(tmp_path, make_png):
    a, b = make_png("a.png"), make_png("sub/b.png")
    (tmp_path / "clip.mp4").write_bytes(b"\0")
    (tmp_path / "frames.lmdb").mkdir()
    image = [
        "a.png",
        str(b),
        {"file": "sub/b.png", "resize": [8, 6]},
        {"video": "clip.mp4", "frame_index": 0},
        {"lmdb_file": "frames.lmdb", "lmdb_key": "000001", "resize": [4, 4]},
    ]
    path = write(tmp_path / "m.jsonl", record(image, "<image>" * 5 + " look", "ok"))
    # str(b) is absolute: read only with the option (issue 19), refused by default.
    (problem,) = problems_of(path)
    assert problem.field == "image[1]" and "is absolute" in problem.message
    (rec,) = read_vflash(path, allow_absolute_media=True)
    assert rec.media == (
        MediaRef("path", a.resolve(), written="a.png"),
        MediaRef("path", b.resolve(), written=str(b)),
        MediaRef("file", b.resolve(), resize=(8, 6), written="sub/b.png"),
        MediaRef("video_frame", (tmp_path / "clip.mp4").resolve(), frame_index=0, written="clip.mp4"),
        MediaRef("lmdb", (tmp_path / "frames.lmdb").resolve(), lmdb_key="000001", resize=(4, 4),
                 written="frames.lmdb"),
    )
    single = write(tmp_path / "s.jsonl", record({"file": "a.png"}))
    assert read_vflash(single)[0].media == (MediaRef("file", a.resolve(), written="a.png"),)


def test_media_references_refused(tmp_path, img):
    (tmp_path / "clip.mp4").write_bytes(b"\0")
    path = write(
        tmp_path / "m.jsonl",
        record("http://example.com/a.png"),
        record("missing.png"),
        record({"file": "img.png", "crop": [1, 2]}),
        record({"video": "clip.mp4"}),
        record({"video": "clip.mp4", "frame_index": -1}),
        record({"lmdb_file": "img.png"}),
        record({"file": "img.png", "resize": [0, 4]}),
        record({"file": "img.png", "video": "clip.mp4"}),
        record([], "hello", "ok"),
        record([["img.png"]]),
        record(""),
        record("."),  # a folder, not a file
    )
    assert fields_of(path) == [
        (1, "image"),
        (2, "image"),
        (3, "image.crop"),
        (4, "image.frame_index"),
        (5, "image.frame_index"),
        (6, "image.lmdb_key"),
        (7, "image.resize"),
        (8, "image"),  # two sources in one object
        (9, "image"),  # empty list
        (10, "image[0]"),
        (11, "image"),
        (12, "image"),
    ]
    messages = {p.line: p.message for p in problems_of(path)}
    assert "URL" in messages[1] and "file not found" in messages[2] and "unknown key" in messages[3]
    assert "not a file" in messages[12]


def test_check_media_off_and_media_root(tmp_path, make_png):
    path = write(tmp_path / "m.jsonl", record("missing.png"))
    assert read_vflash(path, check_media=False)[0].media[0].path == (tmp_path / "missing.png").resolve()
    media = tmp_path / "media"
    make_png("media/img.png")
    path = write(tmp_path / "r.jsonl", record("img.png"))
    assert read_vflash(path, media_root=media)[0].media[0].path == (media / "img.png").resolve()
    assert fields_of(path) == [(1, "image")]  # without the root it resolves next to the JSONL


def test_placeholder_count_must_match_media(tmp_path, img):
    path = write(
        tmp_path / "m.jsonl",
        record(["img.png", "img.png"], "<image>\nTwo views <image>", "ok"),
        record(["img.png", "img.png"], "<image> only one", "ok"),
        record(None, "<image> no media", "ok"),
        record(None, "text only", "ok"),
    )
    assert fields_of(path) == [(2, "image"), (3, "image")]
    assert problems_of(path)[0].message == "1 <image> placeholder(s) in human turns but 2 media item(s)"


# -- atom_loss_masks ------------------------------------------------------------------------------------


def test_atom_loss_masks_match_coordinate_primitives(tmp_path, img):
    ok = record(
        "img.png", "<image>cup", BOXES, "dog", NO_BOX, "pt", POINT, atom_loss_masks=["1111", "0110", "10"]
    )
    path = write(tmp_path / "ok.jsonl", ok)
    assert read_vflash(path)[0].atom_loss_masks == ("1111", "0110", "10")


def test_atom_loss_masks_refused(tmp_path, img):
    path = write(
        tmp_path / "bad.jsonl",
        record(atom_loss_masks="11"),
        record(atom_loss_masks=["11", "11"]),
        record(atom_loss_masks=["111"]),
        record(atom_loss_masks=["1a"]),
        record(atom_loss_masks=[11]),
    )
    assert fields_of(path) == [
        (1, "atom_loss_masks"),
        (2, "atom_loss_masks"),
        (3, "atom_loss_masks[0]"),
        (4, "atom_loss_masks[0]"),
        (5, "atom_loss_masks[0]"),
    ]
    messages = [p.message for p in problems_of(path)]
    assert messages[1] == "2 mask(s) for 1 primitive(s) with coordinates in the gpt turns"
    assert "has 2 coordinate tokens" in messages[2]


def test_problems_are_capped_like_every_other_reader(tmp_path):
    from data_pipeline.formats.errors import PROBLEM_CAP
    from data_pipeline.formats.vflash import read_vflash

    path = tmp_path / "many.jsonl"
    path.write_text("[1]\n" * (PROBLEM_CAP + 5))
    with pytest.raises(FormatError) as info:
        read_vflash(path)
    problems = info.value.problems
    assert len(problems) == PROBLEM_CAP + 1 and [p.line for p in problems[:3]] == [1, 2, 3]
    assert problems[-1].message == "… 5 more problems not shown"
