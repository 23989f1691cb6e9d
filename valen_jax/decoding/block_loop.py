"""The fast path of speculative decoding: a whole announced block as ONE compiled program.

`FastRow` decodes one row (one prompt) with a device drafter (`draft_rules`). Its state lives on the
device: the target's KV cache, the drafter's state (the trained drafter's context cache), the last
committed token (not yet in the caches), its slot `cursor` and 1-D `position`, and the pass counter
that indexes the random stream. Three compiled programs, each cached per model and shape:

- prefill: the prompt minus its last token (vision inputs and M-RoPE positions included), the drafter
  state built from the same pass's hidden states (`Transformer.prefill(collect=)`): image tokens'
  features come from here;
- step: one target token outside blocks (`decode_step`, features absorbed into the drafter state);
  the host reads the token back, since announcements are found on the host;
- block: `lax.while_loop` over passes until the block's tokens are committed, the budget is spent or a
  stop token is committed: draft (the drafter against its cache) → verify (`extend` over W = B + 1
  slots: the last token and B drafted ones) → accept (`verification.accept_pass`) → both caches
  absorb the W slots and the cursors advance by the accepted + 1 (the rejected tail lies above the
  committed length, masked and overwritten later) → the committed tokens go to an output buffer. The
  per-pass (drafted, accepted, committed) counts come back as arrays for `BlockStats`.

On an accelerator: every shape in the loop is static (W, the caches, the output buffer), the loop
condition is computed on the device, and nothing crosses to the host between passes; the host waits
once per block (and once per token outside blocks). The caches are while-loop carries written by
iota scatters (`kv_cache.write_block`), which XLA updates in place; the state is donated to each
program, so a block or step does not copy the caches either. One row per call (the row axis is kept
in every shape: batching rows is a matter of the host bookkeeping, not of the programs).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from valen_jax.decoding.engine import bucket
from valen_jax.decoding.sampling import Sampling, sample
from valen_jax.decoding.verification import accept_pass
from valen_jax.models import kv_cache
from valen_jax.models.drafter import text_positions


class RowState(NamedTuple):
    cache: kv_cache.KVCache
    draft: object  # the drafter rule's state (a context cache, or ())
    last: jax.Array  # int32 [1]: the last committed token, not yet in the caches
    cursor: jax.Array  # int32 [1]: its slot
    position: jax.Array  # int32 [1]: its 1-D (text) position
    passes: jax.Array  # int32 []: target passes so far (the random stream's counter)


@dataclass
class Timing:
    """Host wall time of the fast path (each program's result is read back, so it is the device's time too)."""

    block_seconds: float = 0.0
    block_tokens: int = 0
    step_seconds: float = 0.0
    steps: int = 0
    step_times: list[tuple[int, float]] = field(default_factory=list)  # (output index, seconds) per step


@functools.cache
def _prefill_program(graphdef, rule, cache_length: int):
    def run(params, draft_params, tokens, positions, lengths, vision):
        model = nnx.merge(graphdef, params)
        if not rule.collect:
            _, cache = model.prefill(tokens, positions, lengths, cache_length, vision)
            return cache, rule.init(draft_params, None, None, cache_length)
        _, cache, features = model.prefill(tokens, positions, lengths, cache_length, vision, collect=rule.collect)
        return cache, rule.init(draft_params, features, text_positions(positions), cache_length)

    return jax.jit(run)


def _target_pass(model, rule, draft_params, state: RowState, tokens, positions, method: str):
    """The target over T tokens per row at the cursor (decode_step or extend), the drafter absorbing them."""
    out = getattr(model, method)(tokens, positions, state.cache, state.cursor, collect=rule.collect)
    if not rule.collect:
        return out[0], out[1], state.draft
    logits, cache, features = out
    return logits, cache, rule.absorb(draft_params, state.draft, features, positions.reshape(features.shape[:2]),
                                      state.cursor)


@functools.cache
def _step_program(graphdef, rule, sampling: Sampling, vocab: int):
    def run(params, draft_params, state: RowState, key):
        model = nnx.merge(graphdef, params)
        logits, cache, draft = _target_pass(model, rule, draft_params, state, state.last, state.position,
                                            "decode_step")
        token = sample(logits, jax.random.fold_in(key, state.passes)[None], sampling, vocab)
        return RowState(cache, draft, token, state.cursor + 1, state.position + 1, state.passes + 1)

    return jax.jit(run, donate_argnums=(2,))


@functools.cache
def _block_program(graphdef, rule, sampling: Sampling, vocab: int, width: int, out_length: int):
    """width: the draft slots per pass (W - 1); out_length: the output buffer (>= block size + W)."""
    slots = jnp.arange(width + 1)

    def run(params, draft_params, state: RowState, size, budget, produced, stop_ids, key):
        model = nnx.merge(graphdef, params)

        def cond(carry):
            _, remaining, count, stopped, *_ = carry
            return (remaining > 0) & (count < budget) & ~stopped

        def body(carry):
            state, remaining, count, stopped, out, record, n = carry
            drafted = jnp.minimum(jnp.minimum(remaining, budget - count), width)
            pass_key = jax.random.fold_in(key, state.passes)
            draft, q = rule.draft(draft_params, state.draft, model, state.last, state.position, state.cursor,
                                  produced + count, jax.random.fold_in(pass_key, 1), width)
            tokens = jnp.concatenate([state.last[:, None], draft], axis=1)  # [1, W]
            positions = state.position[:, None] + slots
            logits, cache, draft_state = _target_pass(model, rule, draft_params, state, tokens, positions, "extend")
            accepted, nxt = accept_pass(logits[0], draft[0], None if q is None else q[0],
                                        jax.random.fold_in(pass_key, 2), drafted, sampling, vocab)
            new = jnp.where(slots < accepted, jnp.append(draft[0], 0), nxt)  # slots > accepted: unused
            allowed = jnp.minimum(accepted + 1, budget - count)
            stop = jnp.isin(new, stop_ids) & (slots < allowed)
            committed = jnp.where(jnp.any(stop), jnp.argmax(stop) + 1, allowed).astype(jnp.int32)
            out = jax.lax.dynamic_update_slice(out, new, (count,))
            record = record.at[:, n].set(jnp.stack([drafted, accepted, committed]))
            state = RowState(cache, draft_state, nxt[None], state.cursor + accepted + 1,
                             state.position + accepted + 1, state.passes + 1)
            return state, remaining - accepted - 1, count + committed, jnp.any(stop), out, record, n + 1

        carry = (state, size, jnp.int32(0), jnp.bool_(False), jnp.zeros(out_length, jnp.int32),
                 jnp.zeros((3, out_length), jnp.int32), jnp.int32(0))
        state, remaining, count, _, out, record, n = jax.lax.while_loop(cond, body, carry)
        return state, out, count, record, n, remaining

    return jax.jit(run, donate_argnums=(2,))


class FastRow:
    """One prompt decoded with a device drafter: `step` outside blocks, `block` for an announced block."""

    def __init__(self, graphdef, params, drafter, *, sampling: Sampling, vocab: int, stop_ids, ids, positions,
                 vision, max_new_tokens: int, timing: Timing):
        self.graphdef, self.params, self.sampling, self.vocab = graphdef, params, sampling, vocab
        self.rule, self.draft_params = drafter.rule, drafter.params
        self.stops = jnp.asarray(sorted(stop_ids) or [-1], jnp.int32)
        self.ids, self.prompt, self.timing = list(ids), len(ids), timing
        n = len(ids)
        # Drafted slots past the cache end are dropped by the scatter and never committed (they lie past
        # the budget), so the cache need not hold a whole window past the last token.
        cache_length = bucket(n + max_new_tokens + 1)
        prompt_length = bucket(n - 1)
        tokens = np.zeros((1, prompt_length), np.int32)
        tokens[0, :n - 1] = ids[:-1]
        padded = np.zeros((1, prompt_length, *positions.shape[1:]), np.int32)
        padded[0, :n - 1] = positions[:-1]
        batched = None if vision is None else tuple(jnp.asarray(vision[k])[None] for k in
                                                    ("patches", "patch_positions", "patch_segments"))
        cache, draft = _prefill_program(graphdef, self.rule, cache_length)(
            params, self.draft_params, jnp.asarray(tokens), jnp.asarray(padded), jnp.asarray([n - 1], jnp.int32),
            batched)
        last_position = int(np.asarray(positions[-1]).reshape(-1)[0])
        self.state = RowState(cache, draft, jnp.asarray([ids[-1]], jnp.int32), jnp.asarray([n - 1], jnp.int32),
                              jnp.asarray([last_position], jnp.int32), jnp.int32(0))

    @property
    def output(self) -> list[int]:
        return self.ids[self.prompt:]

    def step(self, key) -> None:
        started = time.perf_counter()
        self.state = _step_program(self.graphdef, self.rule, self.sampling, self.vocab)(
            self.params, self.draft_params, self.state, key)
        self.ids.append(int(self.state.last[0]))
        seconds = time.perf_counter() - started
        self.timing.step_seconds += seconds
        self.timing.steps += 1
        self.timing.step_times.append((len(self.output) - 1, seconds))

    def block(self, size: int, key, max_new_tokens: int, stats) -> int:
        """Commit the block's next `size` tokens (fewer at a stop or the budget) in one program; record
        each pass in `stats`. Returns how many tokens the last bonus put past the block (0 or 1)."""
        started = time.perf_counter()
        width = self.rule.block_size or max(8, 1 << (size - 1).bit_length())  # a few compiles, not one per size
        width = min(width, size) if self.rule.block_size else width
        program = _block_program(self.graphdef, self.rule, self.sampling, self.vocab, width,
                                 bucket(size + width + 1))
        self.state, out, count, record, n, remaining = program(
            self.params, self.draft_params, self.state, jnp.int32(size), jnp.int32(max_new_tokens - len(self.output)),
            jnp.int32(len(self.output)), self.stops, key)
        count, n, remaining = int(count), int(n), int(remaining)
        self.ids.extend(np.asarray(out[:count]).tolist())
        for drafted, accepted, committed in np.asarray(record[:, :n]).T.tolist():
            stats.record(drafted, accepted, committed)
        self.timing.block_seconds += time.perf_counter() - started
        self.timing.block_tokens += count
        return max(-remaining, 0)
