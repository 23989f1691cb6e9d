"""One trainer per workdir: an exclusive `flock` on `WORKDIR/train.lock` while a run trains.

Two trainers on one workdir would interleave their checkpoint saves, quarantine each other's
half-written steps and truncate each other's metrics; the second one is refused at start-up
instead. The lock belongs to the open file: the kernel drops it when the process exits, however
it exits (`kill -9` included), so a crashed run never leaves a stale lock behind. The file's
content (pid and host of the holder) is only for the refusal message, never the lock itself.

Multi-process jobs: only process 0 locks (its peers write into the same workdir as parts of the
same run, and a peer holding the lock would refuse its own process 0 on a shared filesystem).
`evaluate` and `predict` only read a workdir and never lock: they may run while training does.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import jax

LOCK_NAME = "train.lock"

# Descriptors this process holds locks through; closed in forked children (Grain or conversion
# workers) so that a child outliving a killed trainer cannot keep the workdir locked.
_held: set[int] = set()


def _close_in_child() -> None:
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class WorkdirBusy(RuntimeError):
    """Another process trains in this workdir."""


def _is_process_zero() -> bool:
    # A single process (the job was never joined) is process 0; asking it without starting a JAX
    # backend refuses a second trainer before it claims the accelerator the first one is using.
    return not jax.distributed.is_initialized() or jax.process_index() == 0


@contextlib.contextmanager
def exclusive(workdir: str | Path) -> Iterator[None]:
    """Hold the workdir's training lock for the body (process 0 of a job; the others pass through)."""
    if not _is_process_zero():
        yield
        return
    path = Path(workdir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's pid stays readable
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = " ".join(os.read(fd, 200).decode("utf-8", "replace").split()) or "holder not recorded"
        os.close(fd)
        raise WorkdirBusy(f"{Path(workdir)}: another trainer is running in this workdir ({holder}; lock {path}); "
                          "two trainers would overwrite each other's checkpoints. Stop it or wait for it, "
                          "or use another --workdir") from None
    except BaseException:
        os.close(fd)
        raise
    _held.add(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        _held.discard(fd)
        os.close(fd)  # releases the lock
