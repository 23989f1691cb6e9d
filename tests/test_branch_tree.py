"""Question mode as a branch tree: each branch's scores equal those of a separate sequence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from valen_jax.models.config import ModelConfig
from valen_jax.models.heads import branch_log_probs
from valen_jax.models.transformer import Transformer

CFG = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                  score_head=True, qk_norm=True)


def _run(model, tokens, positions, segments, branches=None):
    tokens, positions, segments = (jnp.asarray(np.asarray(a)[None], jnp.int32) for a in (tokens, positions, segments))
    branch_ids = None if branches is None else jnp.asarray(np.asarray(branches)[None], jnp.int32)
    hidden = model.hidden(tokens, positions, segments, branch_ids=branch_ids)
    return np.asarray(model.score_head(hidden))[0], np.asarray(model.logits(hidden))[0]


@pytest.mark.slow
def test_branch_scores_equal_separate_sequences():
    model = Transformer(CFG, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prefix, first, second = (rng.integers(1, 128, n) for n in (11, 5, 7))
    tree = np.concatenate([prefix, first, second])
    branches = np.array([0] * 11 + [1] * 5 + [2] * 7)
    positions = np.concatenate([np.arange(11), 11 + np.arange(5), 11 + np.arange(7)])
    tree_scores, tree_logits = _run(model, tree, positions, np.ones_like(tree), branches)
    for branch, (start, stop) in ((first, (11, 16)), (second, (16, 23))):
        alone = np.concatenate([prefix, branch])
        scores, logits = _run(model, alone, np.arange(len(alone)), np.ones_like(alone))
        np.testing.assert_allclose(tree_scores[start:stop], scores[11:], atol=1e-5)
        np.testing.assert_allclose(tree_logits[start:stop], logits[11:], atol=1e-5)
    np.testing.assert_allclose(tree_scores[:11], scores[:11], atol=1e-5)


def test_branches_are_isolated_from_each_other():
    model = Transformer(CFG, nnx.Rngs(1))
    rng = np.random.default_rng(1)
    tree = rng.integers(1, 128, 20)
    branches = np.array([0] * 8 + [1] * 6 + [2] * 6)
    positions = np.concatenate([np.arange(8), 8 + np.arange(6), 8 + np.arange(6)])
    base, _ = _run(model, tree, positions, np.ones_like(tree), branches)
    changed = tree.copy()
    changed[8:14] = rng.integers(1, 128, 6)  # rewrite branch 1 only
    after, _ = _run(model, changed, positions, np.ones_like(tree), branches)
    np.testing.assert_allclose(after[14:], base[14:], atol=1e-6)
    assert not np.allclose(after[8:14], base[8:14])


def test_branch_log_probs_softmax_over_present_branches_only():
    scores = jnp.asarray([[0.0, 1.0, 2.0, 3.0, 0.5]])
    positions = jnp.asarray([[[1, 3, 0], [4, 0, 0]]])
    mask = jnp.asarray([[[True, True, False], [False, False, False]]])
    log_probs = np.asarray(branch_log_probs(scores, positions, mask))
    np.testing.assert_allclose(np.exp(log_probs[0, 0, :2]), np.exp([1.0, 3.0]) / np.exp([1.0, 3.0]).sum(), rtol=1e-6)
    assert log_probs[0, 0, 2] == -np.inf
    assert (log_probs[0, 1] == 0).all()
