"""What a registered version holds, and how it becomes a local file again.

A version is a manifest: the format, the examples' blobs (their SHA-256s), and the media blobs it uses.
Its digest is the SHA-256 of the manifest's canonical JSON, so the same examples give the same
digest (registration returns the existing version) and any change gives a new one.

- JSONL formats are stored one canonical JSON line per example (key order kept, no whitespace,
  blank lines dropped), so re-serialising a file does not make a new version.
- JSONL examples are cut into chunks of rows at content-defined boundaries (after a row whose
  CRC-32 ends in 8 zero bits: ~270 rows a chunk, 16 to 4096), so a version that changes some rows
  uploads only the chunks holding them, and the boundaries elsewhere stay where they were.
- chat: each image part's `path` is replaced by `sha256:HEX` of the image (seed 003, "Images");
  each image is its own blob, so a second version reusing images uploads only its text.
- valen, vflash, vakforge: media files the examples name (any string naming a file inside the
  JSONL's folder, e.g. vakforge audio and redaction logs) and vakforge's splits.json are blobs kept
  under their relative path; the examples keep the paths as written.
- prepared: the zip as given (a directory is refused: register the zip describe_prepared writes).
- recipe: refused; register each annotation file (a recipe is a list of files with options).

`materialise` writes a version into a local folder the converters read like a user's file.
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.format_registry import FORMATS
from data_pipeline.formats.errors import FormatError
from data_pipeline.formats.vakforge_splits import SPLITS_FILE
from data_pipeline.registry import publication
from data_pipeline.registry.references import RegistryError
from data_pipeline.registry.store import sha256_hex

MIB = 1 << 20
DEFAULT_UPLOAD_LIMIT = 256 * MIB
IMAGE_PREFIX = "sha256:"
_COMPANIONS = {"vakforge": (SPLITS_FILE,)}


@dataclass(frozen=True)
class LocalBlob:
    hexdigest: str
    source: Path  # the local file it is read from
    size: int
    suffix: str  # kept so a materialised image keeps its extension


@dataclass
class Prepared:
    """A file ready to register: its manifest, the blobs it needs, and where images appear."""

    fmt: str
    examples: bytes  # the stored examples (canonical JSONL, or the zip's bytes)
    media: dict[str, LocalBlob] = field(default_factory=dict)  # written path -> blob (non-chat)
    images: dict[str, LocalBlob] = field(default_factory=dict)  # hexdigest -> blob (chat)
    image_lines: dict[str, int] = field(default_factory=dict)  # hexdigest -> first line naming it
    size: int = 0  # bytes of the upload: examples + every media file or image they use
    _chunks: list[tuple[str, bytes]] | None = None

    def chunks(self) -> list[tuple[str, bytes]]:
        """The examples as (sha256 hex, bytes) blobs; their concatenation is `examples`."""
        if self.fmt == "prepared":
            return [(sha256_hex(self.examples), self.examples)]
        if self._chunks is None:
            self._chunks = [(sha256_hex(chunk), chunk) for chunk in _row_chunks(self.examples)]
        return self._chunks

    def manifest(self) -> dict:
        return {
            "format": self.fmt,
            "examples": [hexdigest for hexdigest, _ in self.chunks()],
            "images": sorted(self.images),
            "media": {written: blob.hexdigest for written, blob in sorted(self.media.items())},
        }


_CHUNK_MASK = 0xFF  # a boundary after ~1 row in 256
_CHUNK_ROWS = 4096  # and after at most this many rows


_CHUNK_MIN_ROWS = 16  # so runs of repeated rows (all boundaries, or none) do not make tiny chunks


def _row_chunks(examples: bytes) -> list[bytes]:
    chunks, start, line, rows = [], 0, 0, 0
    position = examples.find(b"\n")
    while position != -1:
        rows += 1
        boundary = rows >= _CHUNK_MIN_ROWS and zlib.crc32(examples[line:position]) & _CHUNK_MASK == 0
        if boundary or rows == _CHUNK_ROWS:
            chunks.append(examples[start:position + 1])
            start, rows = position + 1, 0
        line = position + 1
        position = examples.find(b"\n", line)
    if start < len(examples):
        chunks.append(examples[start:])
    return chunks


def manifest_digest(manifest: dict) -> str:
    return "sha256:" + sha256_hex(canonical_json(manifest).encode())


def canonical_json(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _limit_refusal(what: str, size: int, limit: int) -> RegistryError:
    return RegistryError(
        f"{what}: {size} bytes exceed the upload limit of {limit} bytes ({limit / MIB:g} MiB); "
        f"register a smaller file or raise the limit (--upload-limit-mib)"
    )


def prepare(path: Path, fmt: str, limit: int) -> Prepared:
    """Validate `path` with its format's validator (format_registry), refuse rows that may not be
    published (`publication`), then build what is stored."""
    if fmt not in FORMATS:
        raise RegistryError(f"--format={fmt}: not a format; choose one of {', '.join(FORMATS)}")
    if fmt == "recipe":
        raise RegistryError(f"{path}: a recipe is not registered whole; register each annotation file "
                            f"(--format=vflash) and name the references in the recipe")
    if not path.is_file():
        what = "a directory (register the prepared zip)" if path.is_dir() else "not found"
        raise RegistryError(f"{path}: {what}")
    size = path.stat().st_size
    if size > limit:
        raise _limit_refusal(str(path), size, limit)
    if fmt == "prepared":
        _check_zip_size(path, limit)
    try:
        FORMATS[fmt].validate(path, True, **publication.VALIDATE_OPTIONS.get(fmt, {}))
    except FormatError as err:
        raise RegistryError(f"{path} is refused by the {fmt} validator:\n{err}") from None
    publication.check_publishable(path, fmt)  # before anything is read for upload
    if fmt == "prepared":
        data = path.read_bytes()
        return Prepared(fmt, data, size=len(data))
    prepared = _prepare_chat(path, fmt) if fmt == "chat" else _prepare_jsonl(path, fmt)
    if prepared.size > limit:
        raise _limit_refusal(f"{path} with its media", prepared.size, limit)
    return prepared


def _check_zip_size(path: Path, limit: int) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            extracted = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError) as err:
        raise RegistryError(f"{path}: not a zip file: {err}") from None
    if extracted > limit:
        raise _limit_refusal(f"{path} extracted", extracted, limit)


class _Hasher:
    """Each local file hashed once however many examples name it."""

    def __init__(self):
        self.seen: dict[str, LocalBlob] = {}

    def __call__(self, path: str) -> LocalBlob:
        blob = self.seen.get(path)
        if blob is None:
            data = Path(path).read_bytes()
            blob = LocalBlob(sha256_hex(data), Path(path), len(data), Path(path).suffix.lower())
            self.seen[path] = blob
        return blob


def _lines(path: Path):
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if raw.strip():
                yield number, json.loads(raw)


def _prepare_chat(path: Path, fmt: str) -> Prepared:
    folder, hasher, out = path.parent, _Hasher(), []
    prepared = Prepared(fmt, b"")
    for number, obj in _lines(path):
        for message in obj.get("messages", ()):
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    blob = hasher(os.path.normpath(os.path.join(folder, part["path"])))
                    part["path"] = IMAGE_PREFIX + blob.hexdigest
                    prepared.images.setdefault(blob.hexdigest, blob)
                    prepared.image_lines.setdefault(blob.hexdigest, number)
        out.append(canonical_json(obj))
    prepared.examples = ("\n".join(out) + "\n").encode()
    prepared.size = len(prepared.examples) + sum(b.size for b in prepared.images.values())
    return prepared


def _prepare_jsonl(path: Path, fmt: str) -> Prepared:
    folder = os.path.realpath(path.parent)
    own = os.path.realpath(path)
    hasher, out, media = _Hasher(), [], {}

    def visit(value: object) -> None:
        if isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list):
            for item in value:
                visit(item)
        elif isinstance(value, str) and 0 < len(value) < 1024 and "\n" not in value and "://" not in value:
            if value in media or os.path.isabs(value):
                return
            real = os.path.realpath(os.path.join(folder, value))
            if real != own and real.startswith(folder + os.sep) and os.path.isfile(real):
                media[value] = hasher(real)

    for _, obj in _lines(path):
        visit(obj)
        out.append(canonical_json(obj))
    # Files a format reads beside the JSONL without the examples naming them (seed 002: vakforge's
    # splits.json next to the manifest).
    for companion in _COMPANIONS.get(fmt, ()):
        if (path.parent / companion).is_file():
            media[companion] = hasher(os.path.realpath(path.parent / companion))
    examples = ("\n".join(out) + "\n").encode()
    return Prepared(fmt, examples, media=media, size=len(examples) + sum(b.size for b in media.values()))


def materialise(folder: Path, manifest: dict, get_blob, suffixes: dict[str, str]) -> Path:
    """Write a version into `folder` (which must not exist yet); returns the file to read.

    `get_blob(hex) -> bytes`; `suffixes`: image digest -> file extension.
    """
    fmt = manifest["format"]
    folder.mkdir(parents=True)
    examples = b"".join(get_blob(hexdigest) for hexdigest in manifest["examples"])
    if fmt == "prepared":
        target = folder / "prepared.zip"
        target.write_bytes(examples)
        return target
    target = folder / f"{fmt}.jsonl"
    if fmt == "chat":
        (folder / "images").mkdir()
        for hexdigest in manifest["images"]:
            (folder / "images" / f"{hexdigest}{suffixes.get(hexdigest, '')}").write_bytes(get_blob(hexdigest))
        examples = _chat_local_paths(examples, suffixes)
    for written, hexdigest in manifest["media"].items():
        local = folder / written
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(get_blob(hexdigest))
    target.write_bytes(examples)
    return target


def _chat_local_paths(examples: bytes, suffixes: dict[str, str]) -> bytes:
    out = []
    for line in examples.decode().splitlines():
        obj = json.loads(line)
        for message in obj.get("messages", ()):
            content = message.get("content")
            for part in content if isinstance(content, list) else ():
                if isinstance(part, dict) and part.get("type") == "image":
                    hexdigest = part["path"][len(IMAGE_PREFIX):]
                    part["path"] = f"images/{hexdigest}{suffixes.get(hexdigest, '')}"
        out.append(canonical_json(obj))
    return ("\n".join(out) + "\n").encode()
