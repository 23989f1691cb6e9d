"""Prepared token rows, their descriptor and zip (seed 003, "Prepared token rows")."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from data_pipeline import prepared as prepared_cli
from data_pipeline.formats import prepared_rows
from data_pipeline.formats.errors import FormatError, Problem
from data_pipeline.formats.prepared import (
    PreparedDescriptor,
    PreparedFile,
    check_against_tokenizer,
    check_max_seq_length,
    file_sha256,
    parse_descriptor,
    read_prepared,
    write_prepared_zip,
)
from data_pipeline.formats.prepared_load import read_descriptor
from data_pipeline.formats.prepared_rows import FileStats, scan_rows
from data_pipeline.tokenizer import fingerprint

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizer"
COMMIT = "ee0ef6023621cff504d758262d4e04895a5af4a2"
GOOD_IDS = [[5, 6, 7, 8], [9, 10, 11]]
GOOD_MASKS = [[0, 0, 1, 1], [0, 1, 1]]


@pytest.fixture(scope="module")
def shipped():
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


def parquet(path: Path, ids: list, masks: list, types: tuple = (pa.int32(), pa.int8()), **extra) -> Path:
    table = pa.table(
        {
            "input_ids": pa.array(ids, pa.list_(types[0])),
            "loss_mask": pa.array(masks, pa.list_(types[1])),
            **extra,
        }
    )
    pq.write_table(table, path)
    return path


def descriptor_for(files: list[Path], tokenizer) -> PreparedDescriptor:
    entries = []
    for path in files:
        stats, problems = scan_rows(path, str(path))
        assert not problems
        entries.append(PreparedFile(path.name, file_sha256(path), stats))
    fp = fingerprint(tokenizer)
    return PreparedDescriptor(
        "org/model", COMMIT, fp.tokenizer_sha256, fp.chat_template_sha256, tuple(entries)
    )


@pytest.fixture
def good_zip(tmp_path, shipped) -> Path:
    files = [
        parquet(tmp_path / "train.parquet", GOOD_IDS, GOOD_MASKS),
        parquet(tmp_path / "more.parquet", [[1, 2]], [[0, 1]]),
    ]
    out = tmp_path / "train.zip"
    write_prepared_zip(descriptor_for(files, shipped), files, out)
    return out


def problems_of(call, *args) -> list[Problem]:
    with pytest.raises(FormatError) as info:
        call(*args)
    return list(info.value.problems)


def rewrite_zip(src: Path, dst: Path, replace: dict[str, bytes | None]) -> Path:
    """A copy of `src` with members replaced (None drops one; a new name adds one)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if info.filename in replace:
                data = replace.pop(info.filename)
                if data is not None:
                    zout.writestr(info.filename, data)
            else:
                zout.writestr(info.filename, zin.read(info.filename))
        for name, data in replace.items():
            zout.writestr(name, data)
    return dst


# -- rows -------------------------------------------------------------------------------------------


def test_counts_of_good_rows_and_other_columns_ignored(tmp_path):
    path = parquet(tmp_path / "a.parquet", GOOD_IDS, GOOD_MASKS, note=pa.array(["x", None]))
    assert scan_rows(path, "a.parquet") == (
        FileStats(rows=2, tokens=7, supervised_tokens=4, longest_row=4),
        [],
    )


@pytest.mark.parametrize(
    ("ids", "masks", "field", "message"),
    [
        ([1, 2, 3], [0, 1], "loss_mask", "2 values but input_ids has 3"),
        ([1, 2, 3], [0, 2, 1], "loss_mask", "2 at position 1; a loss mask holds 0 or 1"),
        ([1, 2, 3], [0, -1, 1], "loss_mask", "-1 at position 1; a loss mask holds 0 or 1"),
        ([1, 2, 3], [1, 1, 1], "loss_mask", "the first token is marked, but no token predicts it"),
        ([1, 2, 3], [0, 0, 0], "loss_mask", "no token is marked; every row marks at least one token"),
        ([1, -4, 3], [0, 1, 1], "input_ids", "-4 at position 1 is not a token id (0 to 2^31-1)"),
        ([1, 2**31, 3], [0, 1, 1], "input_ids", "2147483648 at position 1 is not a token id (0 to 2^31-1)"),
        ([1, None, 3], [0, 1, 1], "input_ids", "null token id at position 1"),
        ([1, 2, 3], [0, None, 1], "loss_mask", "null at position 1"),
        (None, [0, 1], "input_ids", "null; every row holds a list"),
        ([1, 2], None, "loss_mask", "null; every row holds a list"),
        ([], [], "input_ids", "an empty row"),
    ],
)
def test_each_row_rule(tmp_path, ids, masks, field, message):
    path = parquet(tmp_path / "a.parquet", [[5, 6], ids], [[0, 1], masks], types=(pa.int64(), pa.int64()))
    stats, problems = scan_rows(path, "a.parquet")
    assert problems == [Problem("a.parquet", 2, field, message)]
    assert stats is not None and stats.rows == 2


def test_a_row_can_break_several_rules(tmp_path):
    path = parquet(tmp_path / "a.parquet", [[1, -2, 3]], [[1, 0]], types=(pa.int64(), pa.int64()))
    assert [p.message for p in scan_rows(path, "a")[1]] == [
        "-2 at position 1 is not a token id (0 to 2^31-1)",
        "2 values but input_ids has 3",
        "the first token is marked, but no token predicts it",
    ]


def test_vocabulary_bound_when_a_tokenizer_is_known(tmp_path):
    path = parquet(tmp_path / "a.parquet", [[1, 2, 99]], [[0, 1, 1]])
    assert scan_rows(path, "a", vocab_size=100)[1] == []
    (problem,) = scan_rows(path, "a", vocab_size=99)[1]
    assert problem.message == "99 at position 2 is outside the tokenizer's vocabulary of 99"


def test_rows_are_numbered_across_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(prepared_rows, "BATCH_ROWS", 2)
    ids = [[1, 2]] * 7
    masks = [[0, 1], [0, 1], [0, 0], [0, 1], [0, 1], [1, 1], [0, 1]]
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": masks}), path, row_group_size=3)
    stats, problems = scan_rows(path, "a")
    assert [p.line for p in problems] == [3, 6]
    assert stats == FileStats(rows=7, tokens=14, supervised_tokens=7, longest_row=2)


def test_row_problems_are_capped_per_file(tmp_path, monkeypatch):
    monkeypatch.setattr(prepared_rows, "MAX_PROBLEMS_PER_FILE", 2)
    path = parquet(tmp_path / "a.parquet", [[1, 2]] * 5, [[1, 1]] * 5)
    problems = scan_rows(path, "a")[1]
    assert [(p.line, p.field) for p in problems] == [(1, "loss_mask"), (2, "loss_mask"), (0, "file")]
    assert problems[-1].message == "3 more row problems not listed"


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (
            pa.table({"input_ids": [[1, 2]]}),
            [("loss_mask", "missing column; prepared rows have input_ids and loss_mask")],
        ),
        (
            pa.table({"input_ids": [[1.0, 2.0]], "loss_mask": [[0, 1]]}),
            [("input_ids", "must be a list of integers, got list<double>")],
        ),
        (
            pa.table({"input_ids": [[1, 2]], "loss_mask": [[False, True]]}),
            [("loss_mask", "must be a list of integers, got list<bool>")],
        ),
        (
            pa.table({"input_ids": ["1 2"], "loss_mask": [[0, 1]]}),
            [("input_ids", "must be a list of integers, got string")],
        ),
        (
            pa.table(
                {
                    "input_ids": pa.array([], pa.list_(pa.int32())),
                    "loss_mask": pa.array([], pa.list_(pa.int8())),
                }
            ),
            [("file", "no rows")],
        ),
    ],
)
def test_file_level_problems(tmp_path, table, expected):
    pq.write_table(table, tmp_path / "a.parquet")
    problems = scan_rows(tmp_path / "a.parquet", "a")[1]
    assert [(p.line, p.field, p.message) for p in problems] == [(0, f, m) for f, m in expected]


def test_not_parquet(tmp_path):
    (tmp_path / "a.parquet").write_text("input_ids,loss_mask\n")
    stats, (problem,) = scan_rows(tmp_path / "a.parquet", "a")
    assert (
        stats is None
        and problem.field == "file"
        and problem.message.startswith("not a readable Parquet file")
    )


def test_large_list_and_unsigned_columns(tmp_path):
    table = pa.table(
        {
            "input_ids": pa.array([[1, 2, 3]], pa.large_list(pa.uint32())),
            "loss_mask": pa.array([[0, 1, 1]], pa.large_list(pa.uint8())),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet")
    assert scan_rows(tmp_path / "a.parquet", "a") == (FileStats(1, 3, 2, 3), [])


# -- the descriptor ---------------------------------------------------------------------------------


SEED_DESCRIPTOR = {
    "tokenizer": {"repository": "google/gemma-4-E4B-it", "revision": COMMIT},
    "tokenizerSha256": "bca34862f49c6a63155300a313b0d3f901ad1c16d619d19c2677ba963449085d",
    "chatTemplateSha256": "0a2c8073c878ab1da004bee933a998606537bbb62016310352c7285c3f01c5b5",
    "files": [
        {
            "path": "train.parquet",
            "sha256": "5f0c9e1d2a7b4c3e8f6a1d0b9c8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e",
            "rows": 2000,
            "tokens": 3412880,
            "supervisedTokens": 402117,
            "longestRow": 8190,
        }
    ],
}


def test_seed_descriptor_parses_and_round_trips():
    desc = parse_descriptor(json.dumps(SEED_DESCRIPTOR).encode(), "prepared.json")
    assert desc.repository == "google/gemma-4-E4B-it" and desc.revision == COMMIT
    assert desc.files[0].stats == FileStats(2000, 3412880, 402117, 8190)
    assert desc.to_json() == SEED_DESCRIPTOR


def broken(**changes) -> dict:
    data = json.loads(json.dumps(SEED_DESCRIPTOR))
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        target = data
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        if value is ...:
            del target[key]
        else:
            target[key] = value
    return data


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (broken(tokenizer__revision="main"), "tokenizer.revision"),
        (broken(tokenizer__revision=COMMIT.upper()), "tokenizer.revision"),
        (broken(tokenizer__repository=""), "tokenizer.repository"),
        (broken(tokenizer__branch="main"), "tokenizer.branch"),
        (broken(tokenizer="google/gemma"), "tokenizer"),
        (broken(tokenizerSha256="abc"), "tokenizerSha256"),
        (broken(chatTemplateSha256=...), "chatTemplateSha256"),
        (broken(version=2), "version"),
        (broken(files=[]), "files"),
        (broken(files__0__path="../train.parquet"), "files[0].path"),
        (broken(files__0__path="/train.parquet"), "files[0].path"),
        (broken(files__0__path="prepared.json"), "files[0].path"),
        (broken(files__0__path="a\\train.parquet"), "files[0].path"),
        (broken(files__0__sha256="5F" * 32), "files[0].sha256"),
        (broken(files__0__rows=-1), "files[0].rows"),
        (broken(files__0__tokens=1.5), "files[0].tokens"),
        (broken(files__0__supervisedTokens=True), "files[0].supervisedTokens"),
        (broken(files__0__longestRow=...), "files[0].longestRow"),
        (broken(files__0__sha="x"), "files[0].sha"),
        ({**SEED_DESCRIPTOR, "files": SEED_DESCRIPTOR["files"] * 2}, "files[1].path"),
    ],
)
def test_descriptor_fields(data, field):
    (problem,) = problems_of(parse_descriptor, json.dumps(data).encode(), "x/prepared.json")
    assert (problem.path, problem.line, problem.field) == ("x/prepared.json", 0, field)


@pytest.mark.parametrize("data", [b"{", b"[]", b'{"a": 1, "a": 2}', b"\xff"])
def test_descriptor_not_an_object(data):
    (problem,) = problems_of(parse_descriptor, data, "prepared.json")
    assert problem.field == "file"


# -- the zip ----------------------------------------------------------------------------------------


def test_good_zip_reads(good_zip):
    dataset = read_prepared(good_zip)
    assert [f.path for f in dataset.descriptor.files] == ["train.parquet", "more.parquet"]  # training order
    assert dataset.stats == (FileStats(2, 7, 4, 4), FileStats(1, 2, 1, 2))


def test_zip_bytes_are_reproducible(good_zip, tmp_path, shipped):
    files = [tmp_path / "train.parquet", tmp_path / "more.parquet"]
    write_prepared_zip(descriptor_for(files, shipped), files, tmp_path / "again.zip")
    assert (tmp_path / "again.zip").read_bytes() == good_zip.read_bytes()


def test_zip_with_an_unlisted_file(good_zip, tmp_path):
    bad = rewrite_zip(good_zip, tmp_path / "bad.zip", {"notes.txt": b"hi", "sub/train.parquet": b"x"})
    assert [str(p) for p in problems_of(read_prepared, bad)] == [
        f"{bad}/notes.txt:0: file: not listed in prepared.json; a zip holds only the files it lists",
        f"{bad}/sub/train.parquet:0: file: not listed in prepared.json; a zip holds only the files it lists",
    ]


def test_zip_lacking_a_listed_file(good_zip, tmp_path):
    bad = rewrite_zip(good_zip, tmp_path / "bad.zip", {"more.parquet": None})
    assert [str(p) for p in problems_of(read_prepared, bad)] == [
        f"{bad}/more.parquet:0: file: listed in prepared.json but missing"
    ]


def test_zip_with_a_changed_file(good_zip, tmp_path):
    other = parquet(tmp_path / "other.parquet", [[1, 2, 3]], [[0, 0, 1]])
    bad = rewrite_zip(good_zip, tmp_path / "bad.zip", {"more.parquet": other.read_bytes()})
    desc = json.loads(zipfile.ZipFile(good_zip).read("prepared.json"))
    stated = desc["files"][1]["sha256"]
    assert [str(p) for p in problems_of(read_prepared, bad)] == [
        f"{bad}/more.parquet:0: sha256: the file's SHA-256 is {file_sha256(other)}; prepared.json states {stated}"
    ]


def test_counts_are_checked_against_the_descriptor(good_zip, tmp_path):
    desc = json.loads(zipfile.ZipFile(good_zip).read("prepared.json"))
    desc["files"][0].update(rows=3, supervisedTokens=5, longestRow=4)
    bad = rewrite_zip(good_zip, tmp_path / "bad.zip", {"prepared.json": json.dumps(desc).encode()})
    assert [str(p) for p in problems_of(read_prepared, bad)] == [
        f"{bad}/train.parquet:0: rows: 2 in the file, but prepared.json states 3",
        f"{bad}/train.parquet:0: supervisedTokens: 4 in the file, but prepared.json states 5",
    ]


def test_bad_rows_inside_a_zip_name_the_member_and_row(tmp_path, shipped):
    path = parquet(tmp_path / "train.parquet", GOOD_IDS, [[0, 0, 1, 1], [1, 1, 1]])
    stats = scan_rows(path, "x")[0]
    fp = fingerprint(shipped)
    desc = PreparedDescriptor(
        "org/m",
        COMMIT,
        fp.tokenizer_sha256,
        fp.chat_template_sha256,
        (PreparedFile(path.name, file_sha256(path), stats),),
    )
    write_prepared_zip(desc, [path], tmp_path / "t.zip")
    assert [str(p) for p in problems_of(read_prepared, tmp_path / "t.zip")] == [
        f"{tmp_path}/t.zip/train.parquet:2: loss_mask: the first token is marked, but no token predicts it"
    ]


def test_not_a_zip_and_no_descriptor(tmp_path, good_zip):
    (tmp_path / "x.zip").write_bytes(b"PK nonsense")
    assert problems_of(read_prepared, tmp_path / "x.zip")[0].message.startswith("not a zip file")
    assert problems_of(read_prepared, tmp_path / "none.zip")[0].message == "no such file"
    bad = rewrite_zip(good_zip, tmp_path / "bad.zip", {"prepared.json": None})
    (problem,) = problems_of(read_prepared, bad)
    assert (problem.path, problem.field) == (str(bad), "prepared.json")


def test_a_directory_is_read_like_its_zip(good_zip, tmp_path):
    folder = tmp_path / "unpacked"
    zipfile.ZipFile(good_zip).extractall(folder)
    assert read_prepared(folder).stats == read_prepared(good_zip).stats
    (folder / ".DS_Store").write_bytes(b"")
    assert [str(p) for p in problems_of(read_prepared, folder)] == [
        f"{folder}/.DS_Store:0: file: not listed in prepared.json; a zip holds only the files it lists"
    ]


# -- sizes: seed 003's extraction limit, enforced while streaming (issue 19, item 5) -----------------


def test_a_zip_bomb_is_refused_by_its_declared_size_before_extraction(good_zip, tmp_path, monkeypatch):
    from data_pipeline.formats import limits

    monkeypatch.setattr(limits, "MAX_EXTRACTED_BYTES", 64 * 1024)
    assert read_prepared(good_zip)  # a few kilobytes: within the lowered limit
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(good_zip) as zin, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zout:
        zout.writestr("prepared.json", zin.read("prepared.json")[:-2] + b" " * (1 << 20) + b"}\n")
    assert bomb.stat().st_size < 16 * 1024  # a megabyte of spaces deflates to almost nothing
    for read in (read_prepared, read_descriptor):
        (problem,) = problems_of(read, bomb)
        assert problem.path.startswith(str(bomb)) and problem.field == "file"
        assert "over the limit of 65536 bytes" in problem.message


def test_a_member_stream_is_cut_at_the_limit(good_zip, tmp_path, monkeypatch):
    from data_pipeline.formats import limits

    monkeypatch.setattr(limits, "MAX_EXTRACTED_BYTES", 1000)

    class Endless:  # a stream that never ends, counting what it gave
        given = 0

        def read(self, n: int) -> bytes:
            self.given += n
            return b"\0" * n

    endless = Endless()
    with pytest.raises(limits.TooLarge, match="larger than the limit of 1000 bytes"):
        limits.copy_capped(endless, 1000, lambda chunk: None)
    assert endless.given == 1001
    # A directory's prepared.json that never ends (here /dev/zero) is refused before it is opened.
    folder = tmp_path / "unpacked"
    zipfile.ZipFile(good_zip).extractall(folder)
    (folder / "prepared.json").unlink()
    (folder / "prepared.json").symlink_to("/dev/zero")
    problems = problems_of(read_prepared, folder)
    assert [p.path for p in problems] == [f"{folder}/prepared.json"]
    assert "is a device; a data file must be a regular file" in problems[0].message


def test_dev_zero_as_a_prepared_zip_is_refused_before_it_is_read(tmp_path):
    """Issue 27: zipfile "seeks" /dev/zero's end and reads it until MemoryError; it is no regular file."""
    link = tmp_path / "train.zip"
    link.symlink_to("/dev/zero")
    for path in (Path("/dev/zero"), link):
        assert [str(p) for p in problems_of(read_prepared, path)] == [
            f"{path}:0: file: is a device; a data file must be a regular file"]


# -- checks a run makes -----------------------------------------------------------------------------


def test_check_against_the_shipped_tokenizer(good_zip, shipped):
    desc = read_prepared(good_zip).descriptor
    check_against_tokenizer(desc, shipped, repository="org/model", revision=COMMIT)
    problems = problems_of(check_against_tokenizer, desc, shipped, "org/other", "0" * 40)
    assert [(p.path, p.field) for p in problems] == [
        (f"{good_zip}/prepared.json", "tokenizer.repository"),
        (f"{good_zip}/prepared.json", "tokenizer.revision"),
    ]


def test_training_tokenizer_with_primitive_tokens_does_not_match(good_zip):
    # Why describe loads the tokenizer as shipped: adding tokens (as load_tokenizer adds primitive
    # tokens to a base tokenizer lacking them) changes the digest. The smoke tokenizer has them
    # already, so add one more.
    desc = read_prepared(good_zip).descriptor
    training = AutoTokenizer.from_pretrained(str(TOKENIZER))
    assert training.add_tokens(["<not_shipped>"]) == 1
    (problem,) = problems_of(check_against_tokenizer, desc, training)
    assert problem.field == "tokenizerSha256" and problem.message.startswith(
        "prepared with another tokenizer"
    )
    training.chat_template = training.chat_template + " "
    assert [p.field for p in problems_of(check_against_tokenizer, desc, training)] == [
        "tokenizerSha256",
        "chatTemplateSha256",
    ]


def test_check_max_seq_length(good_zip):
    desc = read_prepared(good_zip).descriptor
    check_max_seq_length(desc, 4)
    assert [str(p) for p in problems_of(check_max_seq_length, desc, 3)] == [
        f"{good_zip}/train.parquet:0: longestRow: 4 tokens, longer than maxSeqLength 3"
    ]


# -- describe ---------------------------------------------------------------------------------------


def test_describe_in_process(tmp_path, capsys, shipped):
    path = parquet(tmp_path / "train.parquet", GOOD_IDS, GOOD_MASKS)
    args = [
        "describe",
        f"--tokenizer={TOKENIZER}",
        "--repository=org/model",
        f"--revision={COMMIT}",
        str(path),
    ]
    assert prepared_cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == descriptor_for([path], shipped).to_json()


def test_describe_refuses_bad_rows_and_unknown_ids(tmp_path, capsys):
    path = parquet(tmp_path / "train.parquet", [[5, 6, 7], [1, 5000]], [[0, 0, 0], [0, 1]])
    args = ["describe", f"--tokenizer={TOKENIZER}", "--repository=o/m", f"--revision={COMMIT}", str(path)]
    assert prepared_cli.main([*args, "--zip", str(tmp_path / "t.zip")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and not (tmp_path / "t.zip").exists()
    assert captured.err.splitlines() == [
        f"{path}:1: loss_mask: no token is marked; every row marks at least one token",
        f"{path}:2: input_ids: 5000 at position 1 is outside the tokenizer's vocabulary of 2131",
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--repository=o/m"], "give the full commit it came from with --revision"),
        ([f"--revision={COMMIT}"], "name its model repository with --repository"),
        (["--repository=o/m", "--revision=main"], "a local folder cannot resolve a branch or tag"),
    ],
)
def test_describe_usage_errors(tmp_path, capsys, extra, message):
    path = parquet(tmp_path / "train.parquet", GOOD_IDS, GOOD_MASKS)
    assert prepared_cli.main(["describe", f"--tokenizer={TOKENIZER}", *extra, str(path)]) == 2
    assert message in capsys.readouterr().err


def test_describe_refuses_two_files_of_one_name(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    one = parquet(tmp_path / "train.parquet", GOOD_IDS, GOOD_MASKS)
    two = parquet(tmp_path / "a" / "train.parquet", GOOD_IDS, GOOD_MASKS)
    args = [
        "describe",
        f"--tokenizer={TOKENIZER}",
        "--repository=o/m",
        f"--revision={COMMIT}",
        str(one),
        str(two),
    ]
    assert prepared_cli.main(args) == 2
    assert "files share a name inside the zip: train.parquet" in capsys.readouterr().err


def test_hub_cache_snapshot_names_repository_and_commit(tmp_path):
    snapshot = tmp_path / "hub" / "models--acme--tiny-chat" / "snapshots" / COMMIT
    shutil.copytree(TOKENIZER, snapshot)
    assert prepared_cli.resolve_source(str(snapshot), None, None) == ("acme/tiny-chat", COMMIT)
    with pytest.raises(prepared_cli.UsageError, match="is the snapshot of commit"):
        prepared_cli.resolve_source(str(snapshot), None, "1" * 40)


def test_hub_name_branch_resolves_through_the_cache(tmp_path, monkeypatch):
    # What from_pretrained leaves behind: refs/main naming the commit whose snapshot holds the files.
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    shutil.copytree(TOKENIZER, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert prepared_cli.resolve_source("acme/tiny-chat", None, None) == ("acme/tiny-chat", COMMIT)
    assert prepared_cli.resolve_source("acme/tiny-chat", None, "9" * 40) == ("acme/tiny-chat", "9" * 40)
    with pytest.raises(prepared_cli.UsageError, match="cannot resolve acme/tiny-chat@v2 to a commit"):
        prepared_cli.resolve_source("acme/tiny-chat", None, "v2")
    with pytest.raises(prepared_cli.UsageError, match="--repository=other/x"):
        prepared_cli.resolve_source("acme/tiny-chat", "other/x", None)


def _docstring_commands(tmp_path: Path) -> list[str]:
    """The example in data_pipeline/prepared.py's docstring, run against tmp_path instead of /tmp."""
    text = prepared_cli.__doc__.split("Example", 1)[1].split("\n\n", 2)[1]
    joined = text.replace("\\\n", " ")
    commands = [line.strip() for line in joined.splitlines() if line.strip()]
    return [
        shlex.quote(sys.executable) + c.removeprefix("python").replace("/tmp/", f"{tmp_path}/")
        for c in commands
    ]


@pytest.mark.slow
def test_cli_round_trip_describe_zip_validate_and_tamper(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}

    def sh(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )

    make, describe, validate = _docstring_commands(tmp_path)
    assert sh(make).returncode == 0
    done = sh(describe)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["files"][0]["path"] == "train.parquet"
    checked = sh(validate)
    assert (checked.returncode, checked.stdout) == (
        0,
        f"{tmp_path}/train.zip: 1 files, 1 rows, 3 tokens, 2 supervised, longest row 3 OK\n",
    )
    # Tamper: same descriptor, one more row in the Parquet file.
    tampered = parquet(
        tmp_path / "t.parquet", [[1, 2, 3], [4, 5]], [[0, 1, 1], [0, 1]], types=(pa.int64(), pa.int64())
    )
    rewrite_zip(tmp_path / "train.zip", tmp_path / "bad.zip", {"train.parquet": tampered.read_bytes()})
    stated = json.loads(done.stdout)["files"][0]["sha256"]
    refused = sh(
        f"{shlex.quote(sys.executable)} -m data_pipeline.validate --format=prepared {tmp_path}/bad.zip"
    )
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr.splitlines() == [
        f"{tmp_path}/bad.zip/train.parquet:0: sha256: the file's SHA-256 is {file_sha256(tampered)}; "
        f"prepared.json states {stated}"
    ]


# -- the vectorised checks agree with a row-by-row reading ----------------------------------------

_value = st.one_of(st.none(), st.integers(-2, 3))
_rows = st.lists(
    st.tuples(
        st.one_of(st.none(), st.lists(_value, max_size=4)), st.one_of(st.none(), st.lists(_value, max_size=4))
    ),
    min_size=1,
    max_size=9,
)


def _row_is_bad(ids: list | None, mask: list | None) -> bool:
    if ids is None or mask is None or not ids or len(ids) != len(mask):
        return True
    if any(v is None or v < 0 for v in ids) or any(v not in (0, 1) for v in mask):
        return True
    return mask[0] == 1 or 1 not in mask


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=_rows, batch=st.integers(1, 4))
def test_vectorised_checks_match_a_plain_reading(tmp_path, monkeypatch, rows, batch):
    monkeypatch.setattr(prepared_rows, "BATCH_ROWS", batch)
    ids, masks = [r[0] for r in rows], [r[1] for r in rows]
    path = parquet(tmp_path / "h.parquet", ids, masks, types=(pa.int64(), pa.int64()))
    stats, problems = scan_rows(path, "h")
    assert sorted({p.line for p in problems}) == [i + 1 for i, r in enumerate(rows) if _row_is_bad(*r)]
    assert stats == FileStats(
        rows=len(rows),
        tokens=sum(len(i or []) for i in ids),
        supervised_tokens=sum((m or []).count(1) for m in masks),
        longest_row=max(len(i or []) for i in ids),
    )
