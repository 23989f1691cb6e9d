"""The decode program of `decoding.engine` as it was before issue 30 (commit 03a4193), frozen as a test
oracle: prefill → first token → a `while_loop` of decode steps, which the one decode loop
(`decoding.loop.engine_program`, the loop with no drafter) replaced. `generate_ids` runs today's host
side of the engine (its checks, buckets and batches, unchanged since: `batch_arrays` and `_run` are the
same code) with this program in place of the loop, so `tests/test_speculative_batch.py` compares the two
programs alone, bit for bit (text, scanned and unscanned; M-RoPE with an image; greedy and sampled).
Not library code: nothing imports it but that test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from valen_jax.decoding import engine
from valen_jax.decoding.sampling import Sampling, sample
from valen_jax.models.sharding import constrain


@functools.cache
def _generate_fn(graphdef, sampling: Sampling, vocab: int, cache_length: int, out_length: int, group: int = 1):
    if group != 1:  # the group prefill (a reinforcement rollout's) came later; the test compares group_size=1
        raise ValueError(f"the engine before issue 30 prefilled every row: group={group}")

    def run(params, tokens, positions, lengths, next_position, active, vision, stop_ids, seed, rows, max_new):
        model = nnx.merge(graphdef, params)
        logits, cache = model.prefill(tokens, positions, lengths, cache_length, vision)
        row_keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), rows)

        def choose(logits, step):
            return sample(logits, jax.vmap(jax.random.fold_in, (0, None))(row_keys, step), sampling, vocab)

        def finished(token, count):
            return jnp.isin(token, stop_ids) | (count >= max_new)

        first = choose(logits, 0)
        batch = tokens.shape[0]
        out = jnp.zeros((batch, out_length), jnp.int32).at[:, 0].set(first)
        count = jnp.ones(batch, jnp.int32)
        done = ~active | finished(first, count)
        # The state: the last token (not yet in the cache) sits at slot `cursor` with `position`.
        state = (jnp.int32(1), cache, first, lengths, next_position, done, out, count)

        def cond(state):
            step, *_, done, _, _ = state
            return (step < max_new) & ~jnp.all(done)

        def body(state):
            step, cache, last, cursor, position, done, out, count = state
            logits, cache = model.decode_step(last, position, cache, cursor)
            token = jnp.where(done, last, choose(logits, step))
            out = jax.lax.dynamic_update_slice(out, jnp.where(done, 0, token)[:, None], (0, step))
            live = (~done).astype(jnp.int32)
            count = count + live
            return (step + 1, cache, token, cursor + live, position + live, done | finished(token, count),
                    out, count)

        *_, out, count = jax.lax.while_loop(cond, body, state)
        # Batch-sharded like the inputs, so each process reads back exactly its own rows.
        return constrain(out, ("batch", None)), constrain(count, ("batch",))

    return jax.jit(run)


def generate_ids(params, graphdef, prompts, **options) -> list[list[int]]:
    """`engine.generate_ids` with the program before issue 30 in place of `loop.engine_program`."""
    program, engine.engine_program = engine.engine_program, _generate_fn
    try:
        return engine.generate_ids(params, graphdef, prompts, **options)
    finally:
        engine.engine_program = program
