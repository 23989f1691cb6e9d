"""The registry's index: one SQLite database (stdlib, WAL) holding datasets, versions, aliases and
which blobs the store holds.

Every change runs in one `BEGIN IMMEDIATE` transaction, which takes SQLite's write lock before
reading, so concurrent registrations from several processes serialise: version numbers never
collide and a version row is only ever committed after its blobs are in the store. Rows are only
inserted (aliases are the one thing that moves), so nothing registered is modified or lost.
"""

from __future__ import annotations

import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS datasets (
    namespace TEXT NOT NULL, name TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (namespace, name));
CREATE TABLE IF NOT EXISTS versions (
    namespace TEXT NOT NULL, name TEXT NOT NULL, version INTEGER NOT NULL,
    digest TEXT NOT NULL, format TEXT NOT NULL, manifest TEXT NOT NULL,
    size INTEGER NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (namespace, name, version), UNIQUE (namespace, name, digest));
CREATE TABLE IF NOT EXISTS aliases (
    namespace TEXT NOT NULL, name TEXT NOT NULL, alias TEXT NOT NULL, version INTEGER NOT NULL,
    PRIMARY KEY (namespace, name, alias));
CREATE TABLE IF NOT EXISTS blobs (
    hash TEXT PRIMARY KEY, size INTEGER NOT NULL, suffix TEXT NOT NULL);
"""
_BUSY_MS = 120_000  # how long a writer waits for another's transaction before giving up


class Index:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are the explicit BEGIN IMMEDIATE below, nothing implicit.
        self.conn = sqlite3.connect(str(self.path), timeout=_BUSY_MS / 1000, isolation_level=None)
        self.conn.execute(f"PRAGMA busy_timeout={_BUSY_MS}")
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        with self.write() as conn:
            # One statement at a time: executescript would COMMIT the open transaction first.
            for statement in filter(str.strip, _SCHEMA.split(";")):
                conn.execute(statement)

    @contextmanager
    def write(self):
        """One write transaction: committed on success, rolled back on any exception."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def read(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self.conn.execute(sql, args).fetchall()

    def close(self) -> None:
        self.conn.close()


def now() -> float:
    return time.time()
