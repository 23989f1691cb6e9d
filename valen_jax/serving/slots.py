"""Continuous batching over a fixed number of decode slots.

The cache is one `KVCache` of [L, S, K, C, H] (S slots, C = the model's context), which the compiled
programs of `slot_programs` (prefill into slots, decode, choose, copy rows) update in place, each with
static shapes. Requests with the same prompt admitted in one round (a request's `n` choices, or equal
prompts of different requests) are prefilled once, and the others' slots receive copies of its rows;
each draws its first token from the same logits with its own key.

Requests join between syncs (one prefill for all admitted ones, into free slots) and leave between them (their slot is
marked free), so a long answer never holds back a short one. A slot's tokens depend only on its own
cache row and its own random stream, which is the engine's: the token at output index i of choice j is
drawn with `fold_in(fold_in(key(seed), j), i)` (`loop.token_key`), so greedy and seeded
answers equal `generate`'s for the same prompt whatever else is being served.

The host syncs every `steps_per_sync` tokens (one device round trip for all slots): the price of letting
requests in and out while others decode, where `generate`'s while_loop stays on the device for a whole
batch. A larger value amortises the round trip; a smaller one lets a new request in sooner.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from valen_jax.decoding.engine import batch_arrays, bucket
from valen_jax.decoding.sampling import Sampling, SamplingKind, sampling_rows
from valen_jax.serving import slot_programs

log = logging.getLogger(__name__)

PREFILL_ROWS = 4  # rows of a prefill of several admitted requests (`SlotEngine._start`)
# Prompt tokens (rows x bucket) one prefill may pad to: a CPU runs 4 rows of 384 tokens ~7x slower than one
# (measured, tiny model), so it batches short prompts only; an accelerator's matmuls fill at thousands.
PREFILL_TOKENS = {"cpu": 512}
PREFILL_TOKENS_ACCELERATOR = 4096
MIN_DECODE_ROWS = 8  # the smallest slot count a decode program runs (`_shape_buckets`)
MIN_DECODE_LENGTH = 128  # the shortest cache prefix it attends over
# Every kind a sampled request's programs can be of (`SamplingKind`: temperature, with or without each filter).
SAMPLED_KINDS = tuple(SamplingKind(sampled=True, top_k=k, top_p=p) for k in (False, True) for p in (False, True))
METRICS_WINDOW = 1024  # requests (and decode calls) `SlotEngine.metrics` summarises, the latest ones


class QueueFull(RuntimeError):
    """The bounded queue of waiting requests is full (the route answers 429 with Retry-After)."""


@dataclass(eq=False)
class Request:
    """One choice being generated. `emit(token | None)` is called from the engine thread once per sync:
    the latest token (`tokens` may have grown by several since the last event), or None once finished
    (`finish_reason` then set)."""

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
    # An image prompt (`Service.vision_prompt`, the prompt `generate` builds): its positions (M-RoPE ones
    # [n, 3] for a Qwen-VL model) and `assemble.vision_arrays`; None for text, whose positions are 0..n-1.
    positions: np.ndarray | None = None
    vision: dict | None = None
    offset: int = 0  # a generated token's position minus its cache slot (M-RoPE prompts with media: not 0)
    # Engine-side timestamps (time.perf_counter) of the first token's path, read by `SlotEngine.metrics`:
    # submitted (in the queue), admitted (given a slot, at a sync), prefill_start / first_token (its prefill
    # call begun / its first token chosen and on the host).
    times: dict = field(default_factory=dict)
    # With a drafter (`speculative_slots`): verify passes, tokens committed in announced blocks, drafted and
    # accepted draft tokens so far (the route's `usage`); None without one.
    speculation: dict | None = None


def _shape_buckets(limit: int, smallest: int) -> list[int]:
    """Powers of two from `smallest` below `limit`, then `limit` itself: the decode's slot counts and
    cache lengths (few, so a server compiles few decode programs)."""
    sizes, size = [], smallest
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def cover(sizes: list[int], n: int) -> int:
    return next(s for s in sizes if s >= n)


def _same_prompt(request: Request) -> tuple:
    """What makes two requests' prefills identical: their ids and positions; an image prompt's media by
    identity (the `n` choices of one request share its arrays)."""
    positions = None if request.positions is None else (request.positions.shape, request.positions.tobytes())
    return request.ids.tobytes(), positions, None if request.vision is None else id(request.vision)


def _abstract(tree):
    """Each array's shape and dtype (and a committed device array's sharding): what a jitted program's
    `lower` needs to compile the executable a call with these arrays runs."""
    def shape(x):
        sharding = x.sharding if isinstance(x, jax.Array) and x.committed else None
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
    return jax.tree.map(shape, tree)


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class SlotEngine:
    """The decode slots of one model and the thread that steps them (module docstring)."""

    min_decode_rows = MIN_DECODE_ROWS  # the fewest slots a decode program runs (`_shape_buckets`)
    shares_prefills = True  # equal prompts of one round prefilled once (`_start`)

    def __init__(self, params, graphdef, *, vocab: int, stop_ids, slots: int, cache_length: int,
                 max_queue: int, steps_per_sync: int = 4):
        self.params, self.vocab, self.slots, self.cache_length = params, int(vocab), int(slots), int(cache_length)
        self.graphdef, self.steps_per_sync = graphdef, int(steps_per_sync)
        self.stop_ids = frozenset(int(s) for s in stop_ids)
        self._stops = jnp.asarray(sorted(self.stop_ids) or [-1], jnp.int32)
        self.max_queue = int(max_queue)
        self._prefill, empty, self._copy_rows = slot_programs.cache_programs(graphdef, self.vocab, self.cache_length)
        self.model_cfg = nnx.merge(graphdef, params).cfg
        self.mrope = self.model_cfg.mrope_section is not None
        platform = next(iter(jax.tree.leaves(params)[0].devices())).platform  # where the model runs, not the host
        self.prefill_tokens = PREFILL_TOKENS.get(platform, PREFILL_TOKENS_ACCELERATOR)
        self._row_sizes = _shape_buckets(self.slots, self.min_decode_rows)
        self._length_sizes = _shape_buckets(self.cache_length, MIN_DECODE_LENGTH)
        self._cache = empty(params, self.slots)
        self._live: list[Request | None] = [None] * self.slots
        self._waiting: collections.deque[Request] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self.failure: str | None = None  # why the engine thread ended, if it failed (`_run`)
        self.steps = 0  # decode steps run (the tests read it to see slots shared)
        self.prefilled = 0  # prompts prefilled (the tests read it to see equal prompts prefilled once)
        # The first-token paths of the latest requests and the latest decode calls' seconds (`metrics`).
        self._firsts: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=METRICS_WINDOW)
        self._decode_seconds: collections.deque[float] = collections.deque(maxlen=METRICS_WINDOW)
        # The engine thread's seconds in prefill rounds and in decode syncs since `_window_started` (`metrics`).
        self._busy_seconds = {"prefill": 0.0, "decode": 0.0}
        self._window_started = time.perf_counter()
        self.warm_seconds: float | None = None
        self.background_warm_seconds: float | None = None  # set once `warm`'s background compile has ended
        self._warming: threading.Thread | None = None
        self._warm_ended = False  # set at exit (`_end_warm`)
        self._thread = threading.Thread(target=self._run, name="valen-slots", daemon=True)
        self._thread.start()

    def warm(self, background: bool = True) -> None:
        """Compile before serving: every prefill (both row counts, every prompt bucket up to the cache) with
        its greedy first-token choice, and the greedy decode of every shape, so no greedy request waits on a
        compile (on a CPU one stalls every slot for seconds; on an accelerator, for a large model, tens).
        Padding rows only: their slots are out of range, so the cache is untouched. Its seconds are
        `warm_seconds` (in `metrics`, and the server logs them). With `background`, the programs of sampled
        requests and of several choices are then compiled in a background thread (`_warm_background`;
        `wait_warm` waits for it, `background_warm_seconds` its time)."""
        started = time.perf_counter()
        firsts = {}  # the prefill's logits per row count: what the first-token choice reads
        for rows, size in self._prefill_shapes():
            zeros = np.zeros((rows, size), np.int32)
            positions = np.zeros((rows, size, 3) if self.mrope else (rows, size), np.int32)
            firsts[rows] = self._warm_prefill(zeros, positions)
            self._choose(firsts[rows], [], [])  # the greedy first-token choice of this row count
        self._warm_decodes()
        self.warm_seconds = time.perf_counter() - started
        if background:
            jobs = self._background_programs(firsts)  # shapes taken now: serving replaces the donated cache
            self._warming = threading.Thread(target=self._warm_background, args=(jobs,), name="valen-warm",
                                             daemon=True)
            # A process exiting without `stop` must not end mid-compile: the interpreter kills a daemon thread
            # inside XLA and the process aborts (SIGABRT, "exception not rethrown").
            atexit.register(self._end_warm)
            self._warming.start()

    def _background_programs(self, firsts: dict) -> list[tuple[object, tuple]]:
        """(program, abstract inputs) of what a request can need beyond `warm`'s greedy programs: every sampled
        kind's decode of every shape; every kind's first-token choice for each prefill row count and each
        count of choices sharing a prompt (`_choose`'s sizes); the copies of a shared prefill's rows, per
        power-of-two count (`_prefill_rows`). `firsts`: the prefill logits per row count."""
        sizes = sorted({(rows, max(rows, 1 << i)) for rows in firsts
                        for i in range(_power_of_two(self.slots).bit_length())})
        jobs = [(slot_programs.chooser(kind, self.vocab), _abstract(self._choose_inputs(firsts[rows], [], [], kind, size)))
                for kind in (SamplingKind(), *SAMPLED_KINDS) for rows, size in sizes if kind.sampled or size > rows]
        if self.shares_prefills:
            jobs += [(self._copy_rows, _abstract((self._cache, np.zeros(1 << i, np.int32), np.zeros(1 << i, np.int32))))
                     for i in range(_power_of_two(max(self.slots - 1, 1)).bit_length())]
        for kind in SAMPLED_KINDS:
            inputs = _abstract(self._decode_inputs(self._slot_arrays([], kind)))  # the same for every shape
            jobs += [(self._decode_program(kind, rows, length), inputs)
                     for rows in self._row_sizes for length in self._length_sizes]
        return jobs

    def _end_warm(self) -> None:
        """At exit: the background compile stops after the compile under way, which this waits for."""
        self._warm_ended = True
        self.wait_warm()

    def wait_warm(self) -> None:
        """Until `warm`'s background compile has ended (at once if none runs)."""
        if self._warming is not None:
            self._warming.join()

    def _warm_prefill(self, tokens, positions):
        """One padding-only prefill of `tokens`' shape → its logits."""
        rows = len(tokens)
        logits, self._cache = self._prefill(self.params, self._cache, tokens, positions, np.ones(rows, np.int32),
                                            np.full(rows, self.slots, np.int32), None)
        return logits

    def _warm_decodes(self) -> None:
        """The greedy decode of every slot count and cache prefix, run on padding (no live slot)."""
        a = self._slot_arrays([])
        for rows in self._row_sizes:
            for length in self._length_sizes:
                self._decode(rows, length, a)

    def _warm_background(self, jobs) -> None:
        """Compile `jobs` (`_background_programs`) ahead of time (abstract inputs: nothing runs, no second
        cache is allocated), one after another in this background thread while the server already serves:
        JAX keeps an ahead-of-time compiled executable for the calls of the same program with the same
        shapes, so a sampled request (or one of several choices) arriving afterwards runs compiled programs
        instead of stalling every slot on a compile; one arriving earlier compiles its own, as without this.
        `stop` ends it between two compiles."""
        started = time.perf_counter()
        try:
            for done, (program, inputs) in enumerate(jobs):
                if self._stopping or self._warm_ended:
                    log.info("serve: the background compile stopped (%s) after %d of %d programs",
                             "exit" if self._warm_ended else "stop", done, len(jobs))
                    return
                program.lower(*inputs).compile()
        finally:
            atexit.unregister(self._end_warm)
        self.background_warm_seconds = time.perf_counter() - started
        log.info("serve: compiled the sampled kinds' and several choices' %d programs in the background in %.1f s",
                 len(jobs), self.background_warm_seconds)

    def _prefill_shapes(self) -> list[tuple[int, int]]:
        """(rows, prompt bucket) of every prefill `_start` can run: one row per bucket up to the cache, and
        `PREFILL_ROWS` rows where they fit the prefill token budget."""
        sizes, size = [], bucket(1)
        while size <= self.cache_length:
            sizes.append(size)
            size = bucket(size + 1)
        return [(rows, size) for rows in sorted({1, min(PREFILL_ROWS, self.slots)}) for size in sizes
                if rows == 1 or rows * size <= self.prefill_tokens]

    # -- the request side (any thread) --
    def submit(self, *requests: Request) -> None:
        """Queue `requests` all or none (a request's `n` choices): they wait together, so the engine admits
        them in one round when slots allow, where equal prompts share one prefill (`_start`)."""
        for request in requests:
            if len(request.ids) + request.max_new > self.cache_length:
                raise ValueError(f"{len(request.ids)} prompt tokens + {request.max_new} new tokens exceed the "
                                 f"model's context of {self.cache_length} tokens")
        with self._wake:
            if self.failure is not None:
                raise QueueFull(f"the decode engine failed ({self.failure}); restart the server")
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) + len(requests) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue)")
            submitted = time.perf_counter()
            for request in requests:
                request.times["submitted"] = submitted
                self._waiting.append(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """The client left: its slot is freed before the next step."""
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    def metrics(self, reset: bool = False) -> dict:
        """Where the latest requests' time to first token went, in the engine (ms, p50/p95/max over the
        last `METRICS_WINDOW`): `queue` (submitted → given a slot: waiting for the decode call under way, or
        for free slots), `behind_prefills` (given a slot → its prefill call begun: the shorter prompts
        admitted with it go first), `prefill` (its prefill call and first token); `first_token` is their
        sum. `decode_call` is one sync's `steps_per_sync` steps of every live slot. `busy_s`: the seconds of
        `window_s` (the time since the last reset, or the start) the engine thread spent in prefill rounds
        (prefills and first tokens) and in decode syncs (host work around them included); a sum near
        `window_s` means requests queue behind each other whatever the scheduling. The HTTP side
        (parsing, tokenising, the event loop's write) is outside these figures. `reset`: start a new window."""
        with self._wake:
            firsts, calls = list(self._firsts), list(self._decode_seconds)
            now = time.perf_counter()
            window = now - self._window_started
            busy = {work: round(seconds, 4) for work, seconds in self._busy_seconds.items()}
            if reset:
                self._firsts.clear()
                self._decode_seconds.clear()
                self._busy_seconds = dict.fromkeys(self._busy_seconds, 0.0)
                self._window_started = now

        def summary(values):
            if not values:
                return None
            ms = np.asarray(values) * 1e3
            return {"p50": round(float(np.percentile(ms, 50)), 2), "p95": round(float(np.percentile(ms, 95)), 2),
                    "max": round(float(ms.max()), 2)}

        columns = list(zip(*firsts, strict=True)) if firsts else [[], [], []]
        return {"requests": len(firsts), "queue_ms": summary(columns[0]), "behind_prefills_ms": summary(columns[1]),
                "prefill_ms": summary(columns[2]), "first_token_ms": summary([sum(f) for f in firsts]),
                "decode_call_ms": summary(calls), "busy_s": busy, "window_s": round(window, 4),
                "steps_per_sync": self.steps_per_sync,
                "warm_up_s": None if self.warm_seconds is None else round(self.warm_seconds, 2),
                "background_warm_up_s": (None if self.background_warm_seconds is None
                                         else round(self.background_warm_seconds, 2))}

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
        self.wait_warm()  # at most the compile under way (`_warm_background` checks between two)

    # -- the engine thread --
    def _run(self) -> None:
        """The engine loop; if it fails (a bug, the device lost), every request it holds ends with
        finish_reason "error" (the route answers 500 naming the failure) and new ones are refused (503),
        rather than waiting forever on a thread that is gone."""
        try:
            self._serve()
        except Exception as error:  # noqa: BLE001  (any failure must reach the clients, then the log)
            log.exception("serve: the decode engine failed; refusing requests from now on")
            with self._wake:
                self.failure, self._stopping = f"{type(error).__name__}: {error}", True
                held = [r for r in self._live if r is not None] + list(self._waiting)
                self._waiting.clear()
                self._live = [None] * self.slots
            for request in held:
                request.finish_reason = "error"
                request.emit(None)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not any(self._live):
                    self._wake.wait()
                if self._stopping and not self._waiting and not any(self._live):
                    return
                admitted = self._admit()
            # Prefill priority: requests that arrived during this round's prefills are admitted and prefilled
            # before the next decode call too (measured at concurrency 8: waiting in the queue, most of it for
            # a decode call or for the round under way, was most of the time to first token). Each round takes
            # free slots, so the decode waits at most `slots` admissions.
            while admitted:
                with self._busy("prefill"):
                    self._start(admitted)
                with self._wake:
                    admitted = self._admit()
            self._drop_cancelled()
            if any(self._live):
                with self._busy("decode"):
                    self._step()

    @contextlib.contextmanager
    def _busy(self, work: str):
        """Adds the block's seconds to `work`'s busy time (`metrics`)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._wake:
                self._busy_seconds[work] += time.perf_counter() - started

    def _admit(self) -> list[Request]:
        taken = []
        free = [i for i, r in enumerate(self._live) if r is None]
        while free and self._waiting:
            request = self._waiting.popleft()
            if request.cancelled:
                continue
            request.slot = free.pop(0)
            request.times["admitted"] = time.perf_counter()
            self._live[request.slot] = request
            taken.append(request)
        return taken

    def _start(self, requests: list[Request]) -> None:
        """Prefills for the requests admitted this round, shortest prompt first, each group's first tokens
        sent as soon as its prefill ends (a short prompt does not wait for a long one's prefill, nor pay its
        padding). A group is `PREFILL_ROWS` requests of one prompt bucket when that many rows fit the
        prefill token budget (`prefill_tokens`), else one: two row counts, so a server compiles
        2 x buckets prefill programs (a compile while serving stalls every slot). Requests with the same
        prompt (`_same_prompt`) are prefilled once, where `shares_prefills`: the first of them (the leader) is
        prefilled, the others (its followers) get copies of its cache rows (`copy_rows`)."""
        requests = sorted(requests, key=lambda r: len(r.ids))
        followers: dict[int, list[Request]] = {}
        if self.shares_prefills:
            leaders: dict[tuple, Request] = {}
            for r in requests:
                leader = leaders.setdefault(_same_prompt(r), r)
                if leader is not r:
                    followers.setdefault(id(leader), []).append(r)
            requests = list(leaders.values())
        wide = min(PREFILL_ROWS, self.slots)
        while requests:
            size = bucket(len(requests[0].ids))
            group = [r for r in requests[:wide] if bucket(len(r.ids)) == size]
            if len(group) == 1 or wide * size > self.prefill_tokens or any(r.vision for r in group):
                group = group[:1]
            self._prefill_rows(group, wide if len(group) > 1 else 1, followers)
            requests = requests[len(group):]

    def _prefill_rows(self, requests: list[Request], rows: int, followers: dict[int, list[Request]]) -> None:
        """One prefill of `requests` padded to `rows` rows and their prompt bucket, the host arrays built by
        `engine.batch_arrays` (generate's; an image row with its patches, their count unpadded as generate's, so
        an image prompt's program is compiled per patch count: a processor's `max_pixels` keeps them few); then
        each request's `followers` (same prompt, by id of the request) receive its cache rows."""
        arrays, slots, vision = self._prompt_arrays(requests, rows, len)
        started = time.perf_counter()
        copies = [(row, f) for row, r in enumerate(requests) for f in followers.get(id(r), ())]
        everyone = requests + [f for _, f in copies]
        for request in everyone:
            request.times["prefill_start"] = started
        logits, self._cache = self._prefill(self.params, self._cache, arrays["tokens"], arrays["positions"],
                                            arrays["lengths"], slots, vision)
        self.prefilled += len(requests)
        if copies:
            size = _power_of_two(len(copies))
            sources, targets = np.zeros(size, np.int32), np.full(size, self.slots, np.int32)
            for i, (row, follower) in enumerate(copies):
                sources[i], targets[i], follower.offset = requests[row].slot, follower.slot, requests[row].offset
            self._cache = self._copy_rows(self._cache, sources, targets)
        self._first_tokens(logits, everyone, list(range(len(requests))) + [row for row, _ in copies])

    def _first_tokens(self, logits, requests: list[Request], rows_of: list[int]) -> np.ndarray:
        """Each request's first token from its prompt's logits row (`_choose`), committed, its time recorded
        → the tokens."""
        chosen = self._choose(logits, requests, rows_of)
        ended = time.perf_counter()
        for request, token in zip(requests, chosen, strict=True):
            request.times["first_token"] = ended
            self._record(request)
            self._commit(request, token)
        return chosen

    def _prompt_arrays(self, requests: list[Request], rows: int, prefilled) -> tuple[dict, np.ndarray, tuple | None]:
        """The prefill's host arrays of each request's first `prefilled(ids)` prompt tokens (`engine.batch_arrays`,
        generate's; an image row with its patches, their count unpadded as generate's, so an image prompt's
        program is compiled per patch count: a processor's `max_pixels` keeps them few), padded to `rows` rows
        and their bucket → (arrays, each row's slot, vision inputs or None); sets each request's `offset`."""
        patches = max((len(r.vision["patches"]) for r in requests if r.vision), default=0)
        chunk = []
        for r in requests:
            n = prefilled(r.ids)
            chunk.append((r.ids[:n], (np.arange(len(r.ids), dtype=np.int32) if r.positions is None else r.positions)[:n]))
        arrays = batch_arrays(chunk, [r.vision for r in requests], rows, bucket(max(len(c) for c, _ in chunk)),
                              patches, self.model_cfg, self.mrope)
        slots = np.full(rows, self.slots, np.int32)  # out of range: the padding rows' writes are dropped
        for row, (request, (ids, _)) in enumerate(zip(requests, chunk, strict=True)):
            # The next token after the prefilled ones sits at slot len(ids), position len(ids) + offset.
            slots[row], request.offset = request.slot, int(arrays["next_position"][row]) - len(ids)
        vision = (arrays["patches"], arrays["patch_positions"], arrays["patch_segments"]) if patches else None
        return arrays, slots, vision

    def _slot_arrays(self, requests: list[Request], kind: SamplingKind | None = None) -> dict[str, np.ndarray]:
        """Per slot, the host arrays a decode call reads, filled for `requests` (zeros elsewhere): the last
        committed token (the prompt's last before the first output), which is not in the cache yet and goes to
        the slot after the prompt and the others (`cursor`), position offsets, output counts, budgets, seeds,
        choice indices, `live` (these requests), and `sampling`, theirs (`sampling_rows`, of the kind covering
        them, or `kind`: the warm-up's)."""
        a = {k: np.zeros(self.slots, np.int32) for k in ("last", "cursor", "offsets", "counts", "budgets")}
        a.update(seeds=np.zeros(self.slots, np.uint32), choices=np.zeros(self.slots, np.uint32),
                 live=np.zeros(self.slots, bool))
        for r in requests:
            a["last"][r.slot] = r.tokens[-1] if r.tokens else r.ids[-1]
            a["cursor"][r.slot], a["offsets"][r.slot] = len(r.ids) + len(r.tokens) - 1, r.offset
            a["counts"][r.slot], a["budgets"][r.slot] = len(r.tokens), r.max_new
            a["seeds"][r.slot], a["choices"][r.slot], a["live"][r.slot] = r.seed, r.choice, True
        slot_samplings: list[Sampling | None] = [None] * self.slots
        for r in requests:
            slot_samplings[r.slot] = r.sampling
        a["sampling"] = sampling_rows(slot_samplings, self.slots)
        if kind is not None:
            a["sampling"] = dataclasses.replace(a["sampling"], kind=kind)
        return a

    def _decode_shape(self, live: list[Request], ahead: int) -> tuple[int, int]:
        """(slot rows, cache positions) of a decode call: only the slots up to the highest live one (slots are
        taken lowest first) and the positions the live cursors reach `ahead` positions on, so a light load
        computes a fraction of the cache."""
        rows = cover(self._row_sizes, max(r.slot for r in live) + 1)
        cursor = max(len(r.ids) + len(r.tokens) - 1 for r in live)
        return rows, cover(self._length_sizes, min(self.cache_length, cursor + ahead))

    def _record(self, request: Request) -> None:
        t = request.times
        with self._wake:
            self._firsts.append((t["admitted"] - t["submitted"], t["prefill_start"] - t["admitted"],
                                 t["first_token"] - t["prefill_start"]))

    def _step(self) -> None:
        """`steps_per_sync` tokens of every live slot in one program, each slot with its own sampling (the
        program of the kind that covers them all: `sampling_rows`)."""
        live = [r for r in self._live if r is not None]
        a = self._slot_arrays(live)
        rows, length = self._decode_shape(live, self.steps_per_sync)
        started = time.perf_counter()
        tokens = self._decode(rows, length, a)
        self._decode_seconds.append(time.perf_counter() - started)
        self.steps += self.steps_per_sync
        for r in live:
            self._commit_sync(r, tokens[:, r.slot])

    def _decode(self, rows: int, length: int, a: dict) -> np.ndarray:
        """One sync of `rows` slots over `length` cache positions with `_slot_arrays`' `a` → its tokens [steps, S]."""
        tokens, self._cache = self._decode_program(a["sampling"].kind, rows, length)(*self._decode_inputs(a))
        return np.asarray(tokens)

    def _decode_program(self, kind: SamplingKind, rows: int, length: int):
        """The compiled sync of `rows` slots over `length` cache positions for `kind` (`slot_programs.decoder`)."""
        return slot_programs.decoder(self.graphdef, self.vocab, kind, self.steps_per_sync, rows, length)

    def _decode_inputs(self, a: dict) -> tuple:
        """The sync's arguments from `_slot_arrays`' `a`."""
        return (self.params, self._cache, a["last"], a["cursor"], a["offsets"], a["seeds"], a["choices"], a["counts"],
                a["live"], a["budgets"], self._stops, a["sampling"])

    def _choose(self, logits, requests: list[Request], rows_of: list[int]) -> np.ndarray:
        """The first token of each new request from its prompt's logits row `rows_of[i]` of [rows, V], each
        with its own sampling, in one call (padded to at least the prefill's rows, then powers of two, so each
        `SamplingKind` compiles once per row count and a few counts of requests sharing prompts, not per
        number admitted)."""
        inputs = self._choose_inputs(logits, requests, rows_of)
        chosen = slot_programs.chooser(inputs[-1].kind, self.vocab)(*inputs)
        return np.asarray(chosen)[:len(requests)]

    def _choose_inputs(self, logits, requests: list[Request], rows_of: list[int], kind: SamplingKind | None = None,
                       size: int = 0):
        """`_choose`'s arguments (the warm-up's: its sampling of `kind` and at least `size` entries)."""
        size = max(logits.shape[0], _power_of_two(len(requests)), size)
        seeds, choices, counts = np.zeros(size, np.uint32), np.zeros(size, np.uint32), np.zeros(size, np.int32)
        index = np.zeros(size, np.int32)
        for i, r in enumerate(requests):
            seeds[i], choices[i], counts[i], index[i] = r.seed, r.choice, len(r.tokens), rows_of[i]
        sampling = sampling_rows([r.sampling for r in requests], size)
        if kind is not None:
            sampling = dataclasses.replace(sampling, kind=kind)
        return logits, index, seeds, choices, counts, sampling

    def _commit_sync(self, request: Request, tokens) -> None:
        """A sync's tokens of one request, up to its end (a stop, its budget, or the client gone), then one
        event for them all (a finished request had its None from `_free`)."""
        had = len(request.tokens)
        for token in tokens:
            if request.finish_reason is not None or request.cancelled:
                break
            self._commit(request, token, notify=False)
        if request.finish_reason is None and len(request.tokens) > had:
            request.emit(request.tokens[-1])

    def _commit(self, request: Request, token: int, notify: bool = True) -> None:
        """One token onto the request; `notify`: tell its route now (else the caller does, once per sync)."""
        token = int(token)
        request.tokens.append(token)
        if token in self.stop_ids:
            request.finish_reason = "stop"
        elif len(request.tokens) >= request.max_new:
            request.finish_reason = "length"
        if request.finish_reason is not None:
            self._free(request)
        elif notify:
            request.emit(token)

    def _drop_cancelled(self) -> None:
        with self._wake:
            for request in self._live:
                if request is not None and request.cancelled:
                    request.finish_reason = request.finish_reason or "cancelled"
                    self._free(request)

    def _free(self, request: Request) -> None:
        self._live[request.slot] = None
        request.emit(None)
