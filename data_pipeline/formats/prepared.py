"""Prepared token rows and their descriptor (seed 003, "Prepared token rows").

A prepared version is a ZIP holding `prepared.json` and the Parquet files it lists; the rules of
the rows themselves live in `prepared_rows`. `read_prepared` checks the
zip against the descriptor (seed 003, "What is checked"), reads every row in batches and compares
each file's counts with the descriptor; `check_against_tokenizer` and `check_max_seq_length` are
the checks a run makes before claiming devices. Problems read `PATH:ROW: FIELD: message`, where
PATH is `ZIP/member`, ROW the 1-based row of that Parquet file and 0 for the whole file.

Decisions where the seed leaves room:
- A directory holding `prepared.json` is read like the zip it would become: every file under it
  must be listed. Unlisted files (even hidden ones) are refused, as in a zip.
- `tokenizer.revision` must be a full 40-hex commit ("the full commit"); digests are lowercase hex.
- Listed paths are plain relative POSIX paths inside the zip (no `..`, no `\\`), each listed once.
- A file whose SHA-256 differs is not read further: the descriptor's counts describe other bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.formats.errors import FILE_FIELD, FormatError, Problem, describe, member, quote
from data_pipeline.formats.jsonl import loads_strict
from data_pipeline.formats.limits import (
    NotARegularFile,
    TooLarge,
    ZipBudget,
    check_regular_file,
    read_file_capped,
)
from data_pipeline.formats.prepared_rows import STATS_KEYS, FileStats, scan_rows
from data_pipeline.shards import sha256_file as file_sha256

DESCRIPTOR_NAME = "prepared.json"
DESCRIPTOR_KEYS = ("tokenizer", "tokenizerSha256", "chatTemplateSha256", "files")
FILE_KEYS = ("path", "sha256", *STATS_KEYS)
HEX64 = re.compile(r"[0-9a-f]{64}")
COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class PreparedFile:
    path: str  # inside the zip
    sha256: str
    stats: FileStats

    def to_json(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, **self.stats.to_json()}


@dataclass(frozen=True)
class PreparedDescriptor:
    repository: str
    revision: str  # full commit
    tokenizer_sha256: str
    chat_template_sha256: str
    files: tuple[PreparedFile, ...]  # training order
    origin: str = ""  # the zip or directory it was read from; problems name PATH under it

    def to_json(self) -> dict:
        return {
            "tokenizer": {"repository": self.repository, "revision": self.revision},
            "tokenizerSha256": self.tokenizer_sha256,
            "chatTemplateSha256": self.chat_template_sha256,
            "files": [f.to_json() for f in self.files],
        }

    def where(self, name: str) -> str:
        return f"{self.origin}/{name}" if self.origin else name


def parse_descriptor(data: bytes, source: str, origin: str = "") -> PreparedDescriptor:
    """The descriptor in `data` (prepared.json's bytes), or a FormatError naming each bad field."""
    problems: list[Problem] = []

    def bad(field: str, message: str) -> None:
        problems.append(Problem(source, 0, field, message))

    try:
        obj = loads_strict(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise FormatError([Problem(source, 0, FILE_FIELD, f"not a JSON document: {err}")]) from None
    if not isinstance(obj, dict):
        raise FormatError([Problem(source, 0, FILE_FIELD, "must be a JSON object")])
    _keys(obj, DESCRIPTOR_KEYS, "", bad)
    tok = obj.get("tokenizer")
    if isinstance(tok, dict):
        _keys(tok, ("repository", "revision"), "tokenizer", bad)
        if not (
            isinstance(tok.get("repository"), str) and tok["repository"].strip() == tok["repository"] != ""
        ):
            bad("tokenizer.repository", "must name the model repository, such as org/model")
        if not (isinstance(tok.get("revision"), str) and COMMIT.fullmatch(tok["revision"])):
            bad(
                "tokenizer.revision",
                "must be the full commit the tokenizer was loaded from (40 lowercase hex digits)",
            )
    elif "tokenizer" in obj:
        bad("tokenizer", "must be an object {repository, revision}")
    for key in ("tokenizerSha256", "chatTemplateSha256"):
        if key in obj and not (isinstance(obj[key], str) and HEX64.fullmatch(obj[key])):
            bad(key, "must be a SHA-256 digest: 64 lowercase hex digits")
    files = obj.get("files")
    if "files" in obj and (not isinstance(files, list) or not files):
        bad("files", "must be a non-empty list of files in training order")
    seen: set[str] = set()
    for i, entry in enumerate(files if isinstance(files, list) else []):
        field = f"files[{i}]"
        if not isinstance(entry, dict):
            bad(field, f"must be an object with {', '.join(FILE_KEYS)}")
            continue
        _keys(entry, FILE_KEYS, field, bad)
        path = entry.get("path")
        if not _member_path(path):
            bad(
                f"{field}.path",
                "must be a relative path inside the zip (no '..', no '\\', not prepared.json)",
            )
        elif path in seen:
            bad(f"{field}.path", f"{describe(path)} is listed twice")
        else:
            seen.add(path)
        if "sha256" in entry and not (isinstance(entry["sha256"], str) and HEX64.fullmatch(entry["sha256"])):
            bad(f"{field}.sha256", "must be a SHA-256 digest: 64 lowercase hex digits")
        for key in STATS_KEYS:
            value = entry.get(key)
            if key in entry and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                bad(f"{field}.{key}", f"must be an integer >= 0, got {describe(value)}")
    if problems:
        raise FormatError(problems)
    return PreparedDescriptor(
        tok["repository"],
        tok["revision"],
        obj["tokenizerSha256"],
        obj["chatTemplateSha256"],
        tuple(PreparedFile(f["path"], f["sha256"], FileStats(*(f[k] for k in STATS_KEYS))) for f in files),
        origin,
    )


@dataclass(frozen=True)
class PreparedDataset:
    descriptor: PreparedDescriptor
    stats: tuple[FileStats, ...]  # as read, in the descriptor's order


def read_prepared(path: str | Path) -> PreparedDataset:
    """Check a prepared zip (or directory) against its descriptor and read every row."""
    path = Path(path)
    origin = str(path)
    with _Container(path) as box:
        names = box.names()
        if DESCRIPTOR_NAME not in names:
            raise FormatError(
                [Problem(origin, 0, DESCRIPTOR_NAME, "missing; a prepared version holds prepared.json")]
            )
        desc = parse_descriptor(box.read(DESCRIPTOR_NAME), f"{origin}/{DESCRIPTOR_NAME}", origin)
        listed = [f.path for f in desc.files]
        problems = [
            Problem(
                desc.where(n),
                0,
                FILE_FIELD,
                "not listed in prepared.json; a zip holds only the files it lists",
            )
            for n in names
            if n not in listed and n != DESCRIPTOR_NAME
        ]
        problems += [
            Problem(desc.where(n), 0, FILE_FIELD, "listed in prepared.json but missing")
            for n in listed
            if n not in names
        ]
        stats: list[FileStats] = []
        for entry in desc.files:
            if entry.path not in names:
                continue
            source = desc.where(entry.path)
            try:
                local, digest = box.extract(entry.path)
            except (zipfile.BadZipFile, zlib.error, OSError, TooLarge) as err:
                problems.append(Problem(source, 0, FILE_FIELD, f"cannot read from the zip: {err}"))
                continue
            if digest != entry.sha256:
                problems.append(
                    Problem(
                        source,
                        0,
                        "sha256",
                        f"the file's SHA-256 is {digest}; prepared.json states {entry.sha256}",
                    )
                )
                continue
            found, row_problems = scan_rows(local, source)
            problems += row_problems
            if found is not None:
                stats.append(found)
                problems += _compare(source, found, entry.stats)
        if problems:
            raise FormatError(problems)
        return PreparedDataset(desc, tuple(stats))


def check_against_tokenizer(
    descriptor: PreparedDescriptor, tokenizer, repository: str | None = None, revision: str | None = None
) -> None:
    """Seed 003: refuse rows prepared with another tokenizer, chat template, repository or commit."""
    from data_pipeline.tokenizer import sha256_text  # lazy: validate should not import transformers

    source = descriptor.where(DESCRIPTOR_NAME)
    template = tokenizer.chat_template
    actual = {
        "tokenizerSha256": sha256_text(tokenizer.backend_tokenizer.to_str()),
        "chatTemplateSha256": sha256_text(template) if isinstance(template, str) else None,
    }
    stated = {
        "tokenizerSha256": descriptor.tokenizer_sha256,
        "chatTemplateSha256": descriptor.chat_template_sha256,
    }
    problems = []
    for key, value in actual.items():
        if value is None:
            problems.append(Problem(source, 0, key, "the tokenizer has no single chat template to compare"))
        elif value != stated[key]:
            problems.append(
                Problem(
                    source,
                    0,
                    key,
                    f"prepared with another tokenizer: {stated[key]} here, {value} for the base model",
                )
            )
    for key, want, have in (
        ("repository", repository, descriptor.repository),
        ("revision", revision, descriptor.revision),
    ):
        if want is not None and want != have:
            problems.append(
                Problem(
                    source,
                    0,
                    f"tokenizer.{key}",
                    f"prepared at {quote(have)}, but the run trains {quote(want)}",
                )
            )
    if problems:
        raise FormatError(problems)


def check_max_seq_length(descriptor: PreparedDescriptor, max_len: int) -> None:
    """Seed 003: a run never truncates prepared rows, so the longest row must fit."""
    problems = [
        Problem(
            descriptor.where(f.path),
            0,
            "longestRow",
            f"{f.stats.longest_row} tokens, longer than maxSeqLength {max_len}",
        )
        for f in descriptor.files
        if f.stats.longest_row > max_len
    ]
    if problems:
        raise FormatError(problems)


def _compare(source: str, found: FileStats, stated: FileStats) -> list[Problem]:
    pairs = zip(STATS_KEYS, found.to_json().values(), stated.to_json().values(), strict=True)
    return [
        Problem(source, 0, key, f"{a} in the file, but prepared.json states {b}")
        for key, a, b in pairs
        if a != b
    ]


def _keys(obj: dict, wanted: tuple[str, ...], field: str, bad) -> None:
    for key in obj:
        if key not in wanted:
            bad(member(field, key), f"unknown key; expected {', '.join(wanted)}")
    for key in wanted:
        if key not in obj:
            bad(member(field, key), "required")


def _member_path(path: object) -> bool:
    if not isinstance(path, str) or not path or "\\" in path or path == DESCRIPTOR_NAME:
        return False
    # Empty, "." and ".." segments would name one member two ways or leave the zip.
    return not path.startswith("/") and all(part not in ("", ".", "..") for part in path.split("/"))


class _Container:
    """A zip or a directory: member names, and each member as a local file with its SHA-256."""

    def __init__(self, path: Path):
        self.path, self.origin = path, str(path)
        self.zip: zipfile.ZipFile | None = None
        self.budget: ZipBudget | None = None
        self.tmp: tempfile.TemporaryDirectory | None = None
        self.extracted = 0

    def __enter__(self) -> _Container:
        if self.path.is_dir():
            return self
        try:
            check_regular_file(self.path)  # /dev/zero "seeks" to its end and reads for ever (issue 27)
            self.zip = zipfile.ZipFile(self.path)
        except FileNotFoundError:
            raise FormatError([Problem(self.origin, 0, FILE_FIELD, "no such file")]) from None
        except NotARegularFile as err:
            raise FormatError([Problem(self.origin, 0, FILE_FIELD, err.strerror)]) from None
        except (zipfile.BadZipFile, OSError) as err:
            raise FormatError([Problem(self.origin, 0, FILE_FIELD, f"not a zip file: {err}")]) from None
        try:
            # Declared sizes first: a zip bomb is refused before one byte is extracted.
            self.budget = ZipBudget(self.zip)
        except TooLarge as err:
            self.zip.close()
            raise FormatError([Problem(self.origin, 0, FILE_FIELD, str(err))]) from None
        self.tmp = tempfile.TemporaryDirectory(prefix="prepared-")
        return self

    def __exit__(self, *exc) -> None:
        if self.zip is not None:
            self.zip.close()
        if self.tmp is not None:
            self.tmp.cleanup()

    def names(self) -> list[str]:
        if self.zip is None:
            return sorted(p.relative_to(self.path).as_posix() for p in self.path.rglob("*") if not p.is_dir())
        names = [info.filename for info in self.zip.infolist() if not info.is_dir()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise FormatError(
                [Problem(f"{self.origin}/{n}", 0, FILE_FIELD, "stored twice in the zip") for n in repeated]
            )
        return names

    def read(self, name: str) -> bytes:
        try:
            return read_file_capped(self.path / name) if self.budget is None else self.budget.read(name)
        except (zipfile.BadZipFile, zlib.error, OSError, TooLarge) as err:
            raise FormatError(
                [Problem(f"{self.origin}/{name}", 0, FILE_FIELD, f"cannot read: {err}")]
            ) from None

    def extract(self, name: str) -> tuple[Path, str]:
        if self.zip is None:
            return self.path / name, file_sha256(self.path / name)
        # Parquet needs a seekable file; a numbered temp name keeps member names out of the file system.
        assert self.tmp is not None and self.budget is not None
        self.extracted += 1
        local = Path(self.tmp.name) / f"{self.extracted}.parquet"
        digest = hashlib.sha256()

        def write(chunk: bytes) -> None:
            digest.update(chunk)
            dst.write(chunk)

        with open(local, "wb") as dst:
            self.budget.copy(name, write)  # stops at the member's declared size and the zip's budget
        return local, digest.hexdigest()


def write_prepared_zip(descriptor: PreparedDescriptor, files: list[Path], out: Path) -> None:
    """The zip to register: prepared.json first, then each listed file under its descriptor path."""
    # Fixed timestamps: the same rows give the same zip bytes, so registering again finds the same version.
    stamp = (1980, 1, 1, 0, 0, 0)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        text = json.dumps(descriptor.to_json(), indent=1) + "\n"
        zf.writestr(zipfile.ZipInfo(DESCRIPTOR_NAME, stamp), text)
        for entry, local in zip(descriptor.files, files, strict=True):
            with open(local, "rb") as src, zf.open(zipfile.ZipInfo(entry.path, stamp), "w") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
