"""The shard schema: Examples as named numpy arrays in ArrayRecord files, plus manifest.json.

An Example serialises without pickle as

    u32 little-endian header length | header JSON (sorted keys) | array bytes, concatenated

so the bytes depend only on the Example's content (DESIGN: reproducible shards). The header
holds `meta` (small JSON: format, source line, media digests, ...) and, per array, its
dtype, shape and byte offset. `valen_jax.data` reads shards only through this module.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from data_pipeline.formats.limits import TooLarge, read_file_capped

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
# group_size:1 keeps every record independently addressable, which Grain's random access needs.
_WRITER_OPTIONS = "group_size:1"
_ALLOWED_DTYPES = {"int32", "float32", "uint8", "int64", "bool"}


class ShardError(ValueError):
    """A shard set that cannot be read as this schema (bad bytes, version, fingerprint)."""


@dataclass
class Example:
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        header_arrays = {}
        chunks = []
        offset = 0
        for name in sorted(self.arrays):
            array = np.ascontiguousarray(self.arrays[name])
            if array.dtype.name not in _ALLOWED_DTYPES:
                raise ShardError(f"array {name!r} has dtype {array.dtype}, allowed: {sorted(_ALLOWED_DTYPES)}")
            data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            header_arrays[name] = {"dtype": array.dtype.name, "shape": list(array.shape), "offset": offset}
            chunks.append(data)
            offset += len(data)
        header = json.dumps({"arrays": header_arrays, "meta": self.meta}, sort_keys=True,
                            separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        return struct.pack("<I", len(header)) + header + b"".join(chunks)

    @classmethod
    def from_bytes(cls, data: bytes) -> Example:
        if len(data) < 4:
            raise ShardError("record shorter than its header length field")
        (header_len,) = struct.unpack_from("<I", data, 0)
        try:
            header = json.loads(data[4:4 + header_len].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ShardError(f"record header is not JSON: {err}") from err
        body = memoryview(data)[4 + header_len:]
        arrays = {}
        for name, spec in header["arrays"].items():
            dtype = np.dtype(spec["dtype"]).newbyteorder("<")
            count = int(np.prod(spec["shape"], dtype=np.int64))
            start = spec["offset"]
            stop = start + count * dtype.itemsize
            if stop > len(body):
                raise ShardError(f"array {name!r} runs past the end of the record")
            arrays[name] = np.frombuffer(body[start:stop], dtype=dtype).reshape(spec["shape"]).astype(
                dtype.newbyteorder("="), copy=False)
        return cls(arrays=arrays, meta=header["meta"])


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_name(index: int, count: int) -> str:
    return f"examples-{index:05d}-of-{count:05d}.array_record"


def write_shards(examples: Iterable[bytes], out_dir: Path, num_shards: int) -> list[dict[str, Any]]:
    """Write serialised examples round-robin-free: contiguous runs, in input order.

    Contiguous runs keep shard contents independent of how many workers rendered them.
    """
    records = list(examples)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_shards = max(1, min(num_shards, len(records)))
    bounds = np.linspace(0, len(records), num_shards + 1).round().astype(int)
    written = []
    for index in range(num_shards):
        name = shard_name(index, num_shards)
        path = out_dir / name
        writer = ArrayRecordWriter(str(path), _WRITER_OPTIONS)
        for record in records[bounds[index]:bounds[index + 1]]:
            writer.write(record)
        writer.close()
        written.append({"path": name, "records": int(bounds[index + 1] - bounds[index]),
                        "sha256": sha256_file(path)})
    return written


def read_shard(path: str | Path) -> list[Example]:
    reader = ArrayRecordReader(str(path))
    try:
        return [Example.from_bytes(r) for r in reader.read_all()]
    finally:
        reader.close()


@dataclass(frozen=True)
class Manifest:
    """What a shard set holds and how it was made (DESIGN, "Contracts: Shards")."""

    data: Mapping[str, Any]

    @property
    def shard_paths(self) -> list[str]:
        return [entry["path"] for entry in self.data["shards"]]

    @property
    def fingerprint(self) -> dict[str, str]:
        return dict(self.data["tokenizer"]["fingerprint"])

    def write(self, out_dir: Path) -> None:
        text = json.dumps(self.data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        (out_dir / MANIFEST_NAME).write_text(text, encoding="utf-8")

    @classmethod
    def read(cls, shard_dir: str | Path) -> Manifest:
        path = Path(shard_dir) / MANIFEST_NAME
        if not path.is_file():
            raise ShardError(f"{path}: no manifest; convert the data with python -m data_pipeline.convert")
        try:  # a shard folder is the user's: its manifest is bounded like any whole-file read
            data = json.loads(read_file_capped(path).decode("utf-8"))
        except (ValueError, TooLarge) as error:  # JSON, UTF-8 or size
            raise ShardError(f"{str(path)!r}: not a readable manifest ({error})") from None
        if not isinstance(data, dict):
            raise ShardError(f"{str(path)!r}: not a manifest (a JSON object)")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ShardError(f"{path}: schema_version {data.get('schema_version')!r}, this code reads {SCHEMA_VERSION}")
        return cls(data)

    def check_fingerprint(self, expected: Mapping[str, str], where: str) -> None:
        """Shards made with another tokenizer are refused, never silently re-used (DESIGN)."""
        if dict(expected) != self.fingerprint:
            raise ShardError(
                f"{where}: shards were made with tokenizer {self.fingerprint}, "
                f"but this run uses {dict(expected)}; reconvert the data with this tokenizer")
