"""A refused start-up leaves the workdir as it found it (issue 27: "no empty folder left behind by a
refused command"; the error table checks every workdir file before and after a refusal).

Before it trains, a run writes into its workdir: the workdir itself and `train.lock` (the lock must
be held while the data converts, so a second trainer cannot convert beside it), the converted
`shards/` and `eval_shards/` caches, the tokenizer and an empty `checkpoints/` of a fresh start. Most
refusals come only after some of that: "nothing to train" is counted on converted shards, a mesh or a
compile can fail after them. So the run keeps a note of what was there (`StartUp`), and a start-up that
ends in an error removes what it added, before the command prints its one line. Once the run starts
stepping (`started()`) everything stays: from then on the workdir holds training's own results.

What is never removed, new or not: `checkpoints-corrupt/` (damaged steps a resume moved aside are kept
for inspection) and a `checkpoints/` that holds anything. Multi-process jobs: process 0 alone writes
the caches and the lock, so it alone removes them.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

from valen_jax.training import checkpoint, workdir_lock

log = logging.getLogger(__name__)

# The workdir's folders whose new entries are this start-up's (conversion caches), besides its top level.
CACHES = ("shards", "eval_shards")


class StartUp:
    """What a run's start-up found in its workdir (noted before anything is written there)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.created_workdir = not workdir.exists()
        self.before = {area: _names(workdir / area) for area in ("", *CACHES)}
        self.done = False

    def started(self) -> None:
        """Training has begun: nothing of the workdir is start-up's to remove any more."""
        self.done = True

    @contextlib.contextmanager
    def undone_on_error(self) -> Iterator[None]:
        """Held inside the workdir's lock: a body that raises before `started()` has what it added to the
        workdir removed while no other trainer can write there (train.lock included), then the error goes on."""
        try:
            yield
        except BaseException:
            if not self.done and workdir_lock._is_process_zero():
                self._remove_added()
            raise

    def _remove_added(self) -> None:
        keep = {checkpoint.corrupt_dir(self.workdir).name}
        for area in CACHES:
            folder = self.workdir / area
            for name in sorted(_names(folder) - self.before[area]):
                _remove(folder / name)
        for name in sorted(_names(self.workdir) - self.before[""] - keep):
            path = self.workdir / name
            if name == checkpoint.checkpoint_dir(self.workdir).name and _names(path):
                continue  # a checkpoint is training's result, never start-up's
            _remove(path)


@contextlib.contextmanager
def start_up(workdir: Path) -> Iterator[StartUp]:
    """Note the workdir before the body writes to it; a body that raises before `started()` leaves no
    workdir it created (removed only when empty: a refusal by another trainer's lock leaves that lock)."""
    note = StartUp(workdir)
    try:
        yield note
    except BaseException:
        if note.created_workdir and not note.done:
            with contextlib.suppress(OSError):
                note.workdir.rmdir()
        raise


def _names(folder: Path) -> set[str]:
    try:
        return {path.name for path in folder.iterdir()} if folder.is_dir() and not folder.is_symlink() else set()
    except OSError:
        return set()


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as error:  # the refusal's own line matters more; say what stayed
        log.warning("%r: could not remove what this refused start-up wrote (%s)", str(path), error.strerror)
