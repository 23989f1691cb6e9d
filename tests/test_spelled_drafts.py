"""Drafting outside blocks (issue 30): the `atomic_decoding` call's fixed text, which the compact spelling
forces, is drafted and verified in one pass (`announcements.spelled_drafts`, `loop.Passes.verify`), and
the output stays the target's own, greedy token for token and sampled in distribution.

A random target never writes a call, so the target here is a tiny decoder trained (Adam, on this CPU, in
seconds) to memorise one answer: an action, then the call, then its block, then the end of turn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from data_pipeline.primitives import AtomicCalls
from data_pipeline.tokenizer import end_of_turn_id
from tests.test_speculative import model
from tests.test_speculative_batch import chi_square_ok
from valen_jax.decoding import Sampling, announcements, generate_ids
from valen_jax.decoding.speculative import RandomDrafter, SpeculativeDecoder, target_probs

pytest_plugins = ["tests.test_speculative"]  # its tokenizer fixture

PROMPT = "move the red cup left<action>Pull.</action>"
CALL = '<tool_call>{"name":"atomic_decoding","arguments":{"block_size":6,"count":2}}</tool_call>'
BLOCK = "<robot_single_2d><120><340><560><780></robot>"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def writer(tokenizer):
    """(graphdef, params, vocab, prompt ids, answer ids): a target whose greedy answer to the prompt is
    CALL + BLOCK + end of turn, learnt by heart."""
    vocab = len(tokenizer)
    graphdef, params = model(-(-vocab // 64) * 64, scan=False, scale=1.0, seed=3)
    prompt = encode(tokenizer, PROMPT)
    answer = encode(tokenizer, CALL + BLOCK) + [end_of_turn_id(tokenizer)]
    ids = jnp.asarray([prompt + answer], jnp.int32)
    positions, segments = jnp.arange(ids.shape[1])[None], jnp.ones_like(ids)
    optimizer = optax.adam(1e-2)

    def loss(p):
        logits = nnx.merge(graphdef, p)(ids[:, :-1], positions[:, :-1], segments[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits[0, len(prompt) - 1:],
                                                               ids[0, len(prompt):]).mean()

    @jax.jit
    def update(p, state):
        grads = jax.grad(loss)(p)
        changes, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, changes), state

    state = optimizer.init(params)
    for _ in range(150):
        params, state = update(params, state)
    return graphdef, params, vocab, np.asarray(prompt, np.int32), answer


def test_the_spelling_drafts_its_fixed_text_up_to_each_number(tokenizer):
    calls = AtomicCalls(tokenizer)
    tables = announcements.tables(calls, len(tokenizer))
    spelled, length = np.asarray(tables.spelled), np.asarray(tables.spelled_length)

    def draft_after(text):
        state, _, _ = announcements.initial(tables, encode(tokenizer, text))
        return tokenizer.decode(spelled[int(state), :length[int(state)]].tolist())

    assert draft_after("<tool_call>") == '{"name":"atomic_decoding","arguments":{"block_size":'
    assert draft_after('<tool_call>{"name":"atomic') == '_decoding","arguments":{"block_size":'
    assert draft_after('<tool_call>{"name":"atomic_decoding","arguments":{"block_size":18,"') == 'count":'
    # Inside a number the draft guesses it ends there: block_size's is followed by `,"count":`, count's by `}}`
    # (never `</tool_call>`: the bonus after it stays the target's, a block's first token the drafter's).
    assert draft_after('<tool_call>{"name":"atomic_decoding","arguments":{"block_size":18') == ',"count":'
    assert draft_after('<tool_call>{"name":"atomic_decoding","arguments":{"block_size":18,"count":2') == '}}'
    # After the whole spelling, outside a call, or inside another tool's, nothing is drafted.
    for text in ["<action>Pull.</action>", '<tool_call>{"name":"other_tool"',
                 '<tool_call>{"name":"atomic_decoding","arguments":{"block_size":18,"count":2}}']:
        assert draft_after(text) == "", text
    # The automaton, fed a draft from its own state, lands where the spelling wants a number next.
    state, registers, _ = announcements.initial(tables, encode(tokenizer, "<tool_call>"))
    moved, _, _ = announcements.initial(tables, encode(tokenizer, "<tool_call>") +
                                        spelled[int(state), :length[int(state)]].tolist() +
                                        encode(tokenizer, "18}}</tool_call>"))
    assert int(announcements.initial(tables, encode(tokenizer, "<tool_call>" + draft_after("<tool_call>") +
                                                    "18}}</tool_call>"))[2]) == announcements.ANNOUNCE
    assert int(moved) == int(announcements.initial(tables, encode(tokenizer, "</tool_call>"))[0])


@pytest.mark.slow  # trains its target in the module fixture (~2 min under load)
def test_a_target_that_writes_the_call_verifies_its_fixed_text_in_two_passes(tokenizer, writer):
    graphdef, params, vocab, prompt, answer = writer
    eot = end_of_turn_id(tokenizer)
    rows = [{"ids": prompt, "positions": np.arange(len(prompt), dtype=np.int32)}]
    engine = generate_ids(params, graphdef, rows, max_new_tokens=40, stop_ids=(eot,), vocab=vocab)[0]
    assert engine == answer  # the target learnt the answer by heart (else nothing below is tested)
    # Beside it in the batch, a row that writes no call (its prompt cut short): its own engine output.
    other = {"ids": prompt[:-3], "positions": np.arange(len(prompt) - 3, dtype=np.int32)}
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, stop_ids=(eot,),
                                 patience=0)  # the random drafter drafts the whole block (see below)
    out = decoder.generate_batch([*rows, other], RandomDrafter(vocab), max_new_tokens=40)
    assert out == [engine, generate_ids(params, graphdef, [other], max_new_tokens=40, stop_ids=(eot,), vocab=vocab)[0]]
    # After <tool_call> (the prefill's token): the 13 tokens up to block_size's number, accepted, + the number
    # (the bonus); after it `,"count":` + the count; after that `}}` + </tool_call>: three passes for the call.
    first = decoder.row_stats[0]
    assert (first.spelling_passes, first.spelling_committed) == (3, 13 + 1 + 3 + 1 + 1 + 1)
    # The block after the call is still the drafter's: a random one, so one pass per block token.
    assert first.passes == 6 and first.committed == 6


@pytest.mark.slow  # trains its target in the module fixture (~2 min under load)
def test_spelled_drafts_are_rejection_sampled_to_the_target_distribution(tokenizer, writer):
    """The prompt ends with <tool_call>, so each row's first pass verifies the spelled `{"`, `name` ...
    (a point-mass q: accepted with probability p(x), else the residual is drawn): 800 rows' first two
    tokens follow p(a) p(b | a) at temperature 2, top-k 3."""
    graphdef, params, vocab, prompt, _ = writer
    prompt = np.concatenate([prompt, encode(tokenizer, "<tool_call>")]).astype(np.int32)
    sampling = Sampling(temperature=2.0, top_k=3)
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, sampling=sampling)
    rows = 800
    pairs = np.asarray(decoder.generate_batch([prompt] * rows, RandomDrafter(vocab), max_new_tokens=2, seed=9))
    assert 0 < decoder.stats.spelling_committed - rows < rows  # some first drafts accepted, some rejected
    net = nnx.merge(graphdef, params)

    def probs(ids):
        ids = jnp.asarray(ids, jnp.int32)[None]
        logits = net(ids, jnp.arange(ids.shape[1])[None], jnp.ones_like(ids))[0, -1]
        return np.asarray(target_probs(logits, sampling, vocab), np.float64)

    first = probs(prompt)
    joint = {(a, b): first[a] * q for a in np.flatnonzero(first) for b, q in enumerate(probs([*prompt, a])) if q > 0}
    cells = sorted(joint)
    index = {cell: i for i, cell in enumerate(cells)}
    counts = np.bincount([index[tuple(p)] for p in pairs.tolist()], minlength=len(cells))
    expected = np.asarray([joint[c] for c in cells])
    statistic, threshold = chi_square_ok(counts, expected)
    assert statistic < threshold, (statistic, threshold)
    # The test can fail: always accepting the spelled pair is far from p.
    spelled = np.zeros(len(cells))
    spelled[int(np.argmax(expected))] = 1.0
    assert chi_square_ok(counts, spelled * 0.98 + 0.02 / len(cells))[0] > threshold
