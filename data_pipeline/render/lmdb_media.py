"""Read the value of an LMDB media reference (seed 004 "Data Format": `{"lmdb_file": …, "lmdb_key": …}`).

The converter copies the value (the encoded image bytes) into the shard, like any other media, so
training never opens the LMDB (DESIGN: "Media travels inside shards"); the loader decodes those
bytes (`valen_jax.data.media.decode_lmdb_value`).

An LMDB environment is a folder holding data.mdb (the default layout) or a single file opened
with subdir=False; both are accepted. Environments are opened read-only without the lock file,
so a dataset on a read-only mount or shared by many converter workers reads fine, and kept open
per process: a converter reads thousands of values from a few environments, and an environment
must not be used across fork.
"""

from __future__ import annotations

import os
from pathlib import Path

import lmdb

_OPEN: dict[tuple[int, str], lmdb.Environment] = {}


class LmdbMediaError(ValueError):
    """An LMDB reference whose value cannot be read; names the environment and the key."""


def _environment(path: Path) -> lmdb.Environment:
    key = (os.getpid(), str(path))
    env = _OPEN.get(key)
    if env is None:
        if not path.exists():
            raise LmdbMediaError(f"{path}: no LMDB environment there")
        try:
            env = lmdb.open(str(path), subdir=path.is_dir(), readonly=True, lock=False, readahead=False)
        except lmdb.Error as err:
            raise LmdbMediaError(f"{path}: cannot open as an LMDB environment: {err}") from err
        _OPEN[key] = env
    return env


def read_lmdb_value(lmdb_path: str | os.PathLike, key: str | bytes) -> bytes:
    """The bytes stored under `key` (a str key is UTF-8 encoded, as the JSONL writes it)."""
    path = Path(lmdb_path)
    raw_key = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    env = _environment(path)
    with env.begin(buffers=False) as txn:
        value = txn.get(raw_key)
    if value is None:
        raise LmdbMediaError(f"{path}: no key {key!r}")
    return bytes(value)


def close_all() -> None:
    """Close this process's environments (tests; a converter just exits)."""
    for (pid, name), env in list(_OPEN.items()):
        if pid == os.getpid():
            env.close()
            del _OPEN[(pid, name)]
