"""The Registry: register, resolve, list and alias named, versioned, immutable datasets (seed 003).

Location (`registry_location`): `--registry=URL`, else `$VALEN_REGISTRY`, else
`~/.cache/valen/registry` (`$XDG_CACHE_HOME` honoured). A local directory (or `file://` URL) holds
`index.sqlite` and `blobs/`. Any other fsspec URL (`gs://bucket/registry`, `memory://…`) holds the
blobs only; its SQLite index is a local path given separately (`index=`, `--index`, or
`$VALEN_REGISTRY_INDEX`), and is refused when missing: SQLite cannot live on an object store, and a
silently private index would split a team's registry. Resolved versions are written out once
under `materialised/` next to the index.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.registry import content
from data_pipeline.registry.index import Index, now
from data_pipeline.registry.references import (
    LATEST,
    Reference,
    RegistryError,
    check_alias_name,
    parse_qualified,
    parse_reference,
)
from data_pipeline.registry.store import BlobStore, sha256_hex


@dataclass(frozen=True)
class Resolved:
    reference: str  # canonical "ns/name:vN"
    namespace: str
    name: str
    version: int
    digest: str  # "sha256:<hex>" of the version's manifest (format, examples and media digests)
    format: str  # a data_pipeline.format_registry format name
    path: Path  # a local file the converters read like a user's file
    new: bool = field(default=False, compare=False)  # register: True when this call added the version


class MissingImagesError(RegistryError):
    """--no-upload: images (or media files) the registry does not hold (nothing was registered)."""

    def __init__(self, path: Path, missing: list[content.LocalBlob]):
        self.missing = missing
        names = "\n".join(f"  {blob.source} (sha256:{blob.hexdigest})" for blob in missing)
        super().__init__(f"{path}: {len(missing)} images are not in the registry; nothing was registered "
                         f"(push them with `images push`, or register without --no-upload):\n{names}")


def registry_location(url: str | None = None) -> str:
    if url:
        return url
    if os.environ.get("VALEN_REGISTRY"):
        return os.environ["VALEN_REGISTRY"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "valen", "registry")


def _local_dir(url: str) -> Path | None:
    if url.startswith("file://"):
        return Path(url[len("file://"):])
    return None if "://" in url else Path(url)


def open_registry(url: str | None = None, *, index: str | os.PathLike | None = None,
                  upload_limit: int | None = None) -> Registry:
    return Registry(registry_location(url), index=index, upload_limit=upload_limit)


class Registry:
    def __init__(self, url: str, *, index: str | os.PathLike | None = None, upload_limit: int | None = None):
        self.url = url
        local = _local_dir(url)
        index = index or os.environ.get("VALEN_REGISTRY_INDEX")
        if index is None and local is None:
            raise RegistryError(
                f"registry {url}: a remote blob store needs a local SQLite index; give --index=PATH "
                f"or set VALEN_REGISTRY_INDEX"
            )
        index_path = Path(index) if index is not None else local / "index.sqlite"
        self.blobs = BlobStore(str(local / "blobs") if local is not None else url.rstrip("/") + "/blobs")
        self.index = Index(index_path)
        self.cache = index_path.parent / "materialised"
        self.upload_limit = content.DEFAULT_UPLOAD_LIMIT if upload_limit is None else int(upload_limit)

    # --- registering ---

    def register(self, qualified: str, file: Path, fmt: str, *, alias: str | None = None,
                 upload: bool = True) -> Resolved:
        ref = parse_qualified(qualified)
        alias = check_alias_name(alias) if alias is not None else None
        file = Path(file)
        prepared = content.prepare(file, fmt, self.upload_limit)
        manifest = prepared.manifest()
        digest = content.manifest_digest(manifest)
        existing = self._by_digest(ref, digest)
        # Images (chat) and media files (valen, vflash, vakforge) alike: blobs the index records as held.
        needed = {**prepared.images, **{blob.hexdigest: blob for blob in prepared.media.values()}}
        if existing is None:
            held = self._held(needed)
            missing = [blob for hexdigest, blob in needed.items() if hexdigest not in held]
            if not upload and missing:
                raise MissingImagesError(file, missing)
            # Blobs first (each renamed into place whole); the version row only after all of them.
            for hexdigest, chunk in prepared.chunks():
                self.blobs.put(hexdigest, chunk)
            for blob in missing if upload else ():
                self.blobs.put(blob.hexdigest, blob.source.read_bytes())
        with self.index.write() as conn:
            version = self._by_digest(ref, digest)  # another process may have registered it meanwhile
            new = version is None
            if new:
                if upload:
                    conn.executemany("INSERT OR IGNORE INTO blobs VALUES (?, ?, ?)",
                                     [(b.hexdigest, b.size, b.suffix) for b in needed.values()])
                unheld = set(needed) - self._held(needed)
                if unheld:
                    first = min(unheld, key=lambda h: prepared.image_lines.get(h, 0))
                    raise RegistryError(f"{file}:{prepared.image_lines.get(first, 0)}: {needed[first].source} "
                                        f"(sha256:{first}) is not held by the registry ({len(unheld)} such files)")
                conn.execute("INSERT OR IGNORE INTO datasets VALUES (?, ?, ?)", (ref.namespace, ref.name, now()))
                (top,) = conn.execute("SELECT COALESCE(MAX(version), 0) FROM versions WHERE namespace=? AND name=?",
                                      (ref.namespace, ref.name)).fetchone()
                version = top + 1
                conn.execute("INSERT INTO versions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (ref.namespace, ref.name, version, digest, fmt, json.dumps(manifest),
                              prepared.size, now()))
            if alias is not None:
                conn.execute("INSERT OR REPLACE INTO aliases VALUES (?, ?, ?, ?)",
                             (ref.namespace, ref.name, alias, version))
        resolved = self._resolved(ref, version)
        return Resolved(**{**resolved.__dict__, "new": new})

    def push_images(self, paths) -> list[str]:
        """Upload images (each once, by content); returns their `sha256:HEX`."""
        blobs = []
        for path in map(Path, paths):
            if not path.is_file():
                raise RegistryError(f"{path}: not found" if not path.exists() else f"{path}: not a file")
            data = path.read_bytes()
            if len(data) > self.upload_limit:
                raise content._limit_refusal(str(path), len(data), self.upload_limit)
            hexdigest = sha256_hex(data)
            self.blobs.put(hexdigest, data)
            blobs.append((hexdigest, len(data), path.suffix.lower()))
        with self.index.write() as conn:
            conn.executemany("INSERT OR IGNORE INTO blobs VALUES (?, ?, ?)", blobs)
        return [f"sha256:{hexdigest}" for hexdigest, _, _ in blobs]

    def set_alias(self, qualified_alias: str, version: int | str) -> Resolved:
        if ":" not in qualified_alias:
            raise RegistryError(f"{qualified_alias!r}: write NAMESPACE/NAME:ALIAS")
        qualified, alias = qualified_alias.rsplit(":", 1)
        ref, alias = parse_qualified(qualified), check_alias_name(alias)
        text = str(version).strip().lower()
        number = int(text[1:] if text.startswith("v") else text) if text.lstrip("v").isdigit() else None
        if number is None:
            raise RegistryError(f"version {version!r}: write a number such as 3 or v3")
        with self.index.write() as conn:
            if not conn.execute("SELECT 1 FROM versions WHERE namespace=? AND name=? AND version=?",
                                (ref.namespace, ref.name, number)).fetchone():
                raise RegistryError(f"{ref.qualified}:v{number}: no such version in the registry {self.url}")
            conn.execute("INSERT OR REPLACE INTO aliases VALUES (?, ?, ?, ?)", (ref.namespace, ref.name, alias, number))
        return self._resolved(ref, number)

    # --- reading ---

    def resolve(self, reference: str, default_namespace: str | None = None) -> Resolved:
        ref = parse_reference(reference, default_namespace)
        self._dataset(ref)
        if ref.digest is not None:
            version = self._by_digest(ref, ref.digest)
            what = f"{ref.qualified}@{ref.digest}"
        elif ref.version is not None:
            rows = self.index.read("SELECT version FROM versions WHERE namespace=? AND name=? AND version=?",
                                   (ref.namespace, ref.name, ref.version))
            version, what = (rows[0][0] if rows else None), f"{ref.qualified}:v{ref.version}"
        elif ref.alias == LATEST:
            version, what = self._latest(ref), f"{ref.qualified}:latest"
        else:
            rows = self.index.read("SELECT version FROM aliases WHERE namespace=? AND name=? AND alias=?",
                                   (ref.namespace, ref.name, ref.alias))
            version, what = (rows[0][0] if rows else None), f"{ref.qualified}:{ref.alias}"
        if version is None:
            raise RegistryError(f"registry reference {reference!r} ({what}): no such version or alias in the "
                                f"registry {self.url}")
        return self._resolved(ref, version)

    def versions(self, qualified: str) -> list[dict]:
        ref = parse_qualified(qualified)
        self._dataset(ref)
        aliases: dict[int, list[str]] = {}
        for alias, version in self.index.read("SELECT alias, version FROM aliases WHERE namespace=? AND name=? "
                                              "ORDER BY alias", (ref.namespace, ref.name)):
            aliases.setdefault(version, []).append(alias)
        rows = self.index.read("SELECT version, digest, format, size, created FROM versions WHERE namespace=? "
                               "AND name=? ORDER BY version", (ref.namespace, ref.name))
        latest = rows[-1][0]
        return [{"reference": f"{ref.qualified}:v{v}", "version": v, "digest": d, "format": f, "size": s,
                 "created": c, "aliases": ([LATEST] if v == latest else []) + aliases.get(v, [])}
                for v, d, f, s, c in rows]

    def list(self, namespace: str) -> list[dict]:
        namespace = namespace.strip().lower()
        rows = self.index.read("SELECT name, MAX(version), COUNT(*) FROM versions WHERE namespace=? GROUP BY name "
                               "ORDER BY name", (namespace,))
        return [{"dataset": f"{namespace}/{name}", "latest": f"{namespace}/{name}:v{top}", "versions": count}
                for name, top, count in rows]

    # --- helpers ---

    def _dataset(self, ref: Reference) -> None:
        if not self.index.read("SELECT 1 FROM datasets WHERE namespace=? AND name=?", (ref.namespace, ref.name)):
            raise RegistryError(f"dataset {ref.qualified}: not in the registry {self.url}")

    def _latest(self, ref: Reference) -> int | None:
        (top,) = self.index.read("SELECT MAX(version) FROM versions WHERE namespace=? AND name=?",
                                 (ref.namespace, ref.name))[0]
        return top

    def _by_digest(self, ref: Reference, digest: str) -> int | None:
        rows = self.index.read("SELECT version FROM versions WHERE namespace=? AND name=? AND digest=?",
                               (ref.namespace, ref.name, digest))
        return rows[0][0] if rows else None

    def _held(self, images: dict) -> set[str]:
        held: set[str] = set()
        keys = list(images)
        for start in range(0, len(keys), 500):  # SQLite's bound on parameters per statement
            chunk = keys[start:start + 500]
            held.update(h for (h,) in self.index.read(
                f"SELECT hash FROM blobs WHERE hash IN ({','.join('?' * len(chunk))})", tuple(chunk)))
        return held

    def _resolved(self, ref: Reference, version: int) -> Resolved:
        digest, fmt, manifest = self.index.read(
            "SELECT digest, format, manifest FROM versions WHERE namespace=? AND name=? AND version=?",
            (ref.namespace, ref.name, version))[0]
        path = self._materialise(digest, json.loads(manifest))
        return Resolved(f"{ref.qualified}:v{version}", ref.namespace, ref.name, version, digest, fmt, path)

    def _materialise(self, digest: str, manifest: dict) -> Path:
        final = self.cache / digest.removeprefix("sha256:")
        name = "prepared.zip" if manifest["format"] == "prepared" else f"{manifest['format']}.jsonl"
        if not final.is_dir():
            suffixes = dict(self._suffixes(manifest["images"]))
            temporary = self.cache / f".tmp-{uuid.uuid4().hex}"
            try:
                content.materialise(temporary, manifest, self.blobs.get, suffixes)
                try:
                    temporary.rename(final)
                except OSError:  # another process wrote the same version first: same bytes
                    if not final.is_dir():
                        raise
            finally:
                shutil.rmtree(temporary, ignore_errors=True)
        return final / name

    def _suffixes(self, hexdigests: list[str]):
        for start in range(0, len(hexdigests), 500):
            chunk = hexdigests[start:start + 500]
            yield from self.index.read(f"SELECT hash, suffix FROM blobs WHERE hash IN ({','.join('?' * len(chunk))})",
                                       tuple(chunk))
