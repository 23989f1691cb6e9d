"""Fault injection for the checkpoint tests: hold a checkpoint's background write open.

Production code has no hook for this. The tests wrap a public seam instead: the `meta` item's
`checkpoint.MetaHandler.async_save` (an Orbax `JsonCheckpointHandler` method). The commit futures
it returns gain one more that waits for a release, and Orbax renames `STEP.orbax-checkpoint-tmp*`
to `STEP` only after every commit future is done: until then the save call has returned, training
steps run, and the step directory is not final.

As a module, it runs `valen_jax.train` with the write of one step held open until the process is
killed (the kill-during-a-write test):

    python -m tests.hold_checkpoint_write STEP --config=configs/vflash.py:tiny --workdir=/tmp/w ...
"""

from __future__ import annotations

import concurrent.futures
import runpy
import sys
import threading
from pathlib import Path

from valen_jax.training import checkpoint

MESSAGE = "holding the write of checkpoint {step} open"


def holding_async_save(release: threading.Event, steps: set[int] | None = None):
    """A replacement for `MetaHandler.async_save` that holds the writes of `steps` (None: every
    step) open until `release` is set."""
    original = checkpoint.MetaHandler.async_save
    waiter = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="hold-checkpoint-write")

    async def async_save(self, directory, item=None, args=None):
        futures = await original(self, directory, item, args)
        step = int(Path(str(directory)).parent.name.split(".")[0])  # STEP.orbax-checkpoint-tmp-*/meta
        if steps is not None and step not in steps:
            return futures
        print(MESSAGE.format(step=step), file=sys.stderr, flush=True)
        return [*futures, waiter.submit(release.wait)]

    return async_save


def main() -> None:
    step, argv = int(sys.argv[1]), sys.argv[2:]
    checkpoint.MetaHandler.async_save = holding_async_save(threading.Event(), {step})
    sys.argv = ["valen_jax.train", *argv]
    runpy.run_module("valen_jax.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
