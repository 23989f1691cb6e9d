"""Every reader, fed arbitrary bytes or mutated valid records, returns records or raises FormatError.

Never a traceback of another kind: deep nesting, 10k-digit integers, NaN, truncated lines, invalid
UTF-8, lone surrogates and swapped types must all come back as `PATH:LINE: FIELD: message` problems
that can be printed. Adding a JSON/JSONL format is one line in READERS; prepared token rows (a
zip or directory of Parquet files under a JSON descriptor) have their own tests below.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_pipeline.formats.chat import read_chat
from data_pipeline.formats.errors import FormatError
from data_pipeline.formats.prepared import (
    DESCRIPTOR_NAME,
    PreparedDescriptor,
    PreparedFile,
    read_prepared,
    write_prepared_zip,
)
from data_pipeline.formats.prepared_load import read_prepared_rows
from data_pipeline.formats.prepared_rows import scan_rows
from data_pipeline.formats.recipe import read_recipe
from data_pipeline.formats.vakforge import read_vakforge
from data_pipeline.formats.vakforge_items import read_vakforge_items
from data_pipeline.formats.valen import read_valen
from data_pipeline.formats.valen_check import RecordCheck, plain_counts
from data_pipeline.formats.valen_state import MediaFiles
from data_pipeline.formats.vflash import read_vflash

SMOKE = Path(__file__).resolve().parents[1] / "data" / "smoke"

# (format, reader taking a path, a valid file whose records are mutated). The seed file's folder is
# linked next to the fuzzed file, so media and annotation paths of unmutated records resolve.
# A `.jsonl` seed is mutated one line at a time; any other seed as one JSON document.
READERS: list[tuple[str, Callable[[Path], object], Path]] = [
    ("valen", read_valen, SMOKE / "valen" / "train.jsonl"),
    ("vflash", read_vflash, SMOKE / "vflash" / "boxes.jsonl"),
    ("recipe", read_recipe, SMOKE / "vflash" / "recipe.json"),
    ("chat", read_chat, SMOKE / "chat" / "train.jsonl"),
    # splits.json and the audio files next to the manifest are read too.
    ("vakforge", read_vakforge, SMOKE / "vakforge" / "vakforge.jsonl"),
    ("vakforge_items", read_vakforge_items, SMOKE / "vakforge" / "vakforge.jsonl"),
]

# A deeper hunt: FUZZ_EXAMPLES=5000 python -m pytest tests/test_fuzz_readers.py
FUZZ = settings(
    deadline=None,
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
DEEP, HUGE = "\x00deep\x00", "\x00huge\x00"  # placeholders replaced in the JSON text after dumping

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),  # json.dumps writes NaN / Infinity tokens
    st.text(max_size=12),  # may hold lone surrogates and control characters
    st.sampled_from(
        ["", " ", "choice", "Choice", "noul", "score", "user", "http://x/a.png", "a.png", DEEP, HUGE]
    ),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)


def paths_of(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indexes) inside a JSON value, the value itself first."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths_of(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths_of(item, (*prefix, index))
    return found


def mutate(doc: object, path: tuple, action: str, new: object) -> object:
    """`doc` with the value at `path` dropped or replaced (the root can only be replaced)."""
    if not path:
        return new
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    if action == "drop":
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return doc


def dump(doc: object, ascii_only: bool, depth: int) -> str:
    text = json.dumps(doc, ensure_ascii=ascii_only)
    text = text.replace(json.dumps(DEEP, ensure_ascii=ascii_only), "[" * depth + "]" * depth)
    return text.replace(json.dumps(HUGE, ensure_ascii=ascii_only), "9" * 10_000)


def seed_documents(seed: Path) -> list[object]:
    text = seed.read_text(encoding="utf-8")
    if seed.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return [json.loads(text)]


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory) -> dict[str, Path]:
    """Per format, a folder holding links to everything next to its seed file."""
    folders = {}
    for name, _, seed in READERS:
        folder = tmp_path_factory.mktemp(f"fuzz_{name}")
        for entry in seed.parent.iterdir():
            os.symlink(entry, folder / entry.name)
        folders[name] = folder
    return folders


def read_only_format_errors(reader: Callable[[Path], object], path: Path) -> None:
    try:
        reader(path)
    except FormatError as err:
        assert err.problems
        for problem in err.problems:
            assert isinstance(problem.line, int) and problem.line >= 0
            str(problem).encode("utf-8")  # printable: no lone surrogate survives into a message


@pytest.mark.parametrize(("name", "reader", "seed"), READERS, ids=[r[0] for r in READERS])
@FUZZ
@given(data=st.binary(max_size=600))
def test_arbitrary_bytes(workspaces, name, reader, seed, data):
    path = workspaces[name] / f"fuzz{seed.suffix}"
    path.write_bytes(data)
    read_only_format_errors(reader, path)


@pytest.mark.parametrize(("name", "reader", "seed"), READERS, ids=[r[0] for r in READERS])
@FUZZ
@given(data=st.data())
def test_mutated_records(workspaces, name, reader, seed, data):
    documents = seed_documents(seed)
    which = data.draw(st.integers(0, len(documents) - 1), label="document")
    doc = documents[which]
    path_in_doc = data.draw(st.sampled_from(paths_of(doc)), label="path")
    action = data.draw(st.sampled_from(["drop", "replace"] if path_in_doc else ["replace"]), label="action")
    doc = mutate(doc, path_in_doc, action, data.draw(json_value, label="new value"))
    text = dump(doc, data.draw(st.booleans(), label="ascii"), data.draw(st.sampled_from([3, 900, 100_000])))
    raw = text.encode("utf-8", "surrogatepass")
    edit = data.draw(st.sampled_from(["none", "truncate", "insert"]), label="edit")
    at = data.draw(st.integers(0, len(raw)), label="at")
    if edit == "truncate":
        raw = raw[:at]
    elif edit == "insert":
        raw = raw[:at] + data.draw(st.binary(min_size=1, max_size=4), label="bytes") + raw[at:]
    if seed.suffix == ".jsonl":
        lines = [json.dumps(d, ensure_ascii=False).encode("utf-8") for d in documents]
        lines[which] = raw
        raw = b"\n".join(lines) + b"\n"
    path = workspaces[name] / f"fuzz{seed.suffix}"
    path.write_bytes(raw)
    read_only_format_errors(reader, path)


# -- Valen's fast path accepts nothing its explaining path refuses ---------------------------------

VALEN_RECORDS = seed_documents(SMOKE / "valen" / "train.jsonl")


def valen_media() -> MediaFiles:
    return MediaFiles(SMOKE / "valen", check=True)  # the smoke records' media exist there


def test_fast_path_takes_the_smoke_records():
    assert None not in [plain_counts(doc, valen_media()) for doc in VALEN_RECORDS]


@FUZZ
@given(data=st.data())
def test_valen_fast_path_is_a_subset_of_the_explaining_path(data):
    doc = json.loads(json.dumps(data.draw(st.sampled_from(VALEN_RECORDS), label="record")))
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path_in_doc = data.draw(st.sampled_from(paths_of(doc)), label="path")
        action = data.draw(
            st.sampled_from(["drop", "replace"] if path_in_doc else ["replace"]), label="action"
        )
        doc = mutate(doc, path_in_doc, action, data.draw(json_value, label="new value"))
    counts = plain_counts(doc, valen_media())
    check = RecordCheck("fuzz.jsonl", valen_media())
    checked = check.explain(1, doc)
    if counts is not None:
        assert check.problems == [] and checked is not None
        assert (checked.questions, checked.labeled) == counts


# -- Prepared token rows: the zip, its descriptor, and the Parquet files it lists --------------------

PREPARED_READERS = [("read_prepared", read_prepared), ("read_prepared_rows", read_prepared_rows)]
PARQUET_NAMES = ("train.parquet", "more/rows.parquet")


def read_prepared_only_format_errors(path: Path) -> None:
    for _, reader in PREPARED_READERS:
        read_only_format_errors(reader, path)


@pytest.fixture(scope="module")
def prepared_seed(tmp_path_factory) -> dict[str, bytes]:
    """A valid prepared version as {member name: bytes}: two Parquet files and prepared.json."""
    folder = tmp_path_factory.mktemp("prepared_seed")
    tables = [([[5, 6, 7, 8], [9, 10, 11]], [[0, 0, 1, 1], [0, 1, 1]]), ([[1, 2]], [[0, 1]])]
    files = []
    for name, (ids, masks) in zip(PARQUET_NAMES, tables, strict=True):
        path = folder / name.replace("/", "_")
        pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())),
                                 "loss_mask": pa.array(masks, pa.list_(pa.int8()))}), path)
        files.append(path)
    entries = []
    for name, path in zip(PARQUET_NAMES, files, strict=True):
        stats, problems = scan_rows(path, str(path))
        assert not problems
        entries.append(PreparedFile(name, hashlib.sha256(path.read_bytes()).hexdigest(), stats))
    descriptor = PreparedDescriptor("org/model", "e" * 40, "a" * 64, "b" * 64, tuple(entries))
    write_prepared_zip(descriptor, files, folder / "seed.zip")
    with zipfile.ZipFile(folder / "seed.zip") as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    read_prepared(folder / "seed.zip")  # the seed itself is valid
    return members


def write_prepared_dir(folder: Path, members: dict[str, bytes]) -> Path:
    """A prepared directory holding exactly `members` (a directory must list every file it holds)."""
    shutil.rmtree(folder, ignore_errors=True)
    for name, data in members.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def byte_edit(data, raw: bytes, label: str) -> bytes:
    edit = data.draw(st.sampled_from(["truncate", "insert", "flip"]), label=f"{label} edit")
    at = data.draw(st.integers(0, max(len(raw) - 1, 0)), label=f"{label} at")
    if edit == "truncate":
        return raw[:at]
    if edit == "insert":
        return raw[:at] + data.draw(st.binary(min_size=1, max_size=8), label=f"{label} bytes") + raw[at:]
    flipped = bytes(b ^ data.draw(st.integers(1, 255), label=f"{label} mask") for b in raw[at:at + 4])
    return raw[:at] + flipped + raw[at + 4:]


@FUZZ
@given(data=st.binary(max_size=600))
def test_prepared_arbitrary_bytes_as_the_zip(tmp_path_factory, data):
    path = tmp_path_factory.getbasetemp() / "fuzz_prepared.zip"
    path.write_bytes(data)
    read_prepared_only_format_errors(path)


@FUZZ
@given(data=st.data())
def test_prepared_mutated_descriptor(tmp_path_factory, prepared_seed, data):
    doc = json.loads(prepared_seed[DESCRIPTOR_NAME])
    path_in_doc = data.draw(st.sampled_from(paths_of(doc)), label="path")
    action = data.draw(st.sampled_from(["drop", "replace"] if path_in_doc else ["replace"]), label="action")
    doc = mutate(doc, path_in_doc, action, data.draw(json_value, label="new value"))
    raw = dump(doc, data.draw(st.booleans(), label="ascii"), data.draw(st.sampled_from([3, 900, 100_000])))
    raw = raw.encode("utf-8", "surrogatepass")
    if data.draw(st.booleans(), label="byte edit"):
        raw = byte_edit(data, raw, "descriptor")
    members = {**prepared_seed, DESCRIPTOR_NAME: raw}
    folder = write_prepared_dir(tmp_path_factory.getbasetemp() / "fuzz_prepared_descriptor", members)
    read_prepared_only_format_errors(folder)


@FUZZ
@given(data=st.data())
def test_prepared_mutated_parquet_with_a_matching_digest(tmp_path_factory, prepared_seed, data):
    # The descriptor states the damaged file's SHA-256, so the damage reaches the Parquet reader.
    name = data.draw(st.sampled_from(PARQUET_NAMES), label="file")
    damaged = byte_edit(data, prepared_seed[name], "parquet")
    doc = json.loads(prepared_seed[DESCRIPTOR_NAME])
    for entry in doc["files"]:
        if entry["path"] == name:
            entry["sha256"] = hashlib.sha256(damaged).hexdigest()
    members = {**prepared_seed, name: damaged, DESCRIPTOR_NAME: json.dumps(doc).encode()}
    as_zip = data.draw(st.booleans(), label="zip")
    folder = write_prepared_dir(tmp_path_factory.getbasetemp() / "fuzz_prepared_parquet", members)
    if as_zip:
        path = folder.with_suffix(".zip")
        with zipfile.ZipFile(path, "w") as zf:
            for member, raw in members.items():
                zf.writestr(member, raw)
        read_prepared_only_format_errors(path)
    else:
        read_prepared_only_format_errors(folder)
