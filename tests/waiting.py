"""Waiting on a training subprocess for something to happen, with no deadline of our own.

A wall-clock deadline is a timing assertion in disguise: on a loaded machine (2 cores, seven test
runs) it fails runs that are merely slow. The wait ends on an event instead: the condition holds,
or the process exits (then the caller says what did not happen). A process that hangs is bounded by
pytest-timeout (`timeout` in pyproject.toml), which is a hang guard, not a speed check.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable


def until(condition: Callable[[], bool], process: subprocess.Popen, poll_s: float = 0.05) -> bool:
    """True once `condition()` holds while the process runs; False if the process exits first."""
    while not condition():
        try:
            process.wait(timeout=poll_s)  # wakes early when the process exits
        except subprocess.TimeoutExpired:
            continue
        return condition()  # it may have become true just before the exit
    return True
