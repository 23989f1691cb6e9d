"""Control characters in media paths (issue 27): a NUL or a newline in a path a data file names is a
`PATH:LINE: field: message` problem of every reader, printed escaped so one problem stays one line; the
readers crashed with "ValueError: embedded null byte" (vflash, chat, valen) or echoed the raw bytes (vakforge).
The commands' own rows (train, evaluate, validate on such data) are in tests/test_cli_errors.py."""

from __future__ import annotations

import json
import shutil

import pytest

from data_pipeline.cli_paths import escaped
from data_pipeline.formats.errors import Problem
from data_pipeline.validate import validate
from tests.train_runs import ROOT

SMOKE = ROOT / "data" / "smoke"
BAD_NAMES = ("a\x00b.png", "a\nb.png", "a\rb.png", "a\x1bb.png")


def _vflash(folder, name):
    record = {"image": name, "conversations": [{"from": "human", "value": "<image>\nWhere?"},
                                               {"from": "gpt", "value": "here"}]}
    return record, "vflash", "image"


def _chat(folder, name):
    record = {"messages": [{"role": "user", "content": [{"type": "image", "path": name}, {"type": "text", "text": "hi"}]},
                           {"role": "assistant", "content": "x"}]}
    return record, "chat", "messages[0].content[0].path"


def _valen(folder, name):
    for line in (SMOKE / "valen" / "train.jsonl").read_text().splitlines():
        record = json.loads(line)
        for i, part in enumerate(record["request"]["state"].get("messages", [{}])[0].get("content", [])
                                 if isinstance(record["request"]["state"], dict) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                part["image_url"]["url"] = name
                return record, "valen", f"request.state.messages[0].content[{i}].image_url.url"
    raise AssertionError("no smoke Valen record with an image")


def _vakforge(folder, name):
    shutil.copytree(SMOKE / "vakforge", folder, dirs_exist_ok=True)
    record = json.loads((SMOKE / "vakforge" / "vakforge.jsonl").read_text().splitlines()[0])
    record["audio"]["path"] = name
    return record, "vakforge", f"id={record['id']}: audio.path"


@pytest.mark.parametrize("make", [_vflash, _chat, _valen, _vakforge], ids=lambda m: m.__name__[1:])
@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_control_character_in_a_media_path_is_one_escaped_problem(tmp_path, make, name):
    record, fmt, field = make(tmp_path / "ds", name)
    (tmp_path / "ds").mkdir(exist_ok=True)
    data = tmp_path / "ds" / ("vakforge.jsonl" if fmt == "vakforge" else "rows.jsonl")
    data.write_text(json.dumps(record) + "\n")
    _, problems = validate(fmt, [str(data)])
    mine = [p for p in problems if p.field == field]
    assert len(mine) == 1, [str(p) for p in problems]
    line = str(mine[0])
    assert line.startswith(f"{data}:1: {field}: ") and "holds the control character" in line
    assert repr(name) in line and "\n" not in line and "\r" not in line and "\x00" not in line


def test_a_problem_prints_every_control_character_escaped_and_the_rest_as_it_is():
    problem = Problem("dir\n/ro\tws.jsonl", 3, "image", "bad\x00name 红")
    assert str(problem) == "dir\\n/ro\\tws.jsonl:3: image: bad\\x00name 红"
    assert escaped("plain/path 红.png") == "plain/path 红.png"
