"""The dataset registry (seed 003, "Register a dataset" and "Images"; issue 17): real SQLite, real
files, real blob stores (a local directory and fsspec's in-process memory://)."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest

from data_pipeline.format_registry import FORMATS
from data_pipeline.registry import MissingImagesError, RegistryError, is_reference, open_registry
from data_pipeline.registry.__main__ import main
from data_pipeline.registry.store import BlobStore

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "data" / "smoke"


def _row(text: str, image: str | None = None) -> dict:
    user = text if image is None else [{"type": "text", "text": text}, {"type": "image", "path": image}]
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": f"answer {text}"}]}


def _write_jsonl(path: Path, rows: list[dict], indent: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, indent=indent).replace("\n", " ") + "\n" for row in rows))
    return path


@pytest.fixture
def registry(tmp_path):
    return open_registry(str(tmp_path / "registry"))


def _stored_examples(registry, version: int) -> bytes:
    """The examples of a version as the blob store holds them (its chunks, joined)."""
    manifest = json.loads(registry.index.read("SELECT manifest FROM versions WHERE version=?", (version,))[0][0])
    return b"".join(registry.blobs.get(hexdigest) for hexdigest in manifest["examples"])


def test_register_is_idempotent_adds_versions_and_resolves_every_reference_form(registry, tmp_path):
    first = _write_jsonl(tmp_path / "a" / "train.jsonl", [_row("one"), _row("two")])
    v1 = registry.register("Triage/Train", first, "chat", alias="candidate")
    assert (v1.reference, v1.new, v1.format) == ("triage/train:v1", True, "chat")
    # The same examples, written with other whitespace, are the same version.
    again = _write_jsonl(tmp_path / "b" / "train.jsonl", [_row("one"), _row("two")], indent=2)
    assert again.read_bytes() != first.read_bytes()
    same = registry.register("triage/train", again, "chat")
    assert (same.reference, same.new, same.digest) == ("triage/train:v1", False, v1.digest)
    v2 = registry.register("triage/train", _write_jsonl(tmp_path / "c.jsonl", [_row("three")]), "chat")
    assert (v2.reference, v2.new) == ("triage/train:v2", True)

    assert registry.resolve("triage/train").reference == "triage/train:v2"  # latest: the newest
    assert registry.resolve("triage/train:latest").reference == "triage/train:v2"
    assert registry.resolve("TRIAGE/Train:V1").reference == "triage/train:v1"
    assert registry.resolve("triage/train:candidate").reference == "triage/train:v1"
    assert registry.resolve(f"triage/train@{v2.digest.upper().replace('SHA256', 'sha256')}").version == 2
    assert registry.resolve("train:v1", default_namespace="Triage").reference == "triage/train:v1"
    # What a resolved version reads back is the same examples, and passes the format's validator.
    assert FORMATS["chat"].validate(registry.resolve("triage/train:v1").path, True).startswith("2 records OK")

    for unknown, named in [("triage/nope", "triage/nope"), ("triage/train:v9", "triage/train:v9"),
                           ("triage/train:gone", "triage/train:gone"), ("other/train", "other/train"),
                           (f"triage/train@sha256:{'0' * 64}", "sha256:000")]:
        with pytest.raises(RegistryError, match=named):
            registry.resolve(unknown)
    with pytest.raises(RegistryError, match="no namespace"):
        registry.resolve("train")
    with pytest.raises(RegistryError, match="without a version"):
        registry.register("triage/train:v3", first, "chat")

    # An alias moves without an upload, and only to an existing version; latest cannot be set.
    written = registry.blobs.uploaded_bytes
    assert registry.set_alias("triage/train:candidate", "v2").reference == "triage/train:v2"
    assert registry.resolve("triage/train:candidate").version == 2 and registry.blobs.uploaded_bytes == written
    with pytest.raises(RegistryError, match="v7"):
        registry.set_alias("triage/train:candidate", 7)
    with pytest.raises(RegistryError, match="latest"):
        registry.set_alias("triage/train:latest", 1)
    rows = registry.versions("triage/train")
    assert [(r["version"], r["aliases"]) for r in rows] == [(1, []), (2, ["latest", "candidate"])]
    assert registry.list("TRIAGE") == [{"dataset": "triage/train", "latest": "triage/train:v2", "versions": 2}]
    assert registry.list("empty") == []


def test_is_reference_forms_and_local_paths(tmp_path, monkeypatch):
    for text in ["ns/name", "name", "ns/name:v3", "ns/name:alias", "NS/Name", f"ns/name@sha256:{'a' * 64}"]:
        assert is_reference(text), text
    for text in ["train.jsonl", "data/smoke/chat/train.jsonl", "/abs/path", "a/b/c", "ns/name@sha256:12"]:
        assert not is_reference(text), text
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ns").mkdir()
    (tmp_path / "ns" / "train").write_text("")
    assert not is_reference("ns/train")  # an existing local path is never a reference


def test_every_file_passes_its_validator_first(registry, tmp_path):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [_row("fine"), {"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(RegistryError, match=r"bad.jsonl:2: .*assistant"):
        registry.register("t/bad", bad, "chat")
    # A prepared zip holding a file its descriptor does not list (seed 003, "What is checked").
    extra = tmp_path / "extra.zip"
    with zipfile.ZipFile(SMOKE / "prepared" / "train.zip") as src, zipfile.ZipFile(extra, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
        dst.writestr("stray.parquet", b"x")
    with pytest.raises(RegistryError, match="stray.parquet"):
        registry.register("t/prepared", extra, "prepared")
    with pytest.raises(RegistryError, match="recipe"):
        registry.register("t/recipe", SMOKE / "vflash" / "recipe.json", "recipe")
    assert registry.list("t") == []  # nothing refused left a dataset behind


@pytest.mark.parametrize("fmt, source", [
    ("prepared", "prepared/train.zip"), ("valen", "valen/train.jsonl"),
    ("vflash", "vflash/boxes.jsonl"), ("vakforge", "vakforge/vakforge.jsonl"), ("chat", "chat/train.jsonl"),
])
def test_smoke_files_of_every_format_register_and_read_back(registry, fmt, source):
    resolved = registry.register(f"smoke/{fmt}", SMOKE / source, fmt)
    assert resolved.reference == f"smoke/{fmt}:v1"
    # The materialised version (media and splits.json included) passes the same validator.
    assert FORMATS[fmt].validate(registry.resolve(f"smoke/{fmt}").path, True) == \
        FORMATS[fmt].validate(SMOKE / source, True)


def test_upload_limit_applies_to_the_upload_and_to_the_extracted_zip(tmp_path):
    registry = open_registry(str(tmp_path / "registry"), upload_limit=1000)
    big = _write_jsonl(tmp_path / "big.jsonl", [_row("x" * 600), _row("y" * 600)])
    with pytest.raises(RegistryError, match="upload limit of 1000 bytes"):
        registry.register("t/big", big, "chat")
    # A small zip (zeros compress well) whose members extract past the limit.
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("prepared.json", "{}")
        archive.writestr("train.parquet", b"\0" * 5000)
    assert bomb.stat().st_size < 1000
    with pytest.raises(RegistryError, match="extracted: 50.. bytes exceed the upload limit of 1000 bytes"):
        registry.register("t/zip", bomb, "prepared")
    assert open_registry(str(tmp_path / "registry")).upload_limit == 256 << 20


def test_images_are_stored_once_by_hash_and_a_second_version_uploads_only_text(registry, tmp_path, make_png):
    make_png("d/images/a.png", (4, 3))
    make_png("d/images/b.png", (5, 3))
    make_png("d/images/a_copy.png", (4, 3))  # the same bytes under another name
    rows = [_row("r1", "images/a.png"), _row("r2", "images/b.png"), _row("r3", "images/a_copy.png")]
    v1 = registry.register("vis/set", _write_jsonl(tmp_path / "d" / "train.jsonl", rows), "chat")
    stored = [json.loads(line) for line in _stored_examples(registry, 1).decode().splitlines()]
    paths = [row["messages"][0]["content"][1]["path"] for row in stored]
    assert all(p.startswith("sha256:") for p in paths) and paths[0] == paths[2] != paths[1]
    assert registry.index.read("SELECT COUNT(*) FROM blobs")[0][0] == 2
    assert FORMATS["chat"].validate(v1.path, True).startswith("3 records OK")

    before = registry.blobs.uploaded_bytes
    rows[1] = _row("r2 changed", "images/b.png")
    v2 = registry.register("vis/set", _write_jsonl(tmp_path / "d" / "train2.jsonl", rows), "chat")
    assert v2.reference == "vis/set:v2"
    assert registry.blobs.uploaded_bytes - before == len(_stored_examples(registry, 2))  # only the text


def test_a_version_changing_a_few_rows_uploads_only_the_chunks_holding_them(registry, tmp_path):
    rows = [_row(f"row {i}") for i in range(3000)]
    registry.register("big/set", _write_jsonl(tmp_path / "v1.jsonl", rows), "chat")
    assert len(json.loads(registry.index.read("SELECT manifest FROM versions")[0][0])["examples"]) > 4
    before = registry.blobs.uploaded_bytes
    rows[1234] = _row("row 1234, corrected")
    v2 = registry.register("big/set", _write_jsonl(tmp_path / "v2.jsonl", rows), "chat")
    uploaded, text = registry.blobs.uploaded_bytes - before, _stored_examples(registry, 2)
    assert 0 < uploaded < len(text) / 4
    assert text.decode().splitlines()[1234] == json.dumps(rows[1234], separators=(",", ":"))
    assert FORMATS["chat"].validate(v2.path, True).startswith("3000 records OK")


def test_no_upload_reports_missing_images_and_registers_nothing_until_pushed(registry, tmp_path, make_png, capsys):
    make_png("e/images/held.png", (4, 3))
    missing = make_png("e/images/missing.png", (6, 3))
    data = _write_jsonl(tmp_path / "e" / "train.jsonl", [_row("a", "images/held.png"), _row("b", "images/missing.png")])
    registry.push_images([tmp_path / "e" / "images" / "held.png"])
    with pytest.raises(MissingImagesError, match="missing.png") as err:
        registry.register("vis/noup", data, "chat", upload=False)
    assert [b.source.name for b in err.value.missing] == ["missing.png"]
    with pytest.raises(RegistryError, match="vis/noup"):
        registry.resolve("vis/noup")
    # `images push PATH…` through the command line, then --no-upload registers the text only.
    url = registry.url
    assert main([f"--registry={url}", "images", "push", str(missing)]) == 0
    assert capsys.readouterr().out.startswith("sha256:")
    assert main([f"--registry={url}", "datasets", "register", "vis/noup", "-f", str(data), "--no-upload"]) == 0
    assert capsys.readouterr().out == "vis/noup:v1\n"


def test_command_line(registry, tmp_path, capsys):
    url = f"--registry={registry.url}"
    chat = str(SMOKE / "chat" / "train.jsonl")
    assert main([url, "datasets", "register", "smoke/chat", "-f", chat, "--alias", "candidate"]) == 0
    assert main([url, "datasets", "register", "smoke/chat", "-f", chat]) == 0
    out = capsys.readouterr()
    assert out.out == "smoke/chat:v1\nsmoke/chat:v1\n" and "already smoke/chat:v1" in out.err
    assert main([url, "datasets", "get", "Smoke/Chat:candidate"]) == 0
    assert json.loads(capsys.readouterr().out)["reference"] == "smoke/chat:v1"
    assert main([url, "datasets", "versions", "smoke/chat"]) == 0
    assert "(latest, candidate)" in capsys.readouterr().out
    assert main([url, "datasets", "list", "--namespace", "smoke"]) == 0
    assert capsys.readouterr().out.startswith("smoke/chat 1 versions")
    assert main([url, "datasets", "alias", "set", "smoke/chat:candidate", "1"]) == 0
    assert main([url, "datasets", "get", "chat"]) == 1  # commands have no default namespace
    assert "no namespace" in capsys.readouterr().err
    assert main([url, "datasets", "get", "smoke/unknown"]) == 1
    assert "smoke/unknown" in capsys.readouterr().err


def test_memory_fsspec_blob_store_with_a_separate_local_index(tmp_path, make_png):
    url = f"memory://registry-{uuid.uuid4().hex}"
    with pytest.raises(RegistryError, match="--index"):
        open_registry(url)
    make_png("m/images/a.png")
    data = _write_jsonl(tmp_path / "m" / "train.jsonl", [_row("a", "images/a.png")])
    registry = open_registry(url, index=tmp_path / "index" / "index.sqlite")
    resolved = registry.register("mem/set", data, "chat")
    assert BlobStore(url + "/blobs").fs.find(url + "/blobs")  # the blobs are in memory://, not on disk
    assert not list((tmp_path / "index").glob("blobs"))
    again = open_registry(url, index=tmp_path / "index" / "index.sqlite").resolve("mem/set:v1")
    assert again.digest == resolved.digest and FORMATS["chat"].validate(again.path, True).startswith("1 records")


def test_a_registration_failing_after_some_blobs_leaves_no_version(registry, tmp_path, make_png, monkeypatch):
    make_png("f/images/a.png")
    make_png("f/images/b.png", (7, 2))
    data = _write_jsonl(tmp_path / "f" / "train.jsonl", [_row("a", "images/a.png"), _row("b", "images/b.png")])
    real_put, calls = BlobStore.put, []

    def failing_put(self, hexdigest, payload):
        calls.append(hexdigest)
        if len(calls) == 2:
            raise OSError("injected: the store went away")
        return real_put(self, hexdigest, payload)

    monkeypatch.setattr(BlobStore, "put", failing_put)
    with pytest.raises(OSError, match="injected"):
        registry.register("crash/set", data, "chat")
    monkeypatch.undo()
    with pytest.raises(RegistryError, match="crash/set"):
        registry.resolve("crash/set")
    assert registry.index.read("SELECT COUNT(*) FROM blobs")[0][0] == 0  # blob rows commit with the version
    assert registry.register("crash/set", data, "chat").reference == "crash/set:v1"


_KILLED_IN_TRANSACTION = """
import os, signal, sys
from pathlib import Path
from data_pipeline.registry import index, open_registry
real = index.Index.write
class Dying:
    def __init__(self, idx): self.context = real(idx)
    def __enter__(self): return self.context.__enter__()
    def __exit__(self, *exc):
        if exc[0] is None:  # the version row is written, the transaction not committed: die now
            os.kill(os.getpid(), signal.SIGKILL)
        return self.context.__exit__(*exc)
registry = open_registry(sys.argv[1])
index.Index.write = lambda self: Dying(self)
registry.register("crash/killed", Path(sys.argv[2]), "chat")
"""


def test_a_process_killed_before_commit_leaves_no_version(tmp_path):
    url = str(tmp_path / "registry")
    data = _write_jsonl(tmp_path / "k.jsonl", [_row("a"), _row("b")])
    done = subprocess.run([sys.executable, "-c", _KILLED_IN_TRANSACTION, url, str(data)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    registry = open_registry(url)
    assert registry.blobs.fs.find(str(Path(url) / "blobs"))  # the blobs were written before the kill
    with pytest.raises(RegistryError, match="crash/killed"):
        registry.resolve("crash/killed")
    assert registry.index.read("PRAGMA integrity_check") == [("ok",)]
    assert registry.register("crash/killed", data, "chat").reference == "crash/killed:v1"


# One fresh interpreter imports the registry once (no JAX, one thread: forking it is safe, unlike
# forking pytest), then forks 4 writers that start together at a barrier; each opens its own
# connection after the fork.
_FOUR_WRITERS = """
import multiprocessing, sys
from pathlib import Path
from data_pipeline.registry import open_registry
url, common, files = sys.argv[1], sys.argv[2], sys.argv[3:]
context = multiprocessing.get_context("fork")
barrier, results = context.Barrier(len(files)), context.Queue()
def write(file):
    registry = open_registry(url)
    barrier.wait()
    results.put((registry.register("team/shared", Path(file), "chat").reference,
                 registry.register("team/common", Path(common), "chat").reference))
procs = [context.Process(target=write, args=(f,)) for f in files]
for p in procs: p.start()
got = [results.get(timeout=300) for _ in procs]
for p in procs: p.join()
assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
for shared, common_ref in got: print(shared, common_ref)
"""


def test_concurrent_registrations_from_four_processes(tmp_path):
    url = str(tmp_path / "registry")
    files = [_write_jsonl(tmp_path / f"p{i}.jsonl", [_row(f"process {i}")]) for i in range(4)]
    common = _write_jsonl(tmp_path / "common.jsonl", [_row("everyone")])
    done = subprocess.run([sys.executable, "-c", _FOUR_WRITERS, url, str(common), *map(str, files)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    pairs = [line.split() for line in done.stdout.splitlines()]
    assert sorted(shared for shared, _ in pairs) == [f"team/shared:v{i}" for i in range(1, 5)]
    assert {common_ref for _, common_ref in pairs} == {"team/common:v1"}
    registry = open_registry(url)
    assert registry.index.read("PRAGMA integrity_check") == [("ok",)]
    assert len({registry.resolve(f"team/shared:v{i}").digest for i in range(1, 5)}) == 4
    with sqlite3.connect(str(Path(url) / "index.sqlite")) as conn:
        assert conn.execute("SELECT COUNT(*) FROM versions").fetchone() == (5,)


def test_registry_location_flag_then_environment_then_user_cache(tmp_path, monkeypatch):
    from data_pipeline.registry import registry_location
    monkeypatch.setenv("VALEN_REGISTRY", str(tmp_path / "from-env"))
    assert registry_location("gs://team/registry") == "gs://team/registry"
    assert registry_location() == str(tmp_path / "from-env")
    monkeypatch.delenv("VALEN_REGISTRY")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert registry_location() == str(tmp_path / "cache" / "valen" / "registry")
    data = _write_jsonl(tmp_path / "x.jsonl", [_row("x")])
    open_registry().register("env/x", data, "chat")  # the default location, under the user cache
    assert (tmp_path / "cache" / "valen" / "registry" / "index.sqlite").is_file()
    assert open_registry(f"file://{tmp_path}/cache/valen/registry").resolve("env/x").version == 1


def test_an_example_naming_an_image_the_registry_does_not_hold_is_refused(registry, tmp_path, make_png, monkeypatch):
    # The commit's own check: even when the check before uploading is fooled (here: told every
    # image is held), the transaction refuses a version naming an image the index does not hold.
    make_png("g/images/a.png")
    data = _write_jsonl(tmp_path / "g" / "train.jsonl", [_row("a"), _row("b", "images/a.png")])
    real, calls = type(registry)._held, []

    def fooled_once(self, needed):
        calls.append(1)
        return set(needed) if len(calls) == 1 else real(self, needed)

    monkeypatch.setattr(type(registry), "_held", fooled_once)
    with pytest.raises(RegistryError, match=r"train.jsonl:2: .*a.png \(sha256:[0-9a-f]{64}\) is not held"):
        registry.register("vis/unheld", data, "chat", upload=False)
    with pytest.raises(RegistryError, match="vis/unheld"):
        registry.resolve("vis/unheld")
