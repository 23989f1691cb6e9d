"""The training bar counts steps the device finished, one step behind dispatch, with no extra wait."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from valen_jax.training.progress import FinishedSteps


class Bar:
    def __init__(self, events):
        self.events, self.n = events, 0

    def update(self, k):
        self.n += k
        self.events.append(("bar", self.n))


def test_each_step_is_counted_after_waiting_on_it_and_only_once_the_next_is_queued():
    events = []
    progress = FinishedSteps(Bar(events), block=lambda outputs: events.append(("wait", outputs)))
    for step in (1, 2, 3):
        events.append(("dispatch", step))
        progress.dispatched(step)
    progress.flush()
    progress.flush()  # nothing in flight: no wait, no count
    assert events == [("dispatch", 1),
                      ("dispatch", 2), ("wait", 1), ("bar", 1),
                      ("dispatch", 3), ("wait", 2), ("bar", 2),
                      ("wait", 3), ("bar", 3)]


def test_a_log_step_flush_counts_the_step_being_read_and_the_next_dispatch_waits_on_nothing_older():
    events = []
    progress = FinishedSteps(Bar(events), block=lambda outputs: events.append(("wait", outputs)))
    progress.dispatched(1)
    progress.flush()  # step 1 is logged: its metrics are read back anyway
    progress.dispatched(2)
    assert events == [("wait", 1), ("bar", 1)]


def test_with_real_arrays_what_the_bar_has_counted_is_ready_on_the_device():
    step = jax.jit(lambda x: (x + 1, {"loss": jnp.sum(x)}), donate_argnums=(0,))
    state, counted = jnp.zeros((64, 64)), []

    class ReadyBar:
        def update(self, k):
            counted.append(all(v.is_ready() for v in jax.tree.leaves(outputs[len(counted)])))

    outputs = []
    progress = FinishedSteps(ReadyBar())
    for _ in range(4):
        state, metrics = step(state)  # the state is donated: the bar must not wait on it
        outputs.append(metrics)
        progress.dispatched(metrics)
    progress.flush()
    assert counted == [True] * 4
    assert float(outputs[-1]["loss"]) == 3 * 64 * 64
