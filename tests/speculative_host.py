"""The host-loop speculative decoder: the differential oracle of the library's compiled block loop.

`valen_jax.decoding.speculative.SpeculativeDecoder` decodes whole answers, rows batched, in ONE compiled
`lax.while_loop` (`decoding.loop`), announcements found on the device, the only path the library has.
This module keeps the other way to compute the same thing, for the tests only: a Python loop around
jitted prefill / decode_step / extend passes, taking drafters written in Python (`propose(context,
block, key) -> Proposal`), announcements read on the host by `AtomicCalls.announced` after every token
(`_decode`), accepting with the same `accept_pass`. The two share only the prompt checks; everything
else (KV-cache cursors, padding of the verify width, commit bookkeeping, the drafter's context, where a
block starts) is computed independently here, so a test that compares them (output, passes, histogram,
acceptance) catches a bookkeeping bug in either.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from valen_jax.decoding.engine import bucket, generate_ids
from valen_jax.decoding.sampling import mask_vocab, sample
from valen_jax.decoding.speculative import CachedDrafter, SpeculativeDecoder
from valen_jax.decoding.verification import accept_pass
from valen_jax.models import drafter as block_drafter
from valen_jax.models import kv_cache


@dataclass(frozen=True)
class Proposal:
    tokens: np.ndarray  # int32 [d]
    q: np.ndarray | None = None  # f32 [d, V]: the drafter's distribution at each slot; None: deterministic


class Drafter(Protocol):
    def propose(self, context: np.ndarray, block: int, key: jax.Array) -> Proposal:
        """1 to `block` tokens to follow `context` (every committed id of the row: prompt and output)."""
        ...


@functools.cache
def _passes(graphdef, cache_length: int):
    def prefill(params, tokens, positions, lengths, vision=None):
        return nnx.merge(graphdef, params).prefill(tokens, positions, lengths, cache_length, vision)

    def step(params, token, position, cache, cursor):
        return nnx.merge(graphdef, params).decode_step(token, position, cache, cursor)

    def verify(params, tokens, positions, cache, cursor):
        return nnx.merge(graphdef, params).extend(tokens, positions, cache, cursor)

    return jax.jit(prefill), jax.jit(step), jax.jit(verify)


@dataclass
class _Row:
    ids: list[int]  # prompt + committed output
    prompt: int
    cache: kv_cache.KVCache
    cursor: int  # the slot of ids[-1], committed but not yet in the cache
    position: int  # its position
    passes: int = 0  # target passes so far (the random stream's counter)
    misses: int = 0  # verify passes in a row, in this span, that accepted no draft token

    @property
    def output(self) -> list[int]:
        return self.ids[self.prompt:]


class HostDecoder(SpeculativeDecoder):
    """`SpeculativeDecoder`'s rules on the host: any drafter with `propose`, or None (target only)."""

    def generate(self, prompt, drafter, *, max_new_tokens: int, seed: int = 0, positions=None,
                 vision_inputs=None) -> list[int]:
        ids, positions, vision = self._prompt(prompt, positions, vision_inputs)
        row = self.start(ids, max_new_tokens, positions=positions, vision=vision)
        return self._decode(row, lambda size, key: self.block(row, drafter, size, key, max_new_tokens),
                            lambda key: self.step(row, key), drafter is not None, max_new_tokens, seed)

    def _decode(self, row, block, step, drafting: bool, max_new_tokens: int, seed: int) -> list[int]:
        """The loop over announcements: `block(size, key)` commits a block and returns its overflow,
        `step(key)` one target token."""
        key = jax.random.key(seed)
        announced = self.calls.announced(row.ids) if self.calls else None
        while len(row.output) < max_new_tokens and not self._stopped(row):
            if announced is not None and drafting:
                start = len(row.output)
                row.misses = 0  # a span starts drafting afresh (`loop.PATIENCE`)
                overflow = block(announced.block_size, key)
                # Seed 004: for dense motion `count` gives the number of trajectories, one block each.
                blocks = announced.blocks(row.output[start:start + 1] == [self.calls.dense_id])
                for _ in range(blocks - 1):
                    # A bonus token past the previous block is this block's first.
                    overflow = block(announced.block_size - overflow, key)
                # A bonus token past the block is ordinary output; a call it completes is announced.
                announced = self.calls.announced(row.ids)
                continue
            step(key)
            announced = self.calls.announced(row.ids) if self.calls else None
        return row.output

    def _stopped(self, row) -> bool:
        return bool(row.output) and row.output[-1] in self.stop_ids

    def start(self, prompt, max_new_tokens: int, positions=None, vision=None) -> _Row:
        """Prefill all but the prompt's last token; that one is the first `last` a pass feeds."""
        ids = [int(i) for i in np.asarray(prompt)]
        if len(ids) < 2:
            raise ValueError(f"prompt of {len(ids)} tokens: speculative decoding needs at least 2")
        positions = np.arange(len(ids), dtype=np.int32) if positions is None else np.asarray(positions, np.int32)
        cache_length = bucket(len(ids) + max_new_tokens + 1)
        prefill, _, _ = _passes(self.graphdef, cache_length)
        head = jnp.asarray(ids[:-1], jnp.int32)[None]
        batched = None if vision is None else tuple(jnp.asarray(vision[k])[None] for k in
                                                    ("patches", "patch_positions", "patch_segments"))
        _, cache = prefill(self.params, head, jnp.asarray(positions[:-1])[None], jnp.asarray([len(ids) - 1], jnp.int32),
                           batched)
        last = int(positions[-1].reshape(-1)[0])
        return _Row(ids, len(ids), cache, len(ids) - 1, last)

    def _choose(self, logits, key):
        return int(sample(logits, key[None], self.sampling, self.vocab)[0])

    def step(self, row: _Row, key) -> None:
        """One target token: decode_step on the row's last token."""
        _, step, _ = _passes(self.graphdef, row.cache.length)
        logits, row.cache = step(self.params, jnp.asarray([row.ids[-1]], jnp.int32),
                                 jnp.asarray([row.position], jnp.int32), row.cache, jnp.asarray([row.cursor], jnp.int32))
        row.ids.append(self._choose(logits, jax.random.fold_in(key, row.passes)))
        row.passes += 1
        row.cursor += 1
        row.position += 1

    def block(self, row: _Row, drafter, size: int, key, max_new_tokens: int) -> int:
        """Commit the next `size` tokens (fewer at a stop or the budget) by draft + verify passes. The
        last pass's bonus token may lie one past the block (it is the target's next token all the same):
        returns how many tokens did (0 or 1)."""
        _, _, verify = _passes(self.graphdef, row.cache.length)
        remaining = size
        while remaining > 0 and len(row.output) < max_new_tokens and not self._stopped(row):
            if self.patience and row.misses >= self.patience:  # the drafter gave up: plain steps to the end
                self.step(row, key)
                self.stats.undrafted += 1
                remaining -= 1
                continue
            d = min(remaining, max_new_tokens - len(row.output))
            pass_key = jax.random.fold_in(key, row.passes)
            proposal = drafter.propose(np.asarray(row.ids, np.int32), d, jax.random.fold_in(pass_key, 1))
            draft = np.asarray(proposal.tokens, np.int32)
            if draft.ndim != 1 or not 1 <= len(draft) <= d:
                raise ValueError(f"drafter proposed tokens of shape {draft.shape}; asked for 1 to {d} tokens")
            if draft.min() < 0 or draft.max() >= self.vocab:
                raise ValueError(f"drafter proposed ids {draft.tolist()}: outside the vocabulary [0, {self.vocab})")
            d = len(draft)  # a drafter with a shorter block proposes what it can; the next pass drafts on
            # One compiled pass per padded length: slots past the draft hold -1 tokens (id 0 embedded) that
            # greedy never accepts (no argmax is -1) and sampling masks; their cache writes lie above the
            # committed length, cropped like a rejected tail. Exact length where padding would not fit.
            width = max(8, 1 << d.bit_length())  # >= d + 1
            if row.cursor + width > row.cache.length:
                width = d + 1
            padded = np.full(width - 1, -1, np.int32)
            padded[:d] = draft
            tokens = jnp.asarray(np.concatenate([[row.ids[-1]], np.maximum(padded, 0)]), jnp.int32)[None]
            positions = (row.position + jnp.arange(width, dtype=jnp.int32))[None]
            logits, row.cache = verify(self.params, tokens, positions, row.cache, jnp.asarray([row.cursor], jnp.int32))
            accepted, nxt = self._verify(logits[0], padded, d, proposal.q, jax.random.fold_in(pass_key, 2))
            new = [*draft[:accepted].tolist(), nxt]
            row.passes += 1
            # Crop: the committed tokens' keys stay; the cursor moves to the new last token's slot.
            row.cursor += accepted + 1
            row.position += accepted + 1
            committed = 0
            for token in new:
                if len(row.output) >= max_new_tokens or self._stopped(row):
                    break
                row.ids.append(int(token))
                committed += 1
            self.stats.record(d, accepted, committed)
            row.misses = 0 if accepted else row.misses + 1
            self.stats.stopped += bool(self.patience) and row.misses == self.patience
            remaining -= accepted + 1
        return max(-remaining, 0)

    def _verify(self, logits, padded, drafted: int, q, key) -> tuple[int, int]:
        """(accepted, next token) from the verify pass's logits [W, V] over a draft padded with -1 to W - 1:
        the block loop's own rule (`accept_pass`), so both paths accept alike."""
        q_rows = None  # a deterministic drafter: accept_pass takes q as the point mass on its proposal
        if not self.sampling.greedy and q is not None:
            width, vocab = logits.shape
            q = np.asarray(q, np.float32)
            if q.shape != (drafted, q.shape[1]) or q.shape[1] > vocab:
                raise ValueError(f"drafter q of shape {q.shape}; want [{drafted}, <= {vocab}]")
            q_rows = np.zeros((width - 1, vocab), np.float32)
            q_rows[:drafted, :q.shape[1]] = q
        accepted, nxt = _accept(logits, jnp.maximum(jnp.asarray(padded), 0), q_rows, key, jnp.int32(drafted),
                                self.sampling, self.vocab)
        return int(accepted), int(nxt)


_accept = jax.jit(accept_pass, static_argnums=(5, 6))


_accept = jax.jit(accept_pass, static_argnums=(5, 6))


class HostOracle:
    """The target's own greedy continuation of the context, by `engine.generate_ids` at every pass."""

    def __init__(self, graphdef, params, vocab: int):
        self.graphdef, self.params, self.vocab = graphdef, params, vocab

    def propose(self, context, block, key) -> Proposal:
        prompt = {"ids": np.asarray(context, np.int32), "positions": np.arange(len(context), dtype=np.int32)}
        out = generate_ids(self.params, self.graphdef, [prompt], max_new_tokens=block, stop_ids=(), vocab=self.vocab)
        return Proposal(np.asarray(out[0], np.int32))


class HostRandom:
    """Uniform random tokens in [0, vocab) from numpy's stream of `seed`, q uniform."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def propose(self, context, block, key) -> Proposal:
        return Proposal(self.rng.integers(0, self.vocab, block).astype(np.int32),
                        np.full((block, self.vocab), 1.0 / self.vocab, np.float32))


class HostTrainedDrafter(CachedDrafter):
    """A trained (or random) block drafter for the host loop: the target's fused features recomputed over
    the whole context at every proposal by `draft_hidden`, training's own forward (text-only contexts,
    1-D positions), where the fast path reads them from its context cache: the two must propose alike."""

    def __init__(self, drafter_graphdef, drafter_params, target_graphdef, target_params, vocab: int):
        super().__init__(drafter_graphdef, drafter_params, vocab)
        self.host_params = (drafter_params, target_params)

        def run(params, tokens, length):
            drafter, target = nnx.merge(drafter_graphdef, params[0]), nnx.merge(target_graphdef, params[1])
            # Right-padded to a bucket (one compile per bucket, not per context length); padding is
            # segment 0, which no block sees.
            slots = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
            batch = {"tokens": tokens, "positions": slots, "segment_ids": (slots < length).astype(jnp.int32)}
            # The anchor is the last committed token; the drafter reads target features before it.
            hidden = block_drafter.draft_hidden(drafter, target, batch, jnp.reshape(length - 1, (1, 1)))
            logits = jnp.einsum("basd,dv->basv", hidden, target.head_matrix(), preferred_element_type=jnp.float32)
            return jnp.argmax(mask_vocab(logits[0, 0], vocab), axis=-1).astype(jnp.int32)

        self._run = jax.jit(run)

    def propose(self, context, block, key) -> Proposal:
        # Greedy drafting: deterministic given the context, so under sampling q is the point mass on it.
        padded = np.zeros(bucket(len(context)), np.int32)
        padded[:len(context)] = context
        tokens = self._run(self.host_params, jnp.asarray(padded)[None], jnp.int32(len(context)))
        return Proposal(np.asarray(tokens)[:min(block, self.block_size)])
