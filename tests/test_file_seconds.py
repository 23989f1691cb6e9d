"""tests/file_seconds.py: the per-file seconds the conftest orders the suite by (heaviest first)."""

from __future__ import annotations

from tests.scripts import ROOT, load_script


def _module():
    return load_script("tests/file_seconds.py")


def test_a_junit_report_sums_into_seconds_per_file_heaviest_first(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_a" name="x" time="1.5"/>'
        '<testcase classname="tests.test_b.TestGroup" name="y" time="4.0"/>'
        '<testcase classname="tests.test_a" name="z" time="2.25"/>'
        '<testcase classname="conftest" name="setup" time="9"/>'
        '</testsuite></testsuites>')
    seconds = _module().file_seconds(junit)
    assert seconds == {"tests/test_b.py": 4.0, "tests/test_a.py": 3.8}
    assert list(seconds) == ["tests/test_b.py", "tests/test_a.py"]


def test_a_run_of_some_files_replaces_theirs_and_keeps_the_others():
    table = {"_source": "measured by tests/file_seconds.py from all.xml", "tests/test_a.py": 9.0,
             "tests/test_heavy.py": 50.0, "tests/test_b.py": 1.0}
    merged = _module().merged(table, {"tests/test_b.py": 20.0, "tests/test_a.py": 2.0}, "fast.xml")
    assert list(merged) == ["_source", "tests/test_heavy.py", "tests/test_b.py", "tests/test_a.py"]
    assert merged["tests/test_b.py"] == 20.0 and merged["tests/test_a.py"] == 2.0
    assert merged["_source"] == ("measured by tests/file_seconds.py from fast.xml; 1 file(s) it did not run keep "
                                 "their earlier figures")
    assert _module().merged({}, {"tests/test_a.py": 1.0}, "x.xml")["_source"].endswith("from x.xml")


def test_the_committed_table_names_files_that_exist():
    import json

    table = json.loads((ROOT / "tests" / "file_seconds.json").read_text())
    missing = [name for name in table if not name.startswith("_") and not (ROOT / name).is_file()]
    assert not missing, missing
