"""`python -m data_pipeline.validate` as users and checks call it (DESIGN, "Contracts")."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.train_runs import warm_runner

REPO = Path(__file__).resolve().parents[1]
GOOD = {
    "image": "a.png",
    "conversations": [
        {"from": "human", "value": "<image>cup"},
        {"from": "gpt", "value": "<point><1><2></point>"},
    ],
}
BAD_ANSWER = {
    **GOOD,
    "conversations": [GOOD["conversations"][0], {"from": "gpt", "value": "<point><1></point>"}],
}


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return warm_runner().run("data_pipeline.validate", list(args), cwd=cwd, timeout=60)


@pytest.fixture
def files(tmp_path, make_png) -> Path:
    make_png("a.png")
    (tmp_path / "good.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(BAD_ANSWER) + "\n")
    (tmp_path / "recipe.json").write_text(json.dumps({"good": {"annotation": "good.jsonl"}}))
    (tmp_path / "bad_recipe.json").write_text(
        json.dumps({"x": {"annotation": "bad.jsonl", "repeat_time": 0}})
    )
    return tmp_path


def test_vflash_ok_prints_summary(files):
    result = run("--format=vflash", "good.jsonl", cwd=files)
    assert (result.returncode, result.stdout, result.stderr) == (0, "good.jsonl: 2 records OK\n", "")


def test_vflash_problems_exit_1_with_path_line_field(files):
    result = run("--format=vflash", "good.jsonl", "bad.jsonl", cwd=files)
    assert result.returncode == 1
    assert result.stdout == "good.jsonl: 2 records OK\n"
    assert result.stderr.splitlines() == [
        "bad.jsonl:2: conversations[1].value: at char 0: <point> needs 2 numbers (x, y), got 1"
    ]


@pytest.mark.slow
def test_json_output(files):
    result = run("--format=vflash", "bad.jsonl", "--json", cwd=files)
    assert result.returncode == 1 and result.stderr == ""
    assert json.loads(result.stdout) == [
        {
            "path": "bad.jsonl",
            "line": 2,
            "field": "conversations[1].value",
            "message": "at char 0: <point> needs 2 numbers (x, y), got 1",
        }
    ]
    ok = run("--format=vflash", "good.jsonl", "--json", cwd=files)
    assert (ok.returncode, json.loads(ok.stdout)) == (0, [])


@pytest.mark.slow
def test_recipe_validates_entries_and_annotations(files):
    ok = run("--format=recipe", "recipe.json", cwd=files)
    assert (ok.returncode, ok.stdout) == (0, "recipe.json: 1 entries, 2 records OK\n")
    bad = run("--format=recipe", "bad_recipe.json", cwd=files)
    assert bad.returncode == 1
    assert bad.stderr.splitlines() == ["bad_recipe.json:1: x.repeat_time: must be a finite number > 0, got 0"]


def test_recipe_reports_annotation_problems_by_their_path(files):
    (files / "r2.json").write_text(json.dumps({"x": {"annotation": "bad.jsonl"}}))
    result = run("--format=recipe", "r2.json", cwd=files)
    assert result.returncode == 1
    assert result.stderr.startswith(f"{(files / 'bad.jsonl').resolve()}:2: conversations[1].value: ")


@pytest.mark.slow
def test_missing_media_and_no_check_media(files):
    (files / "a.png").unlink()
    result = run("--format=vflash", "good.jsonl", cwd=files)
    assert result.returncode == 1 and result.stderr.startswith("good.jsonl:1: image: file not found")
    assert run("--format=vflash", "--no-check-media", "good.jsonl", cwd=files).returncode == 0


def test_missing_file(files):
    result = run("--format=vflash", "absent.jsonl", cwd=files)
    assert (result.returncode, result.stderr) == (1, "absent.jsonl:0: file: no such file\n")


def test_every_format_of_the_contract_has_a_validator():
    from data_pipeline.format_registry import FORMATS

    assert set(FORMATS) == {"valen", "vflash", "recipe", "chat", "vakforge", "prepared"}
    assert all(callable(spec.validate) for spec in FORMATS.values())


def test_unknown_format_is_a_usage_error(files):
    result = run("--format=csv", "good.jsonl", cwd=files)
    assert result.returncode == 2 and "invalid choice" in result.stderr
