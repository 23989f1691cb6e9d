"""Content-addressed blob store on a local directory or any fsspec URL (`gs://…`, `memory://…`).

A blob's key is the SHA-256 of its bytes, so a blob is written once and never changed: a writer
puts the bytes under a temporary name and renames them into place (a reader never sees half a
blob), and two writers of the same key write the same bytes. Reads check the digest, so a
damaged blob is an error naming it, never data.
"""

from __future__ import annotations

import hashlib
import uuid

import fsspec

from data_pipeline.registry.references import RegistryError


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BlobStore:
    def __init__(self, url: str):
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")
        self.uploaded_bytes = 0  # bytes this object wrote (benchmarks/registry.py reports it)

    def _key(self, hexdigest: str) -> str:
        return f"{self.root}/sha256/{hexdigest[:2]}/{hexdigest}"

    def has(self, hexdigest: str) -> bool:
        return self.fs.exists(self._key(hexdigest))

    def put(self, hexdigest: str, data: bytes) -> int:
        """Store `data` under its digest (checked); returns the bytes written (0 when held)."""
        if sha256_hex(data) != hexdigest:
            raise RegistryError(f"blob sha256:{hexdigest}: the bytes given have another digest")
        key = self._key(hexdigest)
        if self.fs.exists(key):
            return 0
        parent = key.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        temporary = f"{key}.tmp-{uuid.uuid4().hex}"
        self.fs.pipe_file(temporary, data)
        self.fs.mv(temporary, key)
        self.uploaded_bytes += len(data)
        return len(data)

    def get(self, hexdigest: str) -> bytes:
        key = self._key(hexdigest)
        try:
            data = self.fs.cat_file(key)
        except FileNotFoundError:
            raise RegistryError(f"blob sha256:{hexdigest} is missing from the blob store {self.url}") from None
        if sha256_hex(data) != hexdigest:
            raise RegistryError(f"blob sha256:{hexdigest} in {self.url} is damaged (its bytes have another digest)")
        return data
