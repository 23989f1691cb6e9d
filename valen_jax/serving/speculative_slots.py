"""Speculative decoding in the decode slots (`python -m valen_jax.serve --drafter=WORKDIR`).

The slot engine of `serving.slots` whose sync runs `steps_per_sync` passes of the decode loop
(`decoding.loop.Passes`, the program `generate_batch` and evaluation run) instead of plain steps: a
pass is a decode step while no live slot is inside an announced block or a call's fixed text, else one
draft → verify pass for every slot (a slot outside both takes the target's token at slot 0 as a plain step). So a
greedy answer is the target's own (as `SpeculativeDecoder`, tests/test_serve_speculative.py compares
it with `generate`), and a sampled one is rejection-sampled: its distribution is the target's. Each slot
samples with its own numbers (`sampling.RowSampling`), so one sync serves every live slot.

What each slot keeps across syncs, besides the target's cache row:
- the drafter's context cache row (`[L_d, S, K, C, H]`, written by the prefill and every pass, donated
  like the target's);
- its announcement automaton and announced span (`loop.Spans`), and its verify statistics
  (`loop.Stats`: passes, tokens committed in blocks, drafted and accepted per position), on the host
  between syncs (a few ints per slot), reset by the slot's prefill.

As in `SpeculativeDecoder`, the prefill covers the whole prompt and gives the first token (as in plain
serving: `SlotEngine._choose`, each request with its own sampling), except for a prompt ending with an
`atomic_decoding` call (or inside its fixed text): its first pass feeds the prompt's last token again so
that the block (or the text) is drafted from output 0, and its first token arrives with the first sync.
A call the device's automaton cannot read holds its slot until the sync ends; the host reads it with
`AtomicCalls.announced` (`speculative.open_host_span`) and the slot goes on at the next sync (a prompt
ending with one is read at its prefill).

A pass costs a verify `extend` over width + 1 positions for every slot up to the highest live one as soon
as any of them is inside a block; the other slots take their plain token from the same pass.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data_pipeline.primitives import AtomicCalls
from valen_jax.decoding import announcements, loop
from valen_jax.decoding.sampling import RowSampling, SamplingKind
from valen_jax.decoding.speculative import open_host_span
from valen_jax.serving.slots import Request, SlotEngine


def _into_slots(whole, rows, slots):
    """Rows [L, A, ...] of a prefill into their slots of a slot-wide cache (padding rows: out of range, dropped)."""
    return jax.tree.map(lambda w, r: w.at[:, slots].set(r.astype(w.dtype), mode="drop"), whole, rows)


@functools.cache
def _prefill_program(graphdef, rule, cache_length: int):
    def prefill(params, draft_params, cache, draft, tokens, positions, lengths, slots, vision, last, tables):
        """Whole prompts [A, P] into their slots, the drafter's context with them, and the automaton over each
        prompt (`last` its last token) → (logits at the last tokens, cache, draft, Spans, held) of the A rows."""
        model = nnx.merge(graphdef, params)
        logits, rows, context = loop.prefill_with_drafter(model, rule, draft_params, tokens, positions, lengths,
                                                          cache_length, vision)
        spans, held = loop.prompt_spans(tables, tokens, lengths - 1, last, slots < cache.keys.shape[1])
        return logits, _into_slots(cache, rows, slots), _into_slots(draft, context, slots), spans, held

    def empty(params, draft_params, slots):
        model = nnx.merge(graphdef, params)
        tokens = jnp.zeros((slots, 1), jnp.int32)
        return loop.prefill_with_drafter(model, rule, draft_params, tokens, tokens, jnp.ones(slots, jnp.int32),
                                         cache_length, None)[2]

    return jax.jit(prefill, donate_argnums=(2, 3)), jax.jit(empty, static_argnums=(2,))


@jax.jit
def _advance(spans: loop.Spans, tokens, tables):
    """Every slot's span and automaton after one committed token (a first token drawn from the prefill) →
    (Spans, hold): the loop's own rule (`loop._advance_span`), for the host to keep the slots it concerns."""
    return loop._advance_span(spans, tokens, tables)


@functools.cache
def _sync_program(graphdef, rule, vocab: int, kind: SamplingKind, width: int, passes: int, rows: int, length: int,
                  patience: int):
    """`passes` loop passes of slots [0, rows) over cache positions [0, length) (the rest untouched) →
    (the tokens each slot committed [rows, passes·(width + 1)], from its count on; counts; held; Spans; Stats;
    both caches). Each slot samples with its own numbers (`sampling`, of `kind`: `sampling.sampling_rows`), so
    a new number compiles nothing."""
    window = passes * (width + 1)

    def sync(params, draft_params, cache, draft, last, cursor, offsets, seeds, choices, counts, live, budgets,
             spans, stats, stop_ids, tables, sampling: RowSampling):
        model = nnx.merge(graphdef, params)
        whole, whole_draft = cache, draft
        cut = functools.partial(jax.tree.map, lambda x: x[:, :rows, :, :length])
        first = functools.partial(jax.tree.map, lambda x: x[:rows])
        last, cursor, offsets, seeds, choices, counts, live, budgets, spans, stats, sampling = first(
            (last, cursor, offsets, seeds, choices, counts, live, budgets, spans, stats, sampling))
        # `_commit` writes a slot's tokens at its output index: room for the budget and one sync beyond it.
        out = jnp.zeros((rows, whole.keys.shape[3] + window), jnp.int32)
        state = loop.Rows(cut(whole), cut(whole_draft), last, cursor, cursor + offsets, counts, budgets, ~live,
                          jnp.zeros(rows, bool), out, spans, stats)
        state = loop.Passes(model, rule, draft_params, sampling, vocab, width, loop.slot_keys(seeds, choices),
                            stop_ids, tables, patience).repeat(state, passes)
        tokens = jax.vmap(lambda o, c: jax.lax.dynamic_slice(o, (c,), (window,)))(state.out, counts)

        def back(full, part):
            return jax.tree.map(lambda f, p: jax.lax.dynamic_update_slice(f, p, (0,) * f.ndim), full, part)

        return (tokens, state.count, state.held, state.spans, state.stats, back(whole, state.cache),
                back(whole_draft, state.draft))

    return jax.jit(sync, donate_argnums=(2, 3))


class SpeculativeSlotEngine(SlotEngine):
    """`SlotEngine` with a block drafter (module docstring). drafter: a device drafter with a block size
    (a `CachedDrafter` of a vflash workdir trained against this target; the tests' `ScriptedDrafter`);
    calls: the target tokenizer's `AtomicCalls`; patience: as `loop.Passes` (verify passes in a row accepting
    nothing before a slot stops drafting in its span; 0: never)."""

    # A verify pass computes block_size + 1 positions of every slot up to the highest live one, so an idle
    # lane costs as much as a live one: sync programs of 1, 2, 4, ... slots (plain decode starts at 8, where
    # a lane is one position), so one request alone pays for one lane.
    min_decode_rows = 1
    # Equal prompts are prefilled each on their own: a copy would need the drafter's state rows too.
    shares_prefills = False

    def __init__(self, params, graphdef, *, drafter, calls: AtomicCalls, slots: int,
                 cache_length: int, patience: int = loop.PATIENCE, **kwargs):
        self.drafter, self.calls, self.width = drafter, calls, int(drafter.rule.block_size)
        self.patience = int(patience)
        self._spec_prefill, empty = _prefill_program(graphdef, drafter.rule, int(cache_length))
        self._draft = empty(params, drafter.params, int(slots))
        self._tables = announcements.tables(calls, nnx.merge(graphdef, params).cfg.vocab_size)
        self._spelled_length = np.asarray(self._tables.spelled_length)
        self._spans, self._stats = jax.tree.map(np.array, loop.blank(slots, self.width, 1, 0)[:2])
        super().__init__(params, graphdef, slots=slots, cache_length=cache_length, **kwargs)

    def _warm_prefill(self, tokens, positions):
        """One padding-only speculative prefill (the drafter's state too) → its logits."""
        rows = len(tokens)
        logits, self._cache, self._draft, *_ = self._spec_prefill(
            self.params, self.drafter.params, self._cache, self._draft, tokens, positions, np.ones(rows, np.int32),
            np.full(rows, self.slots, np.int32), None, np.zeros(rows, np.int32), self._tables)
        return logits

    def _warm_decodes(self) -> None:
        """The span advance after a first token, then every greedy sync (`SlotEngine._warm_decodes`)."""
        _advance(self._spans, np.zeros(self.slots, np.int32), self._tables)
        super()._warm_decodes()

    def _prefill_rows(self, requests: list[Request], rows: int, followers: dict[int, list[Request]]) -> None:
        """The whole prompts into the requests' slots, their spans from the automaton, their statistics reset;
        then the first token of each request whose prompt opens no span and ends outside the call's fixed
        text (a prompt ending with a call the host reads is read here first), drawn from the prefill's logits
        as `SlotEngine` draws it, the spans advanced by it. A request whose prompt announces a block gets its
        first token with the next sync."""
        arrays, slots, vision = self._prompt_arrays(requests, rows, len)
        last = np.zeros(rows, np.int32)
        last[:len(requests)] = [r.ids[-1] for r in requests]
        started = time.perf_counter()
        for request in requests:
            request.times["prefill_start"] = started
        logits, self._cache, self._draft, spans, held = self._spec_prefill(
            self.params, self.drafter.params, self._cache, self._draft, arrays["tokens"], arrays["positions"],
            arrays["lengths"], slots, vision, last, self._tables)
        self.prefilled += len(requests)
        spans, held = jax.tree.map(np.asarray, spans), np.asarray(held)
        for row, request in enumerate(requests):
            for mine, new in zip(self._spans, spans, strict=True):
                mine[request.slot] = new[row]
            for mine in self._stats:
                mine[request.slot] = 0
            if held[row]:
                self._read_call(request, list(request.ids))
        waits = loop.drafts_first(self._spans, self._spelled_length)
        firsts = [(row, r) for row, r in enumerate(requests) if not waits[r.slot]]
        if not firsts:
            return
        chosen = self._first_tokens(logits, [r for _, r in firsts], [row for row, _ in firsts])
        tokens = np.zeros(self.slots, np.int32)
        for (_, request), token in zip(firsts, chosen, strict=True):
            tokens[request.slot] = token
        moved, hold = jax.tree.map(np.asarray, _advance(self._spans, tokens, self._tables))
        for _, request in firsts:
            for mine, new in zip(self._spans, moved, strict=True):
                mine[request.slot] = new[request.slot]
            if request.finish_reason is None and hold[request.slot]:
                self._read_call(request, list(request.ids) + request.tokens)

    def _read_call(self, request: Request, ids: list[int]) -> None:
        spans = {k: getattr(self._spans, k) for k in ("left", "size", "count", "fresh", "misses")}
        open_host_span(self.calls, ids, spans, request.slot)

    def _decode_program(self, kind: SamplingKind, rows: int, length: int):
        return _sync_program(self.graphdef, self.drafter.rule, self.vocab, kind, self.width, self.steps_per_sync,
                             rows, length, self.patience)

    def _decode_inputs(self, a: dict) -> tuple:
        return (self.params, self.drafter.params, self._cache, self._draft, a["last"], a["cursor"], a["offsets"],
                a["seeds"], a["choices"], a["counts"], a["live"], a["budgets"], self._spans, self._stats, self._stops,
                self._tables, a["sampling"])

    def _decode(self, rows: int, length: int, a: dict):
        """One sync (`_sync_program`) → (tokens, each slot's output count, the slots whose latest token ends a
        call the host reads); the spans and statistics updated."""
        program = self._decode_program(a["sampling"].kind, rows, length)
        tokens, new_counts, held, spans, stats, self._cache, self._draft = program(*self._decode_inputs(a))
        tokens, new_counts, held = np.asarray(tokens), np.asarray(new_counts), np.asarray(held)
        for mine_field, new in zip((*self._spans, *self._stats), (*spans, *stats), strict=True):
            mine_field[:rows] = np.asarray(new)
        return tokens, new_counts, held

    def _step(self) -> None:
        live = [r for r in self._live if r is not None]
        # Each pass writes width + 1 positions from a slot's cursor on.
        rows, length = self._decode_shape(live, self.steps_per_sync * (self.width + 1) + 1)
        started = time.perf_counter()
        tokens, counts, held = self._decode(rows, length, self._slot_arrays(live))
        self._decode_seconds.append(time.perf_counter() - started)
        self.steps += self.steps_per_sync
        for r in live:
            had = len(r.tokens)
            self._note_stats(r)  # before the commits: the last one may end the answer, read by the route
            self._commit_sync(r, tokens[r.slot, :counts[r.slot] - had])
            if had == 0 and r.tokens:
                r.times["first_token"] = time.perf_counter()
                self._record(r)
            if r.finish_reason is None and held[r.slot]:
                self._read_call(r, list(r.ids) + r.tokens)

    def _note_stats(self, request: Request) -> None:
        s, slot = self._stats, request.slot
        request.speculation = {"verify_passes": int(s.passes[slot]), "block_tokens": int(s.committed[slot]),
                               "drafted_tokens": int(s.drafted_at[slot].sum()),
                               "accepted_tokens": int(s.accepted_at[slot].sum()),
                               "spelling_passes": int(s.spelling_passes[slot]),
                               "spelling_tokens": int(s.spelling_committed[slot]),
                               "stopped_spans": int(s.stopped[slot]), "undrafted_tokens": int(s.undrafted[slot])}
