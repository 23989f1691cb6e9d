"""Sampling (valen_jax.decoding.sampling): reproducible per prompt, the softmax's frequencies, top-k/top-p sets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from valen_jax.decoding import Sampling, generate_ids
from valen_jax.decoding.sampling import SamplingKind, filter_logits, sample, sample_rows, sampling_rows
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import Transformer

DRAWS = 24_000
# A 6-token vocabulary with distinct, not too peaked logits.
LOGITS = np.array([1.2, 0.4, -0.3, 2.0, 0.0, -1.0], np.float32)


def _draws(sampling: Sampling, logits=LOGITS, seed: int = 0, vocab: int | None = None) -> np.ndarray:
    """DRAWS samples of one row's logits, each with its own key (as the engine folds in prompt index and step)."""
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), jnp.arange(DRAWS))
    tiled = jnp.tile(jnp.asarray(logits)[None], (DRAWS, 1))
    return np.asarray(jax.jit(sample, static_argnums=(2, 3))(tiled, keys, sampling, vocab or len(logits)))


def _chi_square(draws: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(draws, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    expected = probs[support] * len(draws)
    return float(((counts[support] - expected) ** 2 / expected).sum())


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    e[~np.isfinite(x)] = 0
    return e / e.sum()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.5])
def test_empirical_frequencies_match_the_tempered_softmax(temperature):
    draws = _draws(Sampling(temperature=temperature))
    # 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5, so only a wrong distribution fails (the seed is fixed).
    assert _chi_square(draws, _softmax(LOGITS / temperature)) < 30
    # And not the untempered one (a sampler ignoring the temperature would pass the line above at T=1 only).
    if temperature != 1.0:
        assert _chi_square(draws, _softmax(LOGITS)) > 100


def test_top_k_never_leaves_the_k_largest_and_keeps_their_ratios():
    draws = _draws(Sampling(temperature=1.0, top_k=2))
    assert set(np.unique(draws)) == {0, 3}
    probs = _softmax(np.where(np.isin(np.arange(6), [0, 3]), LOGITS, -np.inf))
    assert _chi_square(draws, probs) < 20


def test_top_p_keeps_the_smallest_nucleus_and_renormalises():
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    logits = jnp.log(jnp.asarray(probs))
    for top_p, kept in ((0.4, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.97, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])):
        filtered = np.asarray(filter_logits(logits, Sampling(temperature=1.0, top_p=top_p)))
        assert np.flatnonzero(np.isfinite(filtered)).tolist() == kept, top_p
        expected = np.where(np.isin(np.arange(4), kept), probs, 0) / probs[kept].sum()
        np.testing.assert_allclose(np.asarray(jax.nn.softmax(filtered)), expected, rtol=1e-5, atol=1e-7)
    # The nucleus of a shuffled order is the same set of tokens; draws follow the renormalised mass.
    shuffled = np.array([0.15, 0.5, 0.05, 0.3], np.float32)
    draws = _draws(Sampling(temperature=1.0, top_p=0.75), np.log(shuffled))
    assert _chi_square(draws, np.array([0, 0.5, 0, 0.3]) / 0.8) < 20


def test_top_k_then_top_p_compose_in_that_order():
    logits = jnp.log(jnp.asarray([0.4, 0.3, 0.2, 0.1]))
    # top-k 3 leaves (.4, .3, .2) → renormalised (.44, .33, .22); top-p .7 then keeps the first two.
    filtered = np.asarray(filter_logits(logits, Sampling(temperature=1.0, top_k=3, top_p=0.7)))
    assert np.flatnonzero(np.isfinite(filtered)).tolist() == [0, 1]


def test_rows_of_different_samplings_draw_what_each_draws_alone():
    """`sample_rows` (the server's: the numbers per row, one program per kind) against `sample` (generate's:
    one program per Sampling), row by row with the same keys: the same token every time, ties and padding
    ids included (each row's logits hold repeated values and 10 padding ids)."""
    rng = np.random.default_rng(0)
    samplings = [Sampling(), Sampling(temperature=0.7), Sampling(temperature=1.0, top_k=5),
                 Sampling(temperature=0.9, top_p=0.8), Sampling(temperature=1.3, top_k=40, top_p=0.9),
                 Sampling(temperature=0.5, top_k=1000), Sampling(temperature=2.0, top_p=0.3)]
    logits = np.round(rng.standard_normal((len(samplings), 300)) * 3, 1).astype(np.float32)  # ties
    by_rows = jax.jit(sample_rows, static_argnums=(3,))
    alone = jax.jit(sample, static_argnums=(2, 3))
    assert SamplingKind.of(samplings) == SamplingKind(sampled=True, top_k=True, top_p=True)
    # The whole mix under the kind with both filters, and each smaller mix under its own kind.
    for mix in (samplings, samplings[:2], samplings[:3] + samplings[5:6], samplings[:2] + samplings[3:4]):
        rows = sampling_rows(mix, len(mix))
        kind = rows.kind
        assert kind == SamplingKind.of(mix)
        for draw in range(20):
            keys = jax.random.split(jax.random.key(draw), len(mix))
            got = np.asarray(by_rows(logits[:len(mix)], keys, rows, 290))
            want = [int(alone(logits[i:i + 1], keys[i:i + 1], s, 290)[0]) for i, s in enumerate(mix)]
            assert got.tolist() == want, (kind, draw)
    greedy = sampling_rows([None, Sampling()], 3)  # None and padding rows are greedy
    assert greedy.kind == SamplingKind.of([Sampling()]) == SamplingKind()
    assert np.asarray(sample_rows(logits[:3], None, greedy, 290)).tolist() == logits[:3, :290].argmax(-1).tolist()


def test_padding_ids_are_never_sampled_or_chosen():
    logits = np.array([0.1, 0.2, 0.3, 5.0, 6.0], np.float32)  # the two largest are embedding padding
    draws = _draws(Sampling(temperature=3.0), logits, vocab=3)
    assert draws.max() < 3
    assert int(sample(jnp.asarray(logits)[None], None, Sampling(), 3)[0]) == 2


def test_greedy_ties_go_to_the_first_index():
    logits = jnp.asarray([[0.0, 2.0, 1.0, 2.0]])
    assert int(sample(logits, None, Sampling(), 4)[0]) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature=-0.5: must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"temperature": float("inf")}, "temperature=inf"),
    ({"temperature": 1.0, "top_k": -1}, "top_k=-1: must be an integer >= 0"),
    ({"temperature": 1.0, "top_k": 2.5}, "top_k=2.5"),
    ({"temperature": 1.0, "top_p": 0.0}, r"top_p=0.0: must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p=1.5"),
    ({"top_p": 0.9}, "needs temperature > 0"),
    ({"top_k": 5}, "needs temperature > 0"),
])
def test_bad_sampling_values_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


@pytest.fixture(scope="module")
def model():
    """A tiny decoder whose weights are large enough that sampled continuations vary."""
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    params = jax.tree.map(lambda p: p * 10 if p.ndim >= 2 else p, params)
    rng = np.random.default_rng(1)
    prompts = [{"ids": rng.integers(0, 60, n), "positions": np.arange(n)} for n in (4, 9, 6, 13)]
    return graphdef, params, prompts


def _generate(model, prompts, **kwargs):
    graphdef, params, _ = model
    return generate_ids(params, graphdef, prompts, max_new_tokens=12, stop_ids=(), vocab=60,
                        sampling=Sampling(temperature=1.0, top_p=0.95), **kwargs)


@pytest.mark.slow
def test_same_seed_same_tokens_whatever_the_batching(model):
    prompts = model[2]
    whole = _generate(model, prompts, seed=7)
    assert whole == _generate(model, prompts, seed=7)
    assert all(len(row) == 12 for row in whole) and max(max(row) for row in whole) < 60
    # One row at a time, and prompt 2 alone at its global index: a prompt's stream is (seed, index) only.
    assert _generate(model, prompts, seed=7, local_batch=1) == whole
    assert _generate(model, prompts[2:3], seed=7, first_index=2) == whole[2:3]
    assert _generate(model, prompts[1:], seed=7, first_index=1, local_batch=2) == whole[1:]


@pytest.mark.slow
def test_different_seed_different_tokens(model):
    prompts = model[2]
    first, second = _generate(model, prompts, seed=7), _generate(model, prompts, seed=8)
    # 4 rows × 12 tokens: identical streams under another seed would mean the seed is ignored.
    assert first != second
    assert sum(a != b for row_a, row_b in zip(first, second, strict=True) for a, b in zip(row_a, row_b, strict=True)) > 12
    # Two prompts with the same ids at different indices draw different streams.
    twins = _generate(model, [prompts[0], prompts[0]], seed=7)
    assert twins[0] != twins[1]


@pytest.mark.slow
def test_a_group_prefilled_once_draws_what_its_repeated_prompts_draw(model):
    # group_size G: each prompt prefilled once, its cache copied to G rows; the tokens are those of the
    # prompts each repeated G times (row p·G + g, its own stream), in any batching.
    prompts = model[2]
    repeated = [p for p in prompts for _ in range(3)]
    whole = _generate(model, repeated, seed=7)
    assert _generate(model, prompts, seed=7, group_size=3) == whole
    assert _generate(model, prompts, seed=7, group_size=3, local_batch=3) == whole
    assert _generate(model, prompts[1:3], seed=7, group_size=3, first_index=1) == whole[3:9]
    assert len({tuple(row) for row in whole[:3]}) == 3  # a group's completions differ: their own streams
    graphdef, params, _ = model
    greedy = generate_ids(params, graphdef, prompts, max_new_tokens=5, stop_ids=(), vocab=60, group_size=2)
    assert greedy == generate_ids(params, graphdef, [p for p in prompts for _ in range(2)],
                                  max_new_tokens=5, stop_ids=(), vocab=60)
