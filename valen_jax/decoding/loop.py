"""The one compiled decode loop: a whole batch of answers, prompt to end, in one `lax.while_loop`.

Every row carries its own cursor, position, output count, budget and (with a drafter) announced span.
Each iteration is one target pass for all rows:

- no row inside an announced span: `decode_step`, one token per live row (the target-only engine; with
  no drafter this is all the loop does, and `engine.generate_ids` is exactly that program);
- some row inside a span: the drafter proposes `width` tokens for every row, one `extend` over
  W = width + 1 slots [last, proposal] verifies them (`verification.accept_pass` per row, so greedy keeps
  the target's argmax and sampling is rejection-sampled), and each row commits its accepted tokens + the
  target's next; a row outside a span takes the target's token at slot 0 only (a plain step), drawn as
  the engine draws it;
- outside spans, a row whose automaton sits inside the call's fixed text (after `<tool_call>`: the 13
  tokens of `{"name":"atomic_decoding","arguments":{"block_size":` in the smoke tokenizer; after `,"`:
  `count":`) verifies that text as its draft (`announcements.spelled_drafts`, a deterministic proposal:
  under sampling, rejection against its point mass) in the same pass; when no row is inside a span such a
  pass runs without the drafter, as wide as the longest spelled draft. The call's numbers are the
  target's bonus tokens, and `</tool_call>` is a step, so a block's first token stays the drafter's.

Committed tokens go through `_commit` one slot at a time: the budget, the stop ids, and the
announcement automaton (`announcements.advance`): a `</tool_call>` that completes the compact
`atomic_decoding` spelling outside a span opens a span of `block_size` tokens (`count` of them when its
first token is `<dense>`, `Announcement.blocks`); a pass never drafts past the current block of the span
(the drafter is trained on one block). A row whose drafter missed `PATIENCE` passes in a row (accepted
no draft token) decodes the rest of that span with plain steps, so a drafter that does not fit the
target costs a couple of passes per span, not one per token. A call the device cannot read holds the
row (`held`): the loop stops when no row is live, the host reads the body with
`AtomicCalls.announced`, and `resume` goes on with the same state (`SpeculativeDecoder`). Spans follow `AtomicCalls.announced_spans`: a call completed
by a block's last token announces the next span even when the same pass's bonus token follows it.

A row's random stream is the engine's: the token at output index i outside spans is drawn with
`fold_in(row_key, i)`; a verify pass at index i drafts with `fold_in(fold_in(row_key, i), 1)` and accepts
with `..., 2)`. With no drafter the loop is token for token `engine.generate_ids` of before.

On an accelerator: all shapes are static (the caches, W, the output buffer [B, G]), the loop condition is
a device reduction, and nothing crosses to the host between tokens; the host waits once per batch (plus
once per held row, for a call outside the spelling). The caches are while-loop carries updated by
scatters in place, and `resume` donates the state. A finished row still occupies its lanes of every
pass (static shapes): its cursor stops, its writes land above its committed length, and the loop ends
when every row is finished.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from valen_jax.decoding import announcements
from valen_jax.decoding.sampling import RowSampling, Sampling, sample
from valen_jax.decoding.verification import accept_pass
from valen_jax.models.drafter import text_positions
from valen_jax.models.kv_cache import CACHE_AXES, KVCache
from valen_jax.models.sharding import constrain


class Spans(NamedTuple):
    """Per row: the announcement automaton and the announced span being decoded."""

    automaton: jax.Array  # int32 [B]
    registers: jax.Array  # int32 [B, 2]: block_size, count being read
    left: jax.Array  # int32 [B]: tokens left in the span (0: outside one)
    size: jax.Array  # int32 [B]: the span's block_size
    count: jax.Array  # int32 [B]: its announced count (0: none), applied at its first token
    fresh: jax.Array  # bool [B]: the next committed token is the span's first
    misses: jax.Array  # int32 [B]: verify passes in a row, in this span, that accepted no draft token


class Stats(NamedTuple):
    """Per row, verify passes inside spans (`speculative.BlockStats` sums them)."""

    passes: jax.Array  # int32 [B]
    committed: jax.Array  # int32 [B]
    drafted_at: jax.Array  # int32 [B, width]: passes drafting position k + 1
    accepted_at: jax.Array  # int32 [B, width]
    histogram: jax.Array  # int32 [B, width + 1]: passes accepting n draft tokens
    # Outside spans: passes verifying the call's fixed text (`announcements.spelled_drafts`), tokens they commit
    spelling_passes: jax.Array  # int32 [B]
    spelling_committed: jax.Array  # int32 [B]
    # Spans whose drafting stopped (`patience`), and the tokens plain steps committed in them afterwards
    stopped: jax.Array  # int32 [B]
    undrafted: jax.Array  # int32 [B]


class Rows(NamedTuple):
    cache: object
    draft: object  # the drafter rule's state, or ()
    last: jax.Array  # int32 [B]: the last committed token, not yet in the caches
    cursor: jax.Array  # int32 [B]: its slot
    position: jax.Array  # int32 [B]: its 1-D position
    count: jax.Array  # int32 [B]: output tokens committed
    budget: jax.Array  # int32 [B]: max new tokens of the row
    done: jax.Array  # bool [B]: a stop token, the budget, or a padding row
    held: jax.Array  # bool [B]: waiting for the host to read a call (announcements.ASK_HOST)
    out: jax.Array  # int32 [B, G]
    spans: Spans
    stats: Stats


def _keys_at(row_keys, index):
    return jax.vmap(jax.random.fold_in)(row_keys, index)


def _row_keys(seed, rows):
    return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), rows)


def token_key(seed, row, index):
    """The key row `row` draws its token `index` with under `seed`, built from `_row_keys` and `_keys_at`
    themselves, so a decoder that steps rows one at a time (the server's slots) draws this loop's stream."""
    return _keys_at(_row_keys(seed, jnp.asarray(row)[None]), jnp.asarray(index)[None])[0]


def _where(mask, new, old):
    return jax.tree.map(lambda a, b: jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b), new, old)


def _advance_span(spans: Spans, token, tables):
    """One committed token → (spans, hold): the span shrinks, a call completed outside one opens one."""
    in_span = spans.left > 0
    dense = in_span & spans.fresh & (token == tables.dense_id) & (spans.count > 0)
    left = spans.left + jnp.where(dense, spans.size * (spans.count - 1), 0) - in_span.astype(jnp.int32)
    automaton, registers, event = announcements.advance(tables, spans.automaton, spans.registers, token)
    outside = left == 0  # a call completed inside a span announces nothing (seed 004)
    announce = outside & (event == announcements.ANNOUNCE)
    hold = outside & (event == announcements.ASK_HOST)
    return Spans(automaton, registers, jnp.where(announce, registers[:, 0], left),
                 jnp.where(announce, registers[:, 0], spans.size), jnp.where(announce, registers[:, 1], spans.count),
                 announce | (spans.fresh & ~in_span), jnp.where(announce, 0, spans.misses)), hold


def _commit(rows: Rows, new, offered, stop_ids, tables) -> Rows:
    """Commit up to offered[b] of new [B, T] per row, in order, stopping at the budget, a stop token, or a
    call for the host. The cache holds [last, new[:, :T-1]] from the cursor, so committing c tokens moves
    the cursor by c and leaves new[c - 1] as the row's `last` (the rest lies above, overwritten later)."""
    width = new.shape[1]

    def slot(carry, j):
        spans, c, going, stopped, held = carry
        token = new[:, j]
        take = going & (j < offered) & (rows.count + c < rows.budget)
        hold = jnp.zeros_like(take)
        if tables is not None:
            moved, hold = _advance_span(spans, token, tables)
            spans = _where(take, moved, spans)
            hold = take & hold
        stop = take & jnp.isin(token, stop_ids)
        return (spans, c + take.astype(jnp.int32), take & ~stop & ~hold, stopped | stop, held | hold), None

    batch = new.shape[0]
    carry = (rows.spans, jnp.zeros(batch, jnp.int32), jnp.ones(batch, bool), jnp.zeros(batch, bool),
             jnp.zeros(batch, bool))
    if width == 1:
        carry, _ = slot(carry, 0)
    else:
        carry, _ = jax.lax.scan(slot, carry, jnp.arange(width))
    spans, c, _, stopped, held = carry
    last = jnp.take_along_axis(new, jnp.maximum(c - 1, 0)[:, None], axis=1)[:, 0]
    # A row that commits nothing writes nothing: a finished row's count may sit at the buffer's end, where
    # dynamic_update_slice would clamp the write back over its last tokens.
    out = jax.vmap(lambda o, n, s, c: jnp.where(c > 0, jax.lax.dynamic_update_slice(o, n, (s,)), o))(
        rows.out, new, rows.count, c)
    count = rows.count + c
    return rows._replace(last=jnp.where(c > 0, last, rows.last), cursor=rows.cursor + c, position=rows.position + c,
                         count=count, done=rows.done | stopped | (count >= rows.budget), held=rows.held | held,
                         out=out, spans=spans)


def _target(model, rule, draft_params, rows: Rows, tokens, positions, method: str):
    """The target over T tokens per row at the cursors (decode_step or extend), the drafter absorbing them."""
    collect = rule.collect if rule is not None else ()
    out = getattr(model, method)(tokens, positions, rows.cache, rows.cursor, collect=collect)
    if not collect:
        return out[0], out[1], rows.draft
    logits, cache, features = out
    return logits, cache, rule.absorb(draft_params, rows.draft, features, positions.reshape(features.shape[:2]),
                                      rows.cursor)


# Verify passes in a row that accept no draft token before a row stops drafting for the rest of its span
# (`Passes`). A drafter that keeps missing (a target that writes a block unlike the ones the drafter was
# trained on, or a drafter trained against another target) would otherwise cost a verify pass per token,
# where a plain step is cheaper: on this CPU a 17-slot pass costs about two steps, on a GPU/TPU about one
# step plus the drafter's forward. Two, not one: a block's first pass misses more often than later ones.
PATIENCE = 2


class Passes:
    """The loop's two passes for one model, drafter rule and sampling (inside the traced program): a
    `Sampling` for the whole batch (`generate`), or a `RowSampling`, each row its own (a server's slots).

    patience: after that many verify passes in a row accepting no draft token, a row decodes the rest of
    its span with plain steps (counted in `Stats.stopped`/`undrafted`); 0 drafts on whatever happens. Which
    tokens are drafted never changes what is committed: greedy output stays the target's, and a sampled
    token is drawn from the target's distribution whether it was drafted or not (the choice to draft
    depends on earlier tokens only)."""

    def __init__(self, model, rule, draft_params, sampling: Sampling, vocab: int, width: int, row_keys, stop_ids,
                 tables, patience: int = PATIENCE):
        self.model, self.rule, self.draft_params, self.sampling, self.vocab = model, rule, draft_params, sampling, vocab
        self.width, self.row_keys, self.stop_ids, self.tables = width, row_keys, stop_ids, tables
        self.patience = int(patience)

    def live(self, rows: Rows):
        return ~rows.done & ~rows.held

    def drafting(self, rows: Rows):
        """Live rows inside a span whose drafter has not missed `patience` passes in a row."""
        drafting = self.live(rows) & (rows.spans.left > 0)
        return drafting & (rows.spans.misses < self.patience) if self.patience else drafting

    def _undrafted(self, rows: Rows, after: Rows, plain) -> Rows:
        """`after` with the tokens that `plain` rows (live, inside a span, not drafting) committed counted."""
        plain = plain & (rows.spans.left > 0)
        return after._replace(stats=after.stats._replace(
            undrafted=after.stats.undrafted + jnp.where(plain, after.count - rows.count, 0)))

    def step(self, rows: Rows) -> Rows:
        logits, cache, draft = _target(self.model, self.rule, self.draft_params, rows, rows.last, rows.position,
                                       "decode_step")
        token = sample(logits, _keys_at(self.row_keys, rows.count), self.sampling, self.vocab)
        live = self.live(rows)
        after = _commit(rows._replace(cache=cache, draft=draft), token[:, None], live.astype(jnp.int32),
                        self.stop_ids, self.tables)
        return after if self.tables is None else self._undrafted(rows, after, live)

    def spells(self) -> bool:
        """Whether the tables hold spelled drafts (`announcements.spelled_drafts`; none without tables)."""
        return self.tables is not None and self.tables.spelled.shape[1] > 0

    def spelling(self, rows: Rows):
        """Live rows outside a span whose automaton sits inside the call's fixed text (`spelled`)."""
        if not self.spells():
            return jnp.zeros_like(rows.done)
        return self.live(rows) & (rows.spans.left == 0) & (self.tables.spelled_length[rows.spans.automaton] > 0)

    def verify(self, rows: Rows, drafter: bool = True) -> Rows:
        """One `extend` pass over [last, draft] for every row. A row inside a span verifies its drafter's
        proposal for the current block; a row outside one whose automaton is inside the call's fixed text
        verifies that text (`announcements.spelled_drafts`: deterministic, so under sampling q is its point
        mass); any other row takes the target's token at slot 0. drafter=False: no row is inside a span, so
        the drafter is not run and the pass is only as wide as the longest spelled draft."""
        width = self.width if drafter else min(self.width, self.tables.spelled.shape[1])
        slots = jnp.arange(width + 1)
        live = self.live(rows)
        drafting = self.drafting(rows)
        spelling = self.spelling(rows)
        block_left = (rows.spans.left - 1) % jnp.maximum(rows.spans.size, 1) + 1
        room = rows.budget - rows.count
        drafted = jnp.where(drafting, jnp.minimum(jnp.minimum(block_left, room), width), 0)
        base = _keys_at(self.row_keys, rows.count)
        draft, q = None, None
        if drafter:
            draft, q = self.rule.draft(self.draft_params, rows.draft, self.model, rows.last, rows.position,
                                       rows.cursor, rows.count, jax.vmap(jax.random.fold_in, (0, None))(base, 1),
                                       width)
        if self.spells():
            spelled = self.tables.spelled[rows.spans.automaton][:, :width]
            spelled = jnp.pad(spelled, ((0, 0), (0, width - spelled.shape[1])))
            length = self.tables.spelled_length[rows.spans.automaton]
            drafted = jnp.where(spelling, jnp.minimum(jnp.minimum(length, room), width), drafted)
            draft = spelled if draft is None else jnp.where(spelling[:, None], spelled, draft)
        if q is not None and not self.sampling.greedy:
            q = jnp.where(spelling[:, None, None], jax.nn.one_hot(draft, q.shape[-1], dtype=q.dtype), q)
        tokens = jnp.concatenate([rows.last[:, None], draft], axis=1)  # [B, W]
        positions = rows.position[:, None] + slots
        logits, cache, draft_state = _target(self.model, self.rule, self.draft_params, rows, tokens, positions,
                                             "extend")
        keys = jax.vmap(jax.random.fold_in, (0, None))(base, 2)
        per_row = isinstance(self.sampling, RowSampling)  # each row's own numbers, mapped with its row

        def accept(x, d, q_row, k, n, row_sampling):
            return accept_pass(x, d, q_row, k, n, row_sampling if per_row else self.sampling, self.vocab)

        accepted, nxt = jax.vmap(accept, in_axes=(0, 0, None if q is None else 0, 0, 0, 0 if per_row else None))(
            logits, draft, q, keys, drafted, self.sampling if per_row else None)
        # A row with nothing to verify takes the target's token at its last committed one: the engine's step.
        verified = drafting | spelling
        plain = sample(logits[:, 0], base, self.sampling, self.vocab)
        accepted, nxt = jnp.where(verified, accepted, 0), jnp.where(verified, nxt, plain)
        new = jnp.where(slots[None] < accepted[:, None], jnp.pad(draft, ((0, 0), (0, 1))), nxt[:, None])
        # Misses before the commit: a span the commit opens starts its own count at 0 (`_advance_span`).
        misses = jnp.where(drafting, jnp.where(accepted == 0, rows.spans.misses + 1, 0), rows.spans.misses)
        after = _commit(rows._replace(cache=cache, draft=draft_state, spans=rows.spans._replace(misses=misses)), new,
                        jnp.where(live, accepted + 1, 0), self.stop_ids, self.tables)
        s, k, one, committed = rows.stats, jnp.arange(self.width)[None], drafting.astype(jnp.int32), after.count - rows.count
        stopping = drafting & (misses == self.patience) if self.patience else jnp.zeros_like(drafting)
        stats = Stats(s.passes + one, s.committed + jnp.where(drafting, committed, 0),
                      s.drafted_at + (drafting[:, None] & (k < drafted[:, None])),
                      s.accepted_at + (drafting[:, None] & (k < accepted[:, None])),
                      s.histogram + (drafting[:, None] & (jnp.arange(self.width + 1)[None] == accepted[:, None])),
                      s.spelling_passes + spelling.astype(jnp.int32),
                      s.spelling_committed + jnp.where(spelling, committed, 0),
                      s.stopped + stopping.astype(jnp.int32), s.undrafted)
        return self._undrafted(rows, after._replace(stats=stats), live & ~drafting & ~spelling)

    def pass_(self, rows: Rows) -> Rows:
        """One pass: with a drafter, a verify pass when some live row is inside a span, a narrower one
        without the drafter when some live row is inside the call's fixed text, else a step."""
        if self.rule is None:
            return self.step(rows)
        in_span = jnp.any(self.drafting(rows))
        if not self.spells():
            return jax.lax.cond(in_span, self.verify, self.step, rows)
        branch = jnp.where(in_span, 2, jnp.where(jnp.any(self.spelling(rows)), 1, 0))
        return jax.lax.switch(branch, [self.step, functools.partial(self.verify, drafter=False), self.verify], rows)

    def repeat(self, rows: Rows, passes: int) -> Rows:
        """`passes` passes (a server's sync), each skipped once no row is live."""
        def body(_, rows):
            return jax.lax.cond(jnp.any(self.live(rows)), self.pass_, lambda r: r, rows)
        return jax.lax.fori_loop(0, passes, body, rows)

    def run(self, rows: Rows) -> Rows:
        """Passes until no row is live (every pass commits a token per live row: at most max(budget))."""
        limit = jnp.max(rows.budget)

        def cond(carry):
            step, rows = carry
            return (step < limit) & jnp.any(self.live(rows))

        def body(carry):
            step, rows = carry
            return step + 1, self.pass_(rows)

        return jax.lax.while_loop(cond, body, (jnp.int32(0), rows))[1]


def slot_keys(seeds, choices):
    """One key per row from its own seed and choice index: `token_key`'s row keys, for rows of different
    requests (a server's slots); `_keys_at(slot_keys(...), i)` is then row token i's key."""
    return jax.vmap(lambda seed, choice: _row_keys(seed, choice[None])[0])(seeds, choices)


def prompt_spans(tables, tokens, lengths, last, active) -> tuple[Spans, jax.Array]:
    """Each row's prompt ids (tokens [B, P], the first lengths[b] real, then `last`) through the
    announcement automaton → (Spans, held): a prompt ending with a call opens a span at output 0 (only the
    last id's event counts); held: it ends with a call the device cannot read (the host reads it)."""
    zeros = jnp.zeros(tokens.shape[0], jnp.int32)

    def read(carry, column):
        state, registers = carry
        j, token = column
        moved, moved_registers, _ = announcements.advance(tables, state, registers, token)
        inside = j < lengths
        return (jnp.where(inside, moved, state), jnp.where(inside[:, None], moved_registers, registers)), None

    (state, registers), _ = jax.lax.scan(read, (zeros, jnp.zeros((tokens.shape[0], 2), jnp.int32)),
                                         (jnp.arange(tokens.shape[1]), tokens.T))
    state, registers, event = announcements.advance(tables, state, registers, last)
    announce = active & (event == announcements.ANNOUNCE)
    spans = Spans(state, registers, jnp.where(announce, registers[:, 0], 0), jnp.where(announce, registers[:, 0], 0),
                  jnp.where(announce, registers[:, 1], 0), announce, zeros)
    return spans, active & (event == announcements.ASK_HOST)


def drafts_first(spans: Spans, spelled_length):
    """Rows whose first output token is drafted: the prompt opened a span, or ends inside the call's fixed
    text (`Tables.spelled_length` of its automaton state). Their first pass feeds the prompt's last token
    again instead of the prefill choosing that token (`speculative_programs`, and the server's slots on
    their host copies: numpy or device arrays alike)."""
    return (spans.left > 0) | (spelled_length[spans.automaton] > 0)


def blank(batch: int, width: int, out_length: int, budget):
    zeros = jnp.zeros(batch, jnp.int32)
    spans = Spans(zeros, jnp.zeros((batch, 2), jnp.int32), zeros, zeros, zeros, jnp.zeros(batch, bool), zeros)
    stats = Stats(zeros, zeros, jnp.zeros((batch, width), jnp.int32), jnp.zeros((batch, width), jnp.int32),
                  jnp.zeros((batch, width + 1), jnp.int32), zeros, zeros, zeros, zeros)
    return spans, stats, jnp.zeros((batch, out_length), jnp.int32), jnp.broadcast_to(budget, (batch,))


def _grouped(group: int, logits, cache: KVCache, *per_prompt):
    """Each prompt's prefill result copied to its `group` consecutive rows (row p·G + g is copy g of prompt
    p): logits [P, V] -> [P·G, V], the cache's rows, and the per-prompt arrays [P, ...]."""
    if group == 1:
        return (logits, cache, *per_prompt)
    copies = functools.partial(jnp.repeat, repeats=group, axis=0)
    cache = KVCache(*(constrain(jnp.repeat(x, group, axis=1), CACHE_AXES) for x in cache))
    return (constrain(copies(logits), ("batch", "act_vocab")), cache, *(copies(x) for x in per_prompt))


@functools.cache
def engine_program(graphdef, sampling: Sampling, vocab: int, cache_length: int, out_length: int, group: int = 1):
    """The target-only program of one batch (`engine.generate_ids`): the prefill of whole prompts, the
    first token from its logits, then the loop of decode steps → (out [B, G], count [B]). With `group` > 1
    the batch's P prompts are prefilled once each and decoded `group` times (B = P·group rows, `rows` their
    key indices): sampling G completions of a prompt (a reinforcement rollout) costs one prefill, not G."""

    def run(params, tokens, positions, lengths, next_position, active, vision, stop_ids, seed, rows, max_new):
        model = nnx.merge(graphdef, params)
        logits, cache = model.prefill(tokens, positions, lengths, cache_length, vision)
        logits, cache, lengths, next_position, active = _grouped(group, logits, cache, lengths, next_position,
                                                                 active)
        row_keys = _row_keys(seed, rows)
        batch = lengths.shape[0]
        spans, stats, out, budget = blank(batch, 0, out_length, max_new)
        # As if the prompt's last token had just been `last`: committing the first token moves the cursor
        # and position onto its own slot (lengths) and position (next_position).
        state = Rows(cache, (), jnp.zeros(batch, jnp.int32), lengths - 1, next_position - 1,
                     jnp.zeros(batch, jnp.int32), budget, ~active, jnp.zeros(batch, bool), out, spans, stats)
        first = sample(logits, _keys_at(row_keys, state.count), sampling, vocab)
        state = _commit(state, first[:, None], active.astype(jnp.int32), stop_ids, None)
        state = Passes(model, None, (), sampling, vocab, 0, row_keys, stop_ids, None).run(state)
        # Batch-sharded like the inputs, so each process reads back exactly its own rows.
        return constrain(state.out, ("batch", None)), constrain(state.count, ("batch",))

    return jax.jit(run)


def prefill_with_drafter(model, rule, draft_params, tokens, positions, lengths, cache_length: int, vision):
    """The target's prefill and the drafter's state from the same pass (its context, when it reads the
    target's layers) → (logits at each row's last token, target cache, drafter state)."""
    if rule.collect:
        logits, cache, features = model.prefill(tokens, positions, lengths, cache_length, vision, collect=rule.collect)
        return logits, cache, rule.init(draft_params, features, text_positions(positions), cache_length)
    logits, cache = model.prefill(tokens, positions, lengths, cache_length, vision)
    return logits, cache, rule.init(draft_params, None, None, cache_length)


@functools.cache
def speculative_programs(graphdef, rule, sampling: Sampling, vocab: int, width: int, cache_length: int,
                         out_length: int, patience: int = PATIENCE):
    """(start, resume) with a device drafter (`draft_rules`; `patience` as `Passes`). start: the prefill of
    whole prompts and the drafter's state from the same pass, the automaton over the whole prompt, the first
    token from the prefill's logits (drawn as the engine draws it), then the loop → Rows. A row that has a
    draft at output 0 takes no first token there: a prompt ending with a call that opens a span (or one the
    host must read: `held`), or inside the call's fixed text (`Passes.spelling`). Its first pass feeds the
    prompt's last token again (`last`, rewriting that token's cache slot with the same keys/values), so the
    block is drafted whole (an oracle: tau = B + 1). resume(Rows): the loop again after the host answered
    held rows (state donated)."""

    def start(params, draft_params, tokens, positions, lengths, last, last_position, active, vision, stop_ids, seed,
              rows, budget, tables):
        model = nnx.merge(graphdef, params)
        logits, cache, draft = prefill_with_drafter(model, rule, draft_params, tokens, positions, lengths,
                                                    cache_length, vision)
        batch = tokens.shape[0]
        _, stats, out, budget = blank(batch, width, out_length, budget)
        # The automaton over the prompt but its last token, then that one (`last`): its event opens a span.
        spans, held = prompt_spans(tables, tokens, lengths - 1, last, active)
        state = Rows(cache, draft, last, lengths - 1, last_position, jnp.zeros(batch, jnp.int32), budget,
                     ~active | (budget <= 0), held, out, spans, stats)
        passes = _passes(model, draft_params, seed, rows, stop_ids, tables)
        # The first token of every other row is the prefill's, as in `engine_program`: a step saved per answer.
        first = sample(logits, _keys_at(passes.row_keys, state.count), sampling, vocab)
        take = passes.live(state) & ~drafts_first(spans, tables.spelled_length)
        return passes.run(_commit(state, first[:, None], take.astype(jnp.int32), stop_ids, tables))

    def _passes(model, draft_params, seed, rows, stop_ids, tables):
        return Passes(model, rule, draft_params, sampling, vocab, width, _row_keys(seed, rows), stop_ids, tables,
                      patience)

    def resume(params, draft_params, state: Rows, stop_ids, seed, rows, tables):
        return _passes(nnx.merge(graphdef, params), draft_params, seed, rows, stop_ids, tables).run(state)

    return jax.jit(start), jax.jit(resume, donate_argnums=(2,))
