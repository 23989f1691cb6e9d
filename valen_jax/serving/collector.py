"""The interpreter's cyclic garbage collector, as a server sees it.

A collection holds the interpreter lock for as long as it scans the objects of the generations it
collects, so every thread waits: the engine thread between two device calls, the event loop streaming
tokens. A server's start-up leaves millions of long-lived objects behind (every program the warm-up
traced, lowered and compiled, and the libraries), and each full collection scanned them all: 230-334 ms
measured at the end of the tiny chat model's warm-up on this 2-core CPU, and, during serving, time-to-first-
token p95 of 455-480 ms at concurrency 32 in two of six benchmark runs (against 45-68 ms in the others).

`freeze()` after the warm-up moves every object then alive into the permanent generation, which
collections skip (the CPython documentation's advice for a process that forks or serves after a heavy
start-up; vLLM does the same after its start-up). They are still freed by reference counting; only
a reference cycle among them is never collected, which start-up objects (kept for the server's life)
do not need. `Pauses` records each collection's duration for `/v1/valen/metrics`.
"""

from __future__ import annotations

import collections
import gc
import threading
import time

WINDOW = 1024  # collections `Pauses.summary` covers, the latest ones


def freeze() -> str:
    """Move every object alive now into the permanent generation → what it did, for the log: the objects
    frozen, and a full collection's ms before and after."""
    started = time.perf_counter()
    gc.collect()  # what start-up left as garbage is freed first, not kept for the server's life
    before = time.perf_counter() - started
    gc.freeze()
    started = time.perf_counter()
    gc.collect()
    after = time.perf_counter() - started
    return (f"{gc.get_freeze_count()} objects frozen out of garbage collection (a full collection: "
            f"{before * 1e3:.0f} ms before, {after * 1e3:.1f} ms after)")


class Pauses:
    """Each garbage collection's generation and seconds, recorded by a `gc.callbacks` hook (one per
    process: `pauses()`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started: float | None = None
        self._latest: collections.deque[tuple[int, float]] = collections.deque(maxlen=WINDOW)
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        # Called by the collecting thread with the interpreter lock held: one collection at a time.
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            with self._lock:
                self._latest.append((int(info["generation"]), time.perf_counter() - self._started))
            self._started = None

    def summary(self, reset: bool = False) -> dict:
        """The latest collections (at most `WINDOW`): their count, the longest and the total in ms, the
        count of full (generation 2) ones, and how many objects are frozen; `reset`: start a new window."""
        with self._lock:
            latest = list(self._latest)
            if reset:
                self._latest.clear()
        ms = [seconds * 1e3 for _, seconds in latest]
        return {"collections": len(latest), "full": sum(generation == 2 for generation, _ in latest),
                "max_ms": round(max(ms, default=0.0), 2), "total_ms": round(sum(ms), 2),
                "frozen_objects": gc.get_freeze_count()}


_PAUSES: Pauses | None = None
_CREATING = threading.Lock()


def pauses() -> Pauses:
    """The process's one `Pauses` (installed on first use)."""
    global _PAUSES
    with _CREATING:
        if _PAUSES is None:
            _PAUSES = Pauses()
        return _PAUSES
