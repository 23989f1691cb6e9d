"""Reads that stop at a size limit while streaming (issue 19, item 5).

A zip member is checked twice: by the size its header declares, before anything is extracted, and
by the bytes it actually streams, counted while copying and cut at the limit (a header can lie, and
a 1 GiB member must not be read to learn that it is too big). Whole-file JSON documents read the same
way, so /dev/zero or a FIFO named as prepared.json stops at the limit too.

The limits are module constants so tests can lower them instead of writing gigabytes.
"""

from __future__ import annotations

import errno
import os
import stat
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

# Seed 003: "The limit also applies to the total size of the files in a ZIP after extraction", 256 MiB
# unless the deployment sets another. A prepared directory's prepared.json is held to it too.
MAX_EXTRACTED_BYTES = 256 * 1024 * 1024
# One media file (an image, a video, an audio recording) is read whole: its bytes travel inside one shard
# record (DESIGN, "Media travels inside shards"), and a record is held in memory whole by every reader.
MAX_MEDIA_BYTES = 1024 * 1024 * 1024
_CHUNK = 1 << 20


class TooLarge(OSError):
    """More bytes than the limit; the message says which limit.

    An OSError (EFBIG), so every reader's `except OSError: "cannot read: {err.strerror}"` reports it.
    """

    def __init__(self, message: str):
        super().__init__(errno.EFBIG, message)

    def __str__(self) -> str:
        return self.strerror


class NotARegularFile(OSError):
    """A path a data file was expected at names a device, a FIFO, a socket or a directory (/dev/zero
    never ends, a FIFO blocks the reader): refused before it is opened. An OSError (EINVAL), so every
    reader's `except OSError` reports it as it reports an unreadable file."""

    def __init__(self, path: str | os.PathLike, what: str):
        super().__init__(errno.EINVAL, f"{what}; a data file must be a regular file", os.fspath(path))

    def __str__(self) -> str:
        return f"{os.fspath(self.filename)!r}: {self.strerror}"


def check_regular_file(path: str | os.PathLike) -> None:
    """NotARegularFile unless `path` (symlinks followed) is a regular file; a missing one is FileNotFoundError."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        what = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise NotARegularFile(path, what if what.startswith("not") else f"is {what}")


def copy_capped(src: BinaryIO, limit: int, write: Callable[[bytes], object], what: str = "the data") -> int:
    """Copy `src` through `write` in chunks; TooLarge as soon as more than `limit` bytes arrived.

    Never reads more than `limit + 1` bytes, so an endless stream costs at most the limit.
    """
    total = 0
    while chunk := src.read(min(_CHUNK, limit + 1 - total)):
        total += len(chunk)
        if total > limit:
            raise TooLarge(f"{what} is larger than the limit of {limit} bytes")
        write(chunk)
    return total


def read_capped(src: BinaryIO, limit: int, what: str = "the data") -> bytes:
    parts: list[bytes] = []
    copy_capped(src, limit, parts.append, what)
    return b"".join(parts)


def read_file_capped(path: Path, limit: int | None = None) -> bytes:
    """A whole file's bytes, refused (TooLarge) past `limit` (default MAX_EXTRACTED_BYTES) without reading on;
    a device, FIFO or directory is refused before it is opened (NotARegularFile)."""
    check_regular_file(path)
    limit = MAX_EXTRACTED_BYTES if limit is None else limit
    if os.stat(path).st_size > limit:  # said before reading; the capped read still holds a file that grows
        raise TooLarge(f"the file is {os.stat(path).st_size} bytes, larger than the limit of {limit} bytes")
    with open(path, "rb") as handle:
        return read_capped(handle, limit, "the file")


class ZipBudget:
    """The seed-003 budget of one zip: declared sizes checked up front, streamed bytes counted."""

    def __init__(self, archive: zipfile.ZipFile):
        self.archive = archive
        self.left = MAX_EXTRACTED_BYTES
        declared = sum(info.file_size for info in archive.infolist())
        if declared > self.left:
            raise TooLarge(f"its members declare {declared} bytes after extraction, over the limit of "
                           f"{self.left} bytes (seed 003: 256 MiB unless the deployment sets another)")

    def copy(self, name: str, write: Callable[[bytes], object]) -> int:
        """Stream member `name` through `write`, at most its declared size and what the budget has left."""
        info = self.archive.getinfo(name)
        limit = min(info.file_size, self.left)
        what = (f"the member (declared {info.file_size} bytes, {self.left} left of the "
                f"{MAX_EXTRACTED_BYTES}-byte extraction limit)")
        with self.archive.open(info) as src:
            total = copy_capped(src, limit, write, what)
        self.left -= total
        return total

    def read(self, name: str) -> bytes:
        parts: list[bytes] = []
        self.copy(name, parts.append)
        return b"".join(parts)
