"""Build a costly test input (a trained workdir, a checkpoint) once per pytest run, even across xdist workers.

`make test` runs the suite on two pytest-xdist workers; each is its own session with its own base temp
dir, so a session fixture alone would train every shared workdir twice. The workers of one run share the
parent of their base temp dirs: the first worker to ask builds there under a file lock, the others wait
on the lock and reuse the result. A build that dies leaves no completion mark, so the next asker clears
the half-written directory and builds again instead of reading it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def shared_root(tmp_path_factory) -> Path:
    """The directory every worker of this run shares: the xdist run's temp dir, or the session's own."""
    base = tmp_path_factory.getbasetemp()
    # Without xdist the parent is pytest's per-user dir, shared with other (older, concurrent) runs.
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return root / "once-per-run"


def build_once(tmp_path_factory, name: str, build: Callable[[Path], dict | None]) -> tuple[Path, dict | None]:
    """`build(directory)` run once per pytest run for `name`; returns (directory, what build returned).

    What `build` returns must be JSON-serialisable (Paths excepted: they come back as strings), since
    the other workers read it from disk. The directory is built in place, not renamed into place,
    because trained workdirs record their own path."""
    root = shared_root(tmp_path_factory)
    root.mkdir(parents=True, exist_ok=True)
    # The mark lies beside the directory: tests list and copy what is inside it.
    directory, complete = root / name, root / f"{name}.built.json"
    with FileLock(str(root / f"{name}.lock")):
        if not complete.is_file():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            result = build(directory)
            complete.write_text(json.dumps(result, default=str))
    return directory, json.loads(complete.read_text())
