"""Speculative atomic decoding (issue 16) is lossless: greedy output equals target-only greedy
(`engine.generate_ids`) whatever the drafter proposes, an oracle drafter commits a whole block in one
pass (tau = B + 1, the bonus token included), and rejection sampling emits the target's distribution.

Targets are tiny random decoders. A random target never writes an `atomic_decoding` call by itself, so
the prompts end right after one, written with the smoke tokenizer (primitive tags are single tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as scipy_stats

from data_pipeline.primitives import AtomicCalls
from data_pipeline.tokenizer import load_tokenizer
from tests.speculative_host import HostDecoder, HostOracle, HostTrainedDrafter, Proposal
from tests.train_runs import ROOT
from valen_jax.decoding import Sampling, announcements, generate_ids, loop
from valen_jax.decoding.loop import PATIENCE
from valen_jax.decoding.sampling import RowSampling, SamplingKind, sampling_rows
from valen_jax.decoding.speculative import (
    CachedDrafter,
    OracleDrafter,
    RandomDrafter,
    ScriptedDrafter,
    SpeculativeDecoder,
    accept_pass,
    target_probs,
    verify_sampled,
)
from valen_jax.decoding.verification import first_argmax
from valen_jax.models import mrope
from valen_jax.models.config import ModelConfig, VisionConfig
from valen_jax.models.drafter import Drafter, DrafterConfig, draft_hidden, text_positions
from valen_jax.models.transformer import Transformer

NEW = 30


def lively(params, scale: float):
    """Weights large enough that greedy continuations change from token to token (test_kv_cache)."""
    return jax.tree.map(lambda p: p * scale if p.ndim >= 2 else p, params)


def model(vocab: int, scan: bool, scale: float = 12.0, seed: int = 0):
    cfg = ModelConfig(vocab_size=vocab, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                      scan_layers=scan, attention="blockwise")
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(seed)))
    return graphdef, lively(params, scale)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / "data" / "tokenizer")


@pytest.fixture(scope="module")
def target(tokenizer):
    vocab = len(tokenizer)
    graphdef, params = model(-(-vocab // 64) * 64, scan=False)
    return graphdef, params, vocab


def announced_prompt(tokenizer, block_size: int, seed: int, count: int | None = None) -> np.ndarray:
    """Random words, an action and an atomic_decoding call: the block starts right after the prompt."""
    rng = np.random.default_rng(seed)
    args = f'"block_size":{block_size}' + (f',"count":{count}' if count else "")
    text = (" ".join(rng.choice(["move", "the", "red", "cup", "left", "gripper", "open"], 5)) +
            f'<action>Pull.</action><tool_call>{{"name":"atomic_decoding","arguments":{{{args}}}}}</tool_call>')
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)


def target_only(graphdef, params, vocab, prompt, new=NEW):
    return generate_ids(params, graphdef, [{"ids": prompt, "positions": np.arange(len(prompt), dtype=np.int32)}],
                        max_new_tokens=new, stop_ids=(), vocab=vocab)[0]


class CorruptedOracle:
    """The target's greedy block with draft position `wrong` (0-based) replaced: every pass accepts
    exactly `wrong` tokens, then the bonus (the target's own token there) repairs it. A host drafter."""

    def __init__(self, oracle: HostOracle, wrong: int, vocab: int):
        self.oracle, self.wrong, self.vocab = oracle, wrong, vocab

    def propose(self, context, block, key):
        tokens = self.oracle.propose(context, block, key).tokens.copy()
        if block > self.wrong:
            tokens[self.wrong] = (tokens[self.wrong] + 1) % self.vocab
        return Proposal(tokens)


@pytest.mark.parametrize("block_size", [12, 18])
def test_oracle_drafter_commits_the_block_in_one_pass(tokenizer, target, block_size):
    graphdef, params, vocab = target
    prompt = announced_prompt(tokenizer, block_size, seed=block_size)
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    out = decoder.generate(prompt, OracleDrafter(graphdef, params, vocab), max_new_tokens=NEW)
    reference = target_only(graphdef, params, vocab, prompt)
    assert len(set(reference)) > 3  # a target that says something
    assert out == reference
    # One verify pass: B accepted draft tokens + the target's bonus = B + 1 tokens committed.
    assert decoder.stats.passes == 1
    assert decoder.stats.tau == block_size + 1
    assert decoder.stats.histogram == {block_size: 1}
    assert decoder.stats.acceptance() == {k: 1.0 for k in range(1, block_size + 1)}


def test_dense_count_announces_count_blocks_that_meet_exactly(tokenizer, target):
    graphdef, params, vocab = target
    prompt = announced_prompt(tokenizer, 5, seed=8, count=2)
    reference = target_only(graphdef, params, vocab, prompt)
    calls = AtomicCalls(tokenizer)
    # A random target does not write <dense>: its own first block token stands in for the tag here.
    calls.dense_id = reference[0]
    decoder = SpeculativeDecoder(graphdef, params, calls=calls, vocab=vocab)
    assert decoder.generate(prompt, OracleDrafter(graphdef, params, vocab), max_new_tokens=NEW) == reference
    # Block 1: 5 accepted + the bonus (block 2's first token); block 2: its other 4 + the bonus.
    assert decoder.stats.passes == 2 and decoder.stats.committed == 11
    assert decoder.stats.histogram == {5: 1, 4: 1}


def test_a_partly_wrong_draft_is_cropped_and_drafted_again(tokenizer, target):
    graphdef, params, vocab = target
    prompt = announced_prompt(tokenizer, 12, seed=5)
    decoder = HostDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    drafter = CorruptedOracle(HostOracle(graphdef, params, vocab), wrong=3, vocab=vocab)
    assert decoder.generate(prompt, drafter, max_new_tokens=NEW) == target_only(graphdef, params, vocab, prompt)
    # Block of 12: three passes of 3 accepted + 1 bonus each (drafts of 12, 8 and 4 tokens).
    assert decoder.stats.passes == 3 and decoder.stats.committed == 12
    assert decoder.stats.histogram == {3: 3}
    assert decoder.stats.acceptance() == {1: 1.0, 2: 1.0, 3: 1.0, 4: 0.0, 5: 0.0, 6: 0.0, 7: 0.0, 8: 0.0,
                                          9: 0.0, 10: 0.0, 11: 0.0, 12: 0.0}


def wrong_script(reference, vocab):
    """A script of the target's greedy output with every token shifted: each pass accepts nothing."""
    return (np.asarray(reference, np.int32) + 1) % vocab


@pytest.mark.parametrize("patience", [PATIENCE, 1, 0])
def test_a_drafter_that_keeps_missing_stops_drafting_for_the_rest_of_its_span(tokenizer, target, patience):
    """After `patience` verify passes in a row that accept nothing, the rest of the block is plain steps:
    the output is still the target's, the passes are `patience` (not one per token), tau counts each plain
    step as a pass of one token; patience 0 drafts on (one pass per token). The host loop's rule agrees."""
    graphdef, params, vocab = target
    prompt = announced_prompt(tokenizer, 12, seed=5)
    reference = target_only(graphdef, params, vocab, prompt)
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, patience=patience)
    assert decoder.generate(prompt, ScriptedDrafter(wrong_script(reference, vocab)), max_new_tokens=NEW) == reference
    s = decoder.stats
    passes = patience or 12
    assert (s.passes, s.committed, s.histogram, s.stopped, s.undrafted) == (
        passes, passes, {0: passes}, int(patience > 0), 12 - passes)
    assert s.tau == 1.0
    host = HostDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, patience=patience)
    assert host.generate(prompt, CorruptedOracle(HostOracle(graphdef, params, vocab), wrong=0, vocab=vocab),
                         max_new_tokens=NEW) == reference
    h = host.stats
    assert (h.passes, h.committed, h.histogram, h.stopped, h.undrafted) == (
        s.passes, s.committed, s.histogram, s.stopped, s.undrafted)


def test_one_hit_between_misses_keeps_a_row_drafting(tokenizer, target):
    """Misses count in a row: a pass that accepts a draft token resets them. Block of 12, patience 2: pass 1
    misses (output 0), pass 2 accepts 1 (outputs 1-2), pass 3 misses (output 3), pass 4 accepts the other 8.
    Without the reset, pass 3 would be the second miss and the rest plain steps."""
    graphdef, params, vocab = target
    prompt = announced_prompt(tokenizer, 12, seed=5)
    reference = target_only(graphdef, params, vocab, prompt)
    script = np.asarray(reference, np.int32).copy()
    for wrong in (0, 2, 3):
        script[wrong] = (script[wrong] + 1) % vocab
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, patience=2)
    assert decoder.generate(prompt, ScriptedDrafter(script), max_new_tokens=NEW) == reference
    s = decoder.stats
    assert (s.passes, s.histogram, s.stopped, s.undrafted) == (4, {0: 2, 1: 1, 8: 1}, 0, 0)


def test_rows_of_a_batch_give_up_each_on_its_own(tokenizer, target):
    """In one batch a row whose drafter keeps missing decodes its span by plain steps inside the other
    rows' verify passes, while a row whose drafter is right still commits its block in one pass."""
    graphdef, params, vocab = target
    prompts = [announced_prompt(tokenizer, 12, seed=5), announced_prompt(tokenizer, 10, seed=6)]
    references = [target_only(graphdef, params, vocab, p) for p in prompts]
    scripts = np.stack([wrong_script(references[0], vocab), np.asarray(references[1], np.int32)])
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    assert decoder.generate_batch(prompts, ScriptedDrafter(scripts), max_new_tokens=NEW) == references
    bad, good = decoder.row_stats
    assert (bad.passes, bad.stopped, bad.undrafted) == (PATIENCE, 1, 12 - PATIENCE)
    assert (good.passes, good.committed, good.stopped, good.undrafted) == (1, 11, 0, 0)


def test_a_span_starts_with_no_misses(tokenizer, target):
    """The miss count belongs to a span: the `</tool_call>` that announces one sets it to 0, whatever the
    row's drafter missed before (`loop._advance_span`), and a prompt's span starts at 0."""
    graphdef, params, vocab = target
    calls = AtomicCalls(tokenizer)
    tables = announcements.tables(calls, nnx.merge(graphdef, params).cfg.vocab_size)
    prompt = jnp.asarray(announced_prompt(tokenizer, 12, seed=5))[None]
    spans, _ = loop.prompt_spans(tables, prompt[:, :-2], jnp.asarray([prompt.shape[1] - 2]), prompt[:, -2],
                                 jnp.asarray([True]))
    assert int(spans.left[0]) == 0 and int(spans.misses[0]) == 0
    opened, _ = loop._advance_span(spans._replace(misses=jnp.asarray([5], jnp.int32)), prompt[:, -1], tables)
    assert int(opened.left[0]) == 12 and int(opened.misses[0]) == 0
    other, _ = loop._advance_span(spans._replace(misses=jnp.asarray([5], jnp.int32)), prompt[:, 0], tables)
    assert int(other.misses[0]) == 5  # no announcement: the count stands


@pytest.mark.heavy
def test_the_decode_loop_and_the_host_oracle_decode_an_untrained_drafter_alike(tokenizer, target):
    """The differential test: the compiled decode loop (context cache, one program per answer) and the host
    loop (features recomputed by training's `draft_hidden` at every pass, Python bookkeeping) commit the
    same tokens in the same passes with the same per-pass acceptance, on a block of 12 that a drafter of
    8 slots cannot cover in one pass."""
    graphdef, params, vocab = target
    cfg = DrafterConfig(block_size=8, num_layers=1, target_layers=(0, 1), dim=32, num_heads=4, num_kv_heads=2,
                        head_dim=8, mlp_dim=64)
    drafter_graphdef, drafter_params = nnx.split(Drafter(cfg, nnx.Rngs(4)))
    prompt = announced_prompt(tokenizer, 12, seed=21)
    reference = target_only(graphdef, params, vocab, prompt)
    fast = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    host = HostDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    assert fast.generate(prompt, CachedDrafter(drafter_graphdef, drafter_params, vocab), max_new_tokens=NEW) == reference
    assert host.generate(prompt, HostTrainedDrafter(drafter_graphdef, drafter_params, graphdef, params, vocab),
                         max_new_tokens=NEW) == reference
    assert max(fast.stats.drafted_at) == 8 and fast.stats.passes >= 2
    assert (fast.stats.passes, fast.stats.committed, fast.stats.histogram, fast.stats.acceptance()) == (
        host.stats.passes, host.stats.committed, host.stats.histogram, host.stats.acceptance())


def test_the_library_decoder_takes_device_drafters_only(tokenizer, target):
    graphdef, params, vocab = target
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    with pytest.raises(TypeError, match="HostOracle is not a device drafter.*engine.generate_ids"):
        decoder.generate(announced_prompt(tokenizer, 5, seed=0), HostOracle(graphdef, params, vocab), max_new_tokens=4)


@pytest.mark.parametrize("block_size,seed", [(5, 0), (12, 1), (20, 2)])
def test_random_drafter_is_lossless(tokenizer, target, block_size, seed):
    graphdef, params, vocab = target
    prompt = announced_prompt(tokenizer, block_size, seed=10 + seed)
    # patience=0: random drafts are verified to the block's end (they would be given up after two misses)
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, patience=0)
    out = decoder.generate(prompt, RandomDrafter(vocab), max_new_tokens=NEW, seed=seed)
    assert out == target_only(graphdef, params, vocab, prompt)
    assert decoder.stats.committed == block_size + (decoder.stats.committed > block_size)
    assert decoder.stats.stopped == decoder.stats.undrafted == 0
    assert sum(decoder.stats.histogram.values()) == decoder.stats.passes >= 1


def test_max_new_tokens_and_stop_tokens_end_a_block_as_they_end_decoding(tokenizer, target):
    graphdef, params, vocab = target
    prompt = announced_prompt(tokenizer, 18, seed=7)
    free = target_only(graphdef, params, vocab, prompt)
    oracle = OracleDrafter(graphdef, params, vocab)
    short = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    assert short.generate(prompt, oracle, max_new_tokens=7) == free[:7]
    stop = free[9]
    stopped = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, stop_ids=[stop])
    assert stopped.generate(prompt, oracle, max_new_tokens=NEW) == free[:free.index(stop) + 1]


class Fixed:
    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, context, block, key):
        return Proposal(np.asarray(self.tokens, np.int32))


def test_a_bad_proposal_is_refused_by_name(tokenizer, target):
    graphdef, params, vocab = target
    prompt = announced_prompt(tokenizer, 5, seed=0)
    decoder = HostDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    with pytest.raises(ValueError, match="asked for 1 to 5 tokens"):
        decoder.generate(prompt, Fixed([1] * 6), max_new_tokens=NEW)
    with pytest.raises(ValueError, match=f"outside the vocabulary \\[0, {vocab}\\)"):
        decoder.generate(prompt, Fixed([1, vocab]), max_new_tokens=NEW)


def test_only_a_complete_atomic_decoding_call_announces_a_block(tokenizer):
    calls = AtomicCalls(tokenizer)

    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False)

    call = '<tool_call>{"name":"atomic_decoding","arguments":{"block_size":32,"count":10}}</tool_call>'
    assert calls.announced(ids("<action>a</action>" + call)).block_size == 32
    assert calls.announced(ids(call)).count == 10
    assert calls.announced(ids(call + "<robot_single>")) is None
    assert calls.announced(ids('<tool_call>{"name":"search","arguments":{}}</tool_call>')) is None
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        calls.announced(ids('<tool_call>{"name":"atomic_decoding","arguments":{"block_size":0}}</tool_call>'))


@pytest.mark.heavy
@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_extend_equals_decode_steps_and_the_full_forward(scan):
    graphdef, params = model(128, scan)

    def run(params, tokens, positions):
        net = nnx.merge(graphdef, params)
        full = net(tokens, positions, jnp.ones_like(tokens))
        # Rows of different committed lengths (5 and 8): each extends 6 tokens from its own cursor.
        lengths = jnp.asarray([5, 8], jnp.int32)
        _, cache = net.prefill(tokens[:, :8], positions[:, :8], lengths, 64)
        take = lengths[:, None] + jnp.arange(6)[None]
        block, block_positions = jnp.take_along_axis(tokens, take, 1), jnp.take_along_axis(positions, take, 1)
        logits, _ = net.extend(block, block_positions, cache, lengths)
        stepped, step_cache = [], cache
        for t in range(6):
            out, step_cache = net.decode_step(block[:, t], block_positions[:, t], step_cache, lengths + t)
            stepped.append(out)
        return logits, jnp.stack(stepped, 1), jnp.take_along_axis(full, take[..., None], 1)

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 120, (2, 14)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(14, dtype=jnp.int32), (2, 14))
    extended, stepped, full = jax.jit(run)(params, tokens, positions)
    assert float(jnp.std(extended)) > 1.0  # logits that differ from token to token
    np.testing.assert_allclose(extended, stepped, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(extended, full, atol=2e-4, rtol=1e-4)


def chi_square_ok(counts: np.ndarray, expected_probs: np.ndarray, alpha: float = 1e-3) -> tuple[float, float]:
    """(statistic, threshold) of Pearson's test over cells with an expected count >= 5 (the rest pooled)."""
    expected = expected_probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    statistic = float(np.sum((observed[keep] - expected[keep]) ** 2 / expected[keep]))
    return statistic, float(scipy_stats.chi2.ppf(1 - alpha, keep.sum() - 1))


@pytest.fixture(scope="module")
def small_vocab_logits():
    """The target's logits after a context (row 0, slot 0) and after the context + a, for every a of a
    vocabulary of 8 (row a, slot 1): one extend over 8 rows."""
    vocab = 8
    graphdef, params = model(vocab, scan=False, scale=4.0, seed=3)

    def run(params):
        net = nnx.merge(graphdef, params)
        context = jnp.asarray([[1, 5, 2, 7]], jnp.int32)
        _, cache = net.prefill(context, jnp.arange(4)[None], jnp.asarray([4]), 64)
        caches = jax.tree.map(lambda c: jnp.repeat(c, vocab, axis=1), cache)
        pairs = jnp.stack([jnp.full(vocab, 3), jnp.arange(vocab)], 1).astype(jnp.int32)
        return net.extend(pairs, jnp.broadcast_to(jnp.arange(4, 6), (vocab, 2)), caches, jnp.full(vocab, 4))[0]

    return jax.jit(run)(params)


def test_a_pass_with_each_row_s_own_sampling_accepts_as_each_alone():
    """`accept_pass` with a `RowSampling` (a server's slots: each row's numbers, vmapped with the rows) against
    the same row with its own `Sampling` (generate's): the same accepted count and next token for every row
    of a mixed batch (greedy, temperature, top-k, top-p, both), over random passes with ties."""
    rng = np.random.default_rng(0)
    width, logits_width, vocab = 5, 64, 60
    samplings = [Sampling(), Sampling(temperature=0.7), Sampling(temperature=1.0, top_k=5),
                 Sampling(temperature=0.9, top_p=0.8), Sampling(temperature=1.3, top_k=10, top_p=0.9)]
    per_row = sampling_rows(samplings, len(samplings))
    assert isinstance(per_row, RowSampling) and per_row.kind == SamplingKind.of(samplings)
    mixed = jax.jit(jax.vmap(lambda x, d, q, k, n, s: accept_pass(x, d, q, k, n, s, vocab)))
    alone = jax.jit(accept_pass, static_argnums=(5, 6))
    accepted_any = 0
    for trial in range(40):
        logits = jnp.asarray(np.round(rng.standard_normal((len(samplings), width, logits_width)) * 2, 1), jnp.float32)
        draft = jnp.asarray(rng.integers(0, 8, (len(samplings), width - 1)), jnp.int32)  # small ids: some accepted
        q = jax.nn.softmax(jnp.asarray(rng.standard_normal((len(samplings), width - 1, logits_width)), jnp.float32))
        keys, drafted = jax.random.split(jax.random.key(trial), len(samplings)), jnp.full(len(samplings), width - 1)
        got = np.asarray(mixed(logits, draft, q, keys, drafted, per_row)).T
        want = [tuple(int(v) for v in alone(logits[i], draft[i], q[i], keys[i], drafted[i], s, vocab))
                for i, s in enumerate(samplings)]
        assert [tuple(row) for row in got.tolist()] == want, trial
        accepted_any += int(got[:, 0].sum())
    assert accepted_any > 0  # drafts were accepted, not only rejected


@pytest.mark.heavy
@pytest.mark.parametrize("sampling,path", [(Sampling(temperature=1.0), "host"),
                                           (Sampling(temperature=0.7, top_k=5), "host"),
                                           (Sampling(temperature=0.7, top_k=5), "fast")],
                         ids=["t1", "t0.7-top5", "t0.7-top5-fast"])
def test_rejection_sampling_emits_the_target_distribution(small_vocab_logits, sampling, path):
    """First token and pair of tokens emitted from a 2-token draft ~ q, q != p, on a vocabulary of 8:
    the empirical distribution over 40,000 fixed-seed draws matches p(a) p(b | a) (chi-square, 0.1%).
    host: `verify_sampled` on p; fast: `accept_pass` on the logits, as the block loop runs it (a draft
    window of 3 slots, the third padding)."""
    vocab = 8
    p = target_probs(small_vocab_logits, sampling, vocab)
    p0, p1 = p[0, 0], p[:, 1]  # [V], [V, V]
    q = jax.nn.softmax(jax.random.normal(jax.random.key(9), (2, vocab)) * 1.5)
    assert float(jnp.abs(q[0] - p0).sum()) > 0.3  # a drafter that really differs from the target

    def emitted(key):
        draft_key, verify_key, next_key = jax.random.split(key, 3)
        draft = jax.random.categorical(draft_key, jnp.log(q)).astype(jnp.int32)  # [2]
        if path == "host":
            rows = jnp.stack([p0, p1[draft[0]], p0])  # the third row (bonus after both) is never read here
            accepted, nxt = verify_sampled(rows, draft, q, verify_key)
        else:
            first_logits = small_vocab_logits[0, 0]
            rows = jnp.stack([first_logits, small_vocab_logits[draft[0], 1], first_logits, first_logits])
            padded, q_padded = jnp.append(draft, 0), jnp.concatenate([q, jnp.full((1, vocab), 1.0 / vocab)])
            accepted, nxt = accept_pass(rows, padded, q_padded, verify_key, jnp.int32(2), sampling, vocab)
        first = jnp.where(accepted >= 1, draft[0], nxt)
        # After a rejection at slot 1 the next pass samples the second token from p1[first].
        after_reject = jax.random.categorical(next_key, jnp.log(p1[first])).astype(jnp.int32)
        second = jnp.where(accepted >= 2, draft[1], jnp.where(accepted == 1, nxt, after_reject))
        return first, second

    first, second = jax.jit(jax.vmap(emitted))(jax.random.split(jax.random.key(0), 40_000))
    first, second = np.asarray(first), np.asarray(second)
    statistic, threshold = chi_square_ok(np.bincount(first, minlength=vocab), np.asarray(p0))
    assert statistic < threshold, (statistic, threshold)
    joint = np.bincount(first * vocab + second, minlength=vocab * vocab)
    statistic, threshold = chi_square_ok(joint, np.asarray(p0[:, None] * p1).ravel())
    assert statistic < threshold, (statistic, threshold)
    # The test can fail: the drafter's own q is far from p, so emitting the draft unverified is refused.
    statistic, threshold = chi_square_ok(np.bincount(np.asarray(jax.vmap(lambda k: jax.random.categorical(
        k, jnp.log(q[0])))(jax.random.split(jax.random.key(1), 40_000))), minlength=vocab), np.asarray(p0))
    assert statistic > threshold


def test_sampled_speculative_decoding_runs_and_keeps_ids_in_the_vocabulary(tokenizer, target):
    graphdef, params, vocab = target
    prompt = announced_prompt(tokenizer, 12, seed=3)
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab,
                                 sampling=Sampling(temperature=1.0), patience=0)
    out = decoder.generate(prompt, RandomDrafter(vocab), max_new_tokens=NEW, seed=4)
    assert len(out) == NEW and all(0 <= t < vocab for t in out)
    assert decoder.stats.committed >= 12


# -- the fast path: cached drafting, one compiled program per block, vision/M-RoPE targets --------------

IMAGE_GRID = (1, 4, 4)  # one image: 16 patches, 4 merged tokens


def block_drafter(target_cfg, seed: int = 4, block_size: int = 8):
    """An untrained block drafter with lively weights (its proposals change from slot to slot)."""
    cfg = DrafterConfig(block_size=block_size, num_layers=2, target_layers=(0, 1), dim=target_cfg.dim,
                        num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
                        head_dim=target_cfg.head_dim, mlp_dim=64)
    graphdef, params = nnx.split(Drafter(cfg, nnx.Rngs(seed)))
    return graphdef, lively(params, 6.0)


@pytest.fixture(scope="module")
def vl_target(tokenizer):
    """An M-RoPE decoder with a vision tower, the smoke tokenizer's <|image_pad|> as its media slot."""
    vocab = len(tokenizer)
    cfg = ModelConfig(vocab_size=-(-vocab // 64) * 64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, mlp_dim=64, image_pad_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                      mrope_section=(2, 3, 3), attention="blockwise",
                      vision=VisionConfig(patch_size=4, merge_size=2, temporal_patch_size=2, dim=32, num_layers=1,
                                          num_heads=2, mlp_dim=64))
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(1)))
    return graphdef, lively(params, 12.0), vocab, cfg


def image_prompt(tokenizer, cfg, block_size: int, seed: int) -> dict:
    """Words, one image's media slots, then an announced block: an engine prompt dict (rope_index positions)."""
    rng = np.random.default_rng(seed)
    words = np.asarray(tokenizer.encode(" ".join(rng.choice(["look", "at", "the", "tray"], 3)),
                                        add_special_tokens=False), np.int32)
    slots = IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2] // cfg.vision.merge_size ** 2
    ids = np.concatenate([words, np.full(slots, cfg.image_pad_id, np.int32), announced_prompt(tokenizer, block_size, seed)])
    patch_positions, segments = mrope.vision_inputs([IMAGE_GRID], cfg.vision.merge_size)
    patches = rng.normal(size=(len(segments), cfg.vision.patch_dim)).astype(np.float32)
    return {"ids": ids, "positions": mrope.rope_index(ids, [IMAGE_GRID], cfg.image_pad_id, -1, cfg.vision.merge_size),
            "vision": {"patches": patches, "patch_positions": patch_positions, "patch_segments": segments}}


def cached_vs_full_proposals(target_graphdef, target_params, drafter_graphdef, drafter_params, tokens, positions,
                             vision, anchors: list[int], split: int = 10):
    """(cached, full-context) hidden states [A, B, D] and greedy proposals [A, B] at each anchor slot c: the
    cached drafter reads a prefill of tokens [0, split) and an extend of the rest (features collected by the
    target's own passes; slots >= c are in the cache but masked); the reference is `draft_hidden` over
    the whole row with anchor c, as training computes it."""
    layers = nnx.merge(drafter_graphdef, drafter_params).cfg.target_layers

    def run(target_params, drafter_params):
        target = nnx.merge(target_graphdef, target_params)
        drafter = nnx.merge(drafter_graphdef, drafter_params)
        flat = text_positions(positions)
        _, cache, features = target.prefill(tokens[:, :split], positions[:, :split], jnp.asarray([split]), 64,
                                            vision, collect=layers)
        context = drafter.context_cache(features, flat[:, :split], 64)
        # Generated tokens are text: 1-D positions (M-RoPE text tokens have equal coordinates).
        _, _, more = target.extend(tokens[:, split:], flat[:, split:], cache, jnp.asarray([split]), collect=layers)
        context = drafter.write_context(context, more, flat[:, split:], jnp.asarray([split]))
        batch = {"tokens": tokens, "positions": positions, "segment_ids": jnp.ones_like(tokens)}
        if vision is not None:
            batch.update(patches=vision[0], patch_positions=vision[1], patch_segments=vision[2])
        cached = jnp.stack([drafter.draft_cached(context, jnp.asarray([c]), jnp.take(target.embed[...], tokens[:, c], axis=0),
                                                 flat[:, c])[0] for c in anchors])
        full = draft_hidden(drafter, target, batch, jnp.asarray([anchors]))[0]  # [A, B, D]
        head = target.head_matrix()
        return cached, full, jnp.argmax(cached @ head, axis=-1), jnp.argmax(full @ head, axis=-1)

    return [np.asarray(x) for x in jax.jit(run)(target_params, drafter_params)]


@pytest.mark.heavy
def test_cached_drafting_equals_draft_hidden_over_the_whole_context(tokenizer, target, vl_target):
    # Text: the module's target; anchors in the prefill, at its edge and inside the extended part.
    graphdef, params, vocab = target
    drafter_graphdef, drafter_params = block_drafter(nnx.merge(graphdef, params).cfg)
    tokens = jnp.asarray(announced_prompt(tokenizer, 8, seed=1)[None, :24])
    hidden, full_hidden, cached, full = cached_vs_full_proposals(
        graphdef, params, drafter_graphdef, drafter_params, tokens, jnp.arange(24)[None], None, [4, 10, 17, 23])
    assert len(set(full.ravel().tolist())) > 4  # proposals that differ from slot to slot
    np.testing.assert_allclose(hidden, full_hidden, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(cached, full)
    # M-RoPE with an image: the image's features come from the prefill (slots 7..10 of 14), anchors in
    # it, after the image, and in the extended part.
    graphdef, params, vocab, cfg = vl_target
    drafter_graphdef, drafter_params = block_drafter(cfg, seed=5)
    prompt = image_prompt(tokenizer, cfg, 8, seed=2)
    vision = tuple(jnp.asarray(prompt["vision"][k])[None] for k in ("patches", "patch_positions", "patch_segments"))
    hidden, full_hidden, cached, full = cached_vs_full_proposals(
        graphdef, params, drafter_graphdef, drafter_params, jnp.asarray(prompt["ids"][None, :26]),
        jnp.asarray(prompt["positions"][None, :26]), vision, [8, 12, 25], split=14)
    assert len(set(full.ravel().tolist())) > 2
    np.testing.assert_allclose(hidden, full_hidden, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(cached, full)


@pytest.mark.heavy
@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_fast_path_with_a_cached_block_drafter_is_lossless(tokenizer, target, scan):
    graphdef, params, vocab = target
    if scan:  # the same weights stacked for nnx.scan
        graphdef, params = model(nnx.merge(graphdef, params).cfg.vocab_size, scan=True)
    drafter_graphdef, drafter_params = block_drafter(nnx.merge(graphdef, params).cfg, seed=6)
    drafter = CachedDrafter(drafter_graphdef, drafter_params, vocab)
    for block_size, seed in [(12, 30), (20, 31)][:1 if scan else 2]:
        prompt = announced_prompt(tokenizer, block_size, seed=seed)
        decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
        assert decoder.generate(prompt, drafter, max_new_tokens=NEW) == target_only(graphdef, params, vocab, prompt)
        # Passes of at most the drafter's 8 slots; the whole answer is one program, timed whole.
        assert max(decoder.stats.drafted_at) == 8 and decoder.stats.passes >= 2
        assert decoder.timing.tokens == NEW and decoder.timing.launches == 1 and decoder.timing.seconds > 0


@pytest.mark.heavy
def test_fast_path_decodes_an_m_rope_target_with_its_image_losslessly(tokenizer, vl_target):
    graphdef, params, vocab, cfg = vl_target
    drafter_graphdef, drafter_params = block_drafter(cfg, seed=7)
    for block_size, seed in [(12, 40), (16, 41)]:
        prompt = image_prompt(tokenizer, cfg, block_size, seed)
        reference = generate_ids(params, graphdef, [prompt], max_new_tokens=NEW, stop_ids=(), vocab=vocab)[0]
        assert len(set(reference)) > 3
        # The image matters: without it the target says something else.
        assert reference != generate_ids(params, graphdef, [{**prompt, "vision": {
            **prompt["vision"], "patches": prompt["vision"]["patches"] * 0}}], max_new_tokens=NEW, stop_ids=(),
            vocab=vocab)[0]
        decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
        assert decoder.generate(prompt, CachedDrafter(drafter_graphdef, drafter_params, vocab),
                                max_new_tokens=NEW) == reference
        oracle = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
        assert oracle.generate(prompt, OracleDrafter(graphdef, params, vocab), max_new_tokens=NEW) == reference
        assert oracle.stats.passes == 1 and oracle.stats.tau == block_size + 1


def test_a_drafter_of_8_slots_takes_two_passes_for_a_block_of_12(tokenizer, target):
    graphdef, params, vocab = target
    prompt = announced_prompt(tokenizer, 12, seed=12)
    reference = target_only(graphdef, params, vocab, prompt)
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    assert decoder.generate(prompt, ScriptedDrafter(reference, block_size=8), max_new_tokens=NEW) == reference
    # 8 accepted + the bonus, then the 3 left + the bonus (one past the block).
    assert decoder.stats.histogram == {8: 1, 3: 1} and decoder.stats.committed == 13
    assert decoder.stats.tau == 6.5


def test_a_vision_prompt_must_end_with_a_text_token_at_its_largest_position(tokenizer, vl_target):
    graphdef, params, vocab, cfg = vl_target
    prompt = image_prompt(tokenizer, cfg, 8, seed=3)
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab)
    with pytest.raises(ValueError, match="needs its positions"):
        decoder.generate(prompt["ids"], RandomDrafter(vocab), max_new_tokens=4, vision_inputs=prompt["vision"])
    early = {**prompt, "positions": prompt["positions"][::-1].copy()}
    with pytest.raises(ValueError, match="must end with a text token"):
        decoder.generate(early, RandomDrafter(vocab), max_new_tokens=4)


def test_first_argmax_is_argmax_with_ties_to_the_lowest_id():
    logits = jax.random.normal(jax.random.key(0), (40, 300))
    logits = logits.at[3, 7].set(9.0).at[3, 9].set(9.0).at[5, -1].set(jnp.inf)
    np.testing.assert_array_equal(first_argmax(logits), jnp.argmax(logits, axis=-1))
    assert int(first_argmax(logits)[3]) == 7 and int(first_argmax(logits)[5]) == 299
