"""Continuous batching over a fixed number of decode slots.

The cache is one `KVCache` of [L, S, K, C, H] (S slots, C = the model's context). Three compiled
programs, each with static shapes, so an accelerator runs the same executables for the whole life of
the server:

- `prefill` of one prompt, right-padded to its length bucket (`engine.bucket`), written into a chosen
  slot of the shared cache (the cache donated: updated in place), → the logits at its last token;
  compiled once per prompt bucket;
- `decode`: one token for every slot (`Transformer.decode_step`, each slot its own cursor and
  position), the cache donated; compiled once per (S, C). An empty slot still occupies its lane (static
  shapes); its write lands in its own row, which the next prefill into it replaces whole;
- `choose`: the next token of each slot from its logits (`sampling.sample`), once per distinct
  `Sampling` among the live slots (the filters are static arguments of `sample`).

Requests join between steps (a prefill into a free slot) and leave between steps (their slot is
marked free), so a long answer never holds back a short one. A slot's tokens depend only on its own
cache row and its own random stream, which is the engine's: the token at output index i of choice j is
drawn with `fold_in(fold_in(key(seed), j), i)` (`loop._row_keys` / `_keys_at`), so greedy and seeded
answers equal `generate`'s for the same prompt whatever else is being served.

The host runs one step at a time (one device round trip per token for all slots): that is the price of
letting requests in and out between tokens, where `generate`'s while_loop stays on the device for a
whole batch.
"""

from __future__ import annotations

import collections
import functools
import threading
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from valen_jax.decoding.engine import bucket
from valen_jax.decoding.sampling import Sampling, sample
from valen_jax.models.kv_cache import KVCache


class QueueFull(RuntimeError):
    """The bounded queue of waiting requests is full (the route answers 429 with Retry-After)."""


@dataclass(eq=False)
class Request:
    """One choice being generated. `emit(token | None)` is called from the engine thread: a token, or
    None once finished (`finish_reason` then set)."""

    ids: np.ndarray
    max_new: int
    sampling: Sampling
    seed: int
    choice: int
    emit: object
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False
    slot: int | None = None


@functools.cache
def _programs(graphdef, vocab: int, cache_length: int):
    def prefill(params, cache, tokens, positions, lengths, slot):
        model = nnx.merge(graphdef, params)
        logits, row = model.prefill(tokens, positions, lengths, cache_length)
        keys = jax.lax.dynamic_update_index_in_dim(cache.keys, row.keys[:, 0], slot, 1)
        values = jax.lax.dynamic_update_index_in_dim(cache.values, row.values[:, 0], slot, 1)
        return logits[0], KVCache(keys, values)

    def decode(params, cache, last, cursor, position):
        model = nnx.merge(graphdef, params)
        return model.decode_step(last, position, cache, cursor)

    def empty(params, slots):
        model = nnx.merge(graphdef, params)
        tokens = jnp.zeros((slots, 1), jnp.int32)
        return model.prefill(tokens, tokens, jnp.ones(slots, jnp.int32), cache_length)[1]

    return (jax.jit(prefill, donate_argnums=(1,)), jax.jit(decode, donate_argnums=(1,)),
            jax.jit(empty, static_argnums=(1,)))


@functools.cache
def _chooser(sampling: Sampling, vocab: int):
    def choose(logits, seeds, choices, counts):
        keys = jax.vmap(lambda s, c, n: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), c), n))(
            seeds, choices, counts)
        return sample(logits, keys, sampling, vocab)
    return jax.jit(choose)


class SlotEngine:
    """The decode slots of one model and the thread that steps them (module docstring)."""

    def __init__(self, params, graphdef, *, vocab: int, stop_ids, slots: int, cache_length: int,
                 max_queue: int):
        self.params, self.vocab, self.slots, self.cache_length = params, int(vocab), int(slots), int(cache_length)
        self.stop_ids = frozenset(int(s) for s in stop_ids)
        self.max_queue = int(max_queue)
        self._prefill, self._decode, empty = _programs(graphdef, self.vocab, self.cache_length)
        self._cache = empty(params, self.slots)
        self._live: list[Request | None] = [None] * self.slots
        self._last = np.zeros(self.slots, np.int32)
        self._cursor = np.zeros(self.slots, np.int32)
        self._waiting: collections.deque[Request] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self.steps = 0  # decode steps run (the tests read it to see slots shared)
        self._thread = threading.Thread(target=self._run, name="valen-slots", daemon=True)
        self._thread.start()

    # -- the request side (any thread) --
    def submit(self, request: Request) -> None:
        if len(request.ids) + request.max_new > self.cache_length:
            raise ValueError(f"{len(request.ids)} prompt tokens + {request.max_new} new tokens exceed the "
                             f"model's context of {self.cache_length} tokens")
        with self._wake:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue)")
            self._waiting.append(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """The client left: its slot is freed before the next step."""
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    def busy(self) -> int:
        return sum(r is not None for r in self._live) + len(self._waiting)

    def stop(self, drain: bool = True) -> None:
        """Stop taking requests; with `drain`, the thread finishes what it holds before it ends."""
        with self._wake:
            self._stopping = True
            if not drain:
                for request in self._waiting:
                    request.cancelled = True
            self._wake.notify()
        self._thread.join()

    # -- the engine thread --
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not any(self._live):
                    self._wake.wait()
                if self._stopping and not self._waiting and not any(self._live):
                    return
                admitted = self._admit()
            for request in admitted:
                self._start(request)
            self._drop_cancelled()
            if any(self._live):
                self._step()

    def _admit(self) -> list[Request]:
        taken = []
        free = [i for i, r in enumerate(self._live) if r is None]
        while free and self._waiting:
            request = self._waiting.popleft()
            if request.cancelled:
                continue
            request.slot = free.pop(0)
            self._live[request.slot] = request
            taken.append(request)
        return taken

    def _start(self, request: Request) -> None:
        n = len(request.ids)
        padded = bucket(n)
        tokens = np.zeros((1, padded), np.int32)
        tokens[0, :n] = request.ids
        positions = np.zeros((1, padded), np.int32)
        positions[0, :n] = np.arange(n)
        logits, self._cache = self._prefill(self.params, self._cache, tokens, positions,
                                            np.asarray([n], np.int32), np.int32(request.slot))
        self._cursor[request.slot] = n  # the first token's slot once it is fed back
        self._commit(request, self._choose(logits[None], [request])[0])

    def _step(self) -> None:
        positions = self._cursor  # text prompts: a token's position is its slot
        logits, self._cache = self._decode(self.params, self._cache, jnp.asarray(self._last),
                                           jnp.asarray(self._cursor), jnp.asarray(positions))
        self.steps += 1
        live = [r for r in self._live if r is not None]
        rows = np.asarray([r.slot for r in live])
        tokens = self._choose(logits[rows], live)
        for request, token in zip(live, tokens, strict=True):
            self._cursor[request.slot] += 1
            self._commit(request, token)

    def _choose(self, logits, requests: list[Request]) -> np.ndarray:
        out = np.zeros(len(requests), np.int32)
        for sampling in {r.sampling for r in requests}:
            picks = [i for i, r in enumerate(requests) if r.sampling == sampling]
            chosen = _chooser(sampling, self.vocab)(
                logits[np.asarray(picks)], jnp.asarray([requests[i].seed for i in picks], jnp.uint32),
                jnp.asarray([requests[i].choice for i in picks], jnp.uint32),
                jnp.asarray([len(requests[i].tokens) for i in picks], jnp.int32))
            out[picks] = np.asarray(chosen)
        return out

    def _commit(self, request: Request, token: int) -> None:
        token = int(token)
        request.tokens.append(token)
        self._last[request.slot] = token
        if token in self.stop_ids:
            request.finish_reason = "stop"
        elif len(request.tokens) >= request.max_new:
            request.finish_reason = "length"
        request.emit(token)
        if request.finish_reason is not None:
            self._free(request)

    def _drop_cancelled(self) -> None:
        with self._wake:
            for request in self._live:
                if request is not None and request.cancelled:
                    request.finish_reason = request.finish_reason or "cancelled"
                    self._free(request)

    def _free(self, request: Request) -> None:
        self._live[request.slot] = None
        request.emit(None)
