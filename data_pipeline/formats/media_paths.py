"""Media paths stay inside their dataset folder (issue 19, item 3).

Conversion copies every media file it reads into the shards, and shards travel. A record naming
`/etc/passwd`, `../../home/me/.ssh/id_rsa` or a symlink to either would carry that file along, so
a media path is resolved, symlinks included, and refused when it leaves the dataset folder (the
JSONL's folder, or a recipe entry's `root`).

Seed 000 says "local absolute paths also work" for Valen media: the converter option
`allow_absolute_media` (off by default, `--allow-absolute-media`) admits absolute paths and paths
that leave the folder, for a user who means it. Shard headers never record the machine's absolute
path: renderers write the path as the record wrote it (relative to the dataset folder, or the
user's own absolute string under the option).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath

from data_pipeline.cli_paths import control_character
from data_pipeline.formats.errors import describe

OPTION_FLAG = "--allow-absolute-media"


def is_absolute(written: str) -> bool:
    return PurePosixPath(written).is_absolute() or PureWindowsPath(written).is_absolute()


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


class DatasetFolder:
    """Resolves media paths written in one dataset and says which leave it."""

    _CACHE_LIMIT = 4096  # directories remembered; bounded so a huge file keeps bounded memory

    def __init__(self, folder: Path | str, allow_outside: bool = False):
        self.folder = os.path.normpath(os.path.abspath(folder))
        self.real = os.path.realpath(self.folder)
        self.allow_outside = allow_outside
        self._real_dirs: dict[str, str] = {}

    def path(self, written: str) -> str:
        """The normalised absolute path `written` names (no file-system access)."""
        return os.path.normpath(os.path.join(self.folder, written))

    def refusal(self, written: str, path: str | None = None) -> str | None:
        """Why `written` may not be read (absolute, or leaving the folder by `..` or a symlink), or None.

        `path`: `self.path(written)` when the caller has it already. A control character is refused first,
        whatever `allow_outside` says: a NUL names no file (the OS refuses it, Python raises "embedded null
        byte" from whatever opens it), and a newline would print one problem as two lines.
        """
        control = control_character(written)
        if control is not None:
            return (f"{written!r} holds the control character {control!r}; media paths with NUL, newlines or "
                    "other control characters are refused")
        if self.allow_outside:
            return None
        if is_absolute(written):
            return (f"{describe(written)} is absolute; media paths are relative to the dataset folder "
                    f"(convert with {OPTION_FLAG} to read local absolute paths)")
        path = self.path(written) if path is None else path
        if not _inside(path, self.folder):
            return (f"{describe(written)} leads outside the dataset folder; media must lie inside it "
                    f"(convert with {OPTION_FLAG} to allow it)")
        if not _inside(self._real(path), self.real):
            return (f"{describe(written)} leads outside the dataset folder through a symlink; media must "
                    f"lie inside it (convert with {OPTION_FLAG} to allow it)")
        return None

    def _real(self, path: str) -> str:
        """`os.path.realpath(path)`, with each directory resolved once: one lstat per file after that."""
        try:
            directory, name = os.path.split(path)
            real_dir = self._real_dirs.get(directory)
            if real_dir is None:
                if len(self._real_dirs) >= self._CACHE_LIMIT:
                    self._real_dirs.clear()
                real_dir = self._real_dirs[directory] = os.path.realpath(directory)
            found = os.path.join(real_dir, name)
            return os.path.realpath(found) if os.path.islink(found) else found
        except (OSError, ValueError):  # a NUL or a lone surrogate: the caller reports "not found"
            return path
