"""Issue 30: whole answers in one on-device loop (`decoding.loop`), rows batched.

- batched greedy speculative output equals each row decoded alone and the engine, with rows of
  different prompt lengths, budgets, and blocks at different positions (a dense span's blocks at output
  0, 5 and 10 beside a block of 12 at 0, a plain row, and a call the host must read);
- an oracle drafter commits each row's block in one pass: tau = B + 1 per row in a batch;
- rejection sampling per row in a batch: 1,200 rows of two prompts, each row its own random stream,
  the first two tokens of each prompt's block match the target's p(a) p(b | a) (chi-square);
- with no announcement the loop is the engine token for token (greedy and sampled: the same keys);
- the device automaton finds the spans `AtomicCalls.announced_spans` finds, on token streams with calls
  mid-answer, inside blocks, at a block's last token, and outside the device's spelling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data_pipeline.primitives import AtomicCalls
from tests.test_speculative import (
    NEW,
    announced_prompt,
    block_drafter,
    chi_square_ok,
    image_prompt,
    model,
    target_only,
)
from valen_jax.decoding import Sampling, announcements, generate_ids, loop
from valen_jax.decoding.speculative import CachedDrafter, OracleDrafter, SpeculativeDecoder
from valen_jax.decoding.verification import target_probs

pytest_plugins = ["tests.test_speculative"]  # its tokenizer, target and vl_target fixtures


def spaced_prompt(tokenizer, block_size: int) -> np.ndarray:
    """A call in JSON with spaces: valid for `parse_announcement`, outside the device's spelling."""
    body = '{"name": "atomic_decoding", "arguments": {"block_size": ' + str(block_size) + "}}"
    text = "pick the cup<tool_call>" + body + "</tool_call>"
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)


@pytest.mark.heavy  # each row alone compiles its own shapes: about a minute here
def test_batched_greedy_equals_each_row_alone_and_the_engine(tokenizer, target):
    graphdef, params, vocab = target
    plain = np.asarray(tokenizer.encode("move the red cup left and open the gripper now", add_special_tokens=False),
                       np.int32)
    prompts = [announced_prompt(tokenizer, 12, seed=50), announced_prompt(tokenizer, 5, seed=51, count=3),
               plain, spaced_prompt(tokenizer, 9)]
    budgets = [NEW, 24, NEW, 17]
    references = [target_only(graphdef, params, vocab, p, new=b) for p, b in zip(prompts, budgets, strict=True)]
    calls = AtomicCalls(tokenizer)
    calls.dense_id = references[1][0]  # a random target writes no <dense>: row 1's first token stands in
    cfg = nnx.merge(graphdef, params).cfg
    drafter = CachedDrafter(*block_drafter(cfg, seed=8), vocab)
    batched = SpeculativeDecoder(graphdef, params, calls=calls, vocab=vocab)
    outs = batched.generate_batch(prompts, drafter, max_new_tokens=budgets)
    assert outs == references
    # The engine batched equals the engine row by row (and so each row of the speculative batch).
    engine = generate_ids(params, graphdef, [{"ids": p, "positions": np.arange(len(p), dtype=np.int32)}
                                             for p in prompts], max_new_tokens=NEW, stop_ids=(), vocab=vocab)
    assert [e[:b] for e, b in zip(engine, budgets, strict=True)] == references
    for row, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        alone = SpeculativeDecoder(graphdef, params, calls=calls, vocab=vocab)
        assert alone.generate(prompt, drafter, max_new_tokens=budget) == references[row]
        mine, theirs = alone.stats, batched.row_stats[row]
        assert (mine.passes, mine.committed, mine.histogram, mine.drafted_at, mine.accepted_at, mine.stopped,
                mine.undrafted) == (theirs.passes, theirs.committed, theirs.histogram, theirs.drafted_at,
                                    theirs.accepted_at, theirs.stopped, theirs.undrafted), row
    # Blocks really ran where announced: three dense blocks of 5 (15 tokens), the block of 12, the call
    # the host read (9), drafted or, once this untrained drafter missed twice in a row, by plain steps; the
    # plain row drafted nothing.
    inside = [s.committed + s.undrafted for s in batched.row_stats]
    assert inside[0] >= 12 and inside[1] >= 15 and inside[3] >= 9
    assert batched.row_stats[2].passes == 0 and inside[2] == 0
    assert batched.stats.stopped >= 1  # the drafter gave up in some span while other rows drafted on
    assert max(batched.stats.drafted_at) == 8 and batched.timing.host_reads == 1 and batched.timing.launches == 2


@pytest.mark.slow
def test_an_oracle_drafter_gives_tau_b_plus_one_per_row_in_a_batch(tokenizer, target):
    graphdef, params, vocab = target
    sizes = [12, 18, 7]
    prompts = [announced_prompt(tokenizer, size, seed=60 + size) for size in sizes]
    prompts[1] = np.concatenate([prompts[0][:9], prompts[1]])  # rows of different prompt lengths
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    outs = decoder.generate_batch(prompts, OracleDrafter(graphdef, params, vocab), max_new_tokens=NEW)
    assert outs == [target_only(graphdef, params, vocab, p) for p in prompts]
    for size, stats in zip(sizes, decoder.row_stats, strict=True):
        assert (stats.passes, stats.tau, stats.histogram) == (1, size + 1, {size: 1})
    assert decoder.stats.tau == (sum(sizes) + 3) / 3


@pytest.mark.heavy
def test_rejection_sampling_per_row_in_a_batch_emits_the_target_distribution(tokenizer, target):
    """Each row's first two block tokens, drafted by the oracle (the greedy pair, a point-mass q: accepted
    with probability p(x), else the residual is drawn), follow p(a) p(b | a) under temperature 1 with
    top-k 4: two prompts of different lengths, 600 rows each, in ONE batch."""
    graphdef, params, vocab = target
    params = jax.tree.map(lambda p: p / 3 if p.ndim >= 2 else p, params)  # flatter: several likely tokens
    sampling = Sampling(temperature=1.0, top_k=4)
    prompts = [announced_prompt(tokenizer, 12, seed=70), announced_prompt(tokenizer, 5, seed=71)[3:]]
    rows = 600
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, sampling=sampling)
    outs = decoder.generate_batch([p for p in prompts for _ in range(rows)],
                                  OracleDrafter(graphdef, params, vocab, block_size=3), max_new_tokens=2, seed=5)
    assert decoder.stats.passes >= 2 * rows and 0 < decoder.stats.accepted_at[1] < decoder.stats.passes
    net = nnx.merge(graphdef, params)

    def probs(ids):
        ids = jnp.asarray(ids, jnp.int32)[None]
        logits = net(ids, jnp.arange(ids.shape[1])[None], jnp.ones_like(ids))[0, -1]
        return np.asarray(target_probs(logits, sampling, vocab), np.float64)

    for group, prompt in enumerate(prompts):
        pairs = np.asarray(outs[group * rows:(group + 1) * rows])
        first = probs(prompt)
        support = np.flatnonzero(first)
        joint = {(a, b): first[a] * q for a in support for b, q in enumerate(probs([*prompt, a])) if q > 0}
        cells = sorted(joint)
        index = {cell: i for i, cell in enumerate(cells)}
        counts = np.bincount([index[tuple(p)] for p in pairs.tolist()], minlength=len(cells))
        expected = np.asarray([joint[c] for c in cells])
        statistic, threshold = chi_square_ok(counts, expected)
        assert statistic < threshold, (group, statistic, threshold)
        # The test can fail: the drafter's own proposal (the greedy pair) alone is far from p.
        greedy = np.zeros(len(cells))
        greedy[int(np.argmax(expected))] = 1.0
        assert chi_square_ok(counts, 0.5 * greedy + 0.5 / len(cells))[0] > threshold


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)], ids=["greedy", "sampled"])
def test_without_an_announcement_the_loop_is_the_engine_token_for_token(tokenizer, target, sampling):
    graphdef, params, vocab = target
    prompts = [np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
               for text in ["open the gripper", "move the red cup to the left of the tray please"]]
    cfg = nnx.merge(graphdef, params).cfg
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, sampling=sampling)
    outs = decoder.generate_batch(prompts, CachedDrafter(*block_drafter(cfg, seed=9), vocab), max_new_tokens=NEW,
                                  seed=3)
    engine = generate_ids(params, graphdef, [{"ids": p, "positions": np.arange(len(p), dtype=np.int32)}
                                             for p in prompts], max_new_tokens=NEW, stop_ids=(), vocab=vocab,
                          sampling=sampling, seed=3)
    assert outs == engine and decoder.stats.passes == 0
    assert len(set(outs[0])) > 3


def device_in_span(calls, found, prompt, output):
    """Per output token: inside a span, by the loop's own span logic (`loop._advance_span`) and the
    automaton; a held call is answered by `AtomicCalls.announced`, as `SpeculativeDecoder` does. Also
    the output indices after which a row was held."""
    zeros = jnp.zeros(1, jnp.int32)
    state = loop.Spans(zeros, jnp.zeros((1, 2), jnp.int32), zeros, zeros, zeros, jnp.zeros(1, bool), zeros)

    def opened(state, found_call):
        size = jnp.asarray([found_call[0]], jnp.int32)
        return state._replace(left=size, size=size, count=jnp.asarray([found_call[1]], jnp.int32),
                              fresh=jnp.ones(1, bool))

    automaton, registers = state.automaton, state.registers
    for token in prompt:
        automaton, registers, event = announcements.advance(found, automaton, registers, jnp.asarray([token]))
    state = state._replace(automaton=automaton, registers=registers)
    if int(event[0]) == announcements.ANNOUNCE:
        state = opened(state, np.asarray(registers[0]))
    advance = jax.jit(loop._advance_span)
    inside, held = [], []
    for t, token in enumerate(output):
        inside.append(int(state.left[0]) > 0)
        state, hold = advance(state, jnp.asarray([token], jnp.int32), found)
        if bool(hold[0]):
            held.append(t)
            a = calls.announced([*prompt, *output[:t + 1]])
            if a is not None:
                state = opened(state, (a.block_size, a.count or 0))
    return inside, held


def test_the_device_automaton_opens_the_spans_announced_spans_finds(tokenizer, target):
    graphdef, params, vocab = target
    calls = AtomicCalls(tokenizer)
    found = announcements.tables(calls, nnx.merge(graphdef, params).cfg.vocab_size)

    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False)

    def call(size, count=None, spaced=False):
        args = f'"block_size":{size}' + (f',"count":{count}' if count else "")
        text = f'{{"name":"atomic_decoding","arguments":{{{args}}}}}'
        return ids("<tool_call>" + (text.replace(":", ": ").replace(",", ", ") if spaced else text) + "</tool_call>")

    words, dense = ids(" move the cup"), ids("<dense>")
    block = ids("".join(f"<{k}>" for k in range(12)))
    inner = call(3)
    output = [*words, *call(4), *block[:4], *words,
              *call(3, 2), *dense, *block[:5],  # dense: two blocks of 3
              *call(12), *call(12)[:12],  # a call inside a block announces nothing
              # a block that is exactly a call: completed by the block's last token, it announces
              *call(len(inner)), *inner, *block[:3], *words,
              *call(6, spaced=True), *block[:6], *words,  # outside the device's spelling: the host reads it
              *ids('<tool_call>{"name":"search"}</tool_call>'), *words,  # another tool: the host says none
              *call(1234), *block[:5]]  # a span past the end of the output
    inside, held = device_in_span(calls, found, words, output)
    want = [False] * len(output)
    for start, stop, _ in calls.announced_spans(words, output):
        want[start:stop] = [True] * (min(stop, len(output)) - start)
    assert inside == want
    assert len(calls.announced_spans(words, output)) == 7 and len(held) == 2


@pytest.mark.heavy
def test_the_one_loop_engine_equals_the_engine_before_it_bit_for_bit(tokenizer, vl_target):
    """The drafter-off loop (`engine.generate_ids` now) against the frozen engine of before issue 30."""
    from tests import engine_before_loop as before

    vocab = len(tokenizer)
    rng = np.random.default_rng(0)
    prompts = [{"ids": rng.integers(0, vocab, n).astype(np.int32), "positions": np.arange(n, dtype=np.int32)}
               for n in (5, 17, 40)]
    stop = int(prompts[1]["ids"][3])
    for scan in (False, True):
        graphdef, params = model(-(-vocab // 64) * 64, scan=scan)
        for sampling in (Sampling(), Sampling(temperature=1.0, top_k=20)):
            now = generate_ids(params, graphdef, prompts, max_new_tokens=40, stop_ids=(stop,), vocab=vocab,
                               sampling=sampling, seed=7)
            assert now == before.generate_ids(params, graphdef, prompts, max_new_tokens=40, stop_ids=(stop,),
                                              vocab=vocab, sampling=sampling, seed=7), (scan, sampling)
            assert len({len(o) for o in now}) > 1 or len(set(now[0])) > 3
    graphdef, params, vocab, cfg = vl_target
    images = [image_prompt(tokenizer, cfg, 8, seed=s) for s in (1, 2)]
    for sampling in (Sampling(), Sampling(temperature=1.0)):
        assert generate_ids(params, graphdef, images, max_new_tokens=30, stop_ids=(), vocab=vocab,
                            sampling=sampling) == before.generate_ids(params, graphdef, images, max_new_tokens=30,
                                                                      stop_ids=(), vocab=vocab, sampling=sampling)
