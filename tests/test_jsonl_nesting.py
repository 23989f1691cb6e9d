"""One nesting limit for every Python: 3.11/3.12's C scanner stops near the recursion limit, 3.13's
parses far deeper, so without `MAX_NESTING` the same line got a different error per version."""

import pytest

from data_pipeline.formats.jsonl import MAX_NESTING, loads_strict, read_jsonl_objects


def nested(depth: int) -> str:
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def test_the_limit_itself_parses_and_one_more_is_refused():
    assert isinstance(loads_strict(nested(MAX_NESTING)), dict)
    with pytest.raises(ValueError, match="nested too deeply"):
        loads_strict(nested(MAX_NESTING + 1))


def test_brackets_inside_strings_do_not_count():
    text = '{"a": "' + "[" * (3 * MAX_NESTING) + '"}'
    assert loads_strict(text) == {"a": "[" * (3 * MAX_NESTING)}


def test_the_reader_names_the_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"ok": 1}\n' + nested(MAX_NESTING + 1) + "\n")
    problems = []
    assert read_jsonl_objects(path, str(path), problems) == [(1, {"ok": 1})]
    assert len(problems) == 1 and problems[0].line == 2 and "nested too deeply" in problems[0].message
