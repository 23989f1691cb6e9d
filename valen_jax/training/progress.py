"""A progress bar that counts finished steps, not dispatched ones.

With asynchronous dispatch, `compiled(state, batch)` returns as soon as the step is queued, so a bar
advanced right after it races ahead (tens of it/s) and then stands still at every step that reads a
value back, while the queue drains: its rate and ETA say nothing about the real speed. Blocking on
the step just dispatched would fix the count but idle the device between steps. Here, as MaxText
does with its metrics, the bar waits for the step *one behind*: after step N is dispatched, it blocks
on a value step N-1 produced, then counts N-1. Step N is already queued, so the device never waits
for the host, and the bar is at most one step behind the truth.

The value waited on must not be donated to the next step (the train step donates its state), so
it is the step's metrics, which nothing consumes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


class FinishedSteps:
    """Feeds `bar.update(1)` one step behind dispatch; `flush()` counts the step still in flight."""

    def __init__(self, bar: Any, block: Callable[[Any], Any] = jax.block_until_ready):
        self._bar, self._block, self._in_flight = bar, block, None

    def dispatched(self, outputs: Any) -> None:
        """Call right after dispatching a step, with outputs of that step that are not donated."""
        self.flush()  # the step before this one; this one is queued behind it
        self._in_flight = outputs

    def flush(self) -> None:
        """Wait for the step in flight and count it (before reading its values back anyway, at the end)."""
        if self._in_flight is not None:
            self._block(self._in_flight)
            self._in_flight = None
            self._bar.update(1)
