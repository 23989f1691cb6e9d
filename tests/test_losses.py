"""Losses on small hand-computed cases (seed 000, "Labels and missing values" for the reductions)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from valen_jax.training.losses import (
    branch_cross_entropy,
    combine,
    coordinate_targets,
    head_token_losses,
    mean_of,
    reduce_question_losses,
    token_cross_entropy,
    token_losses,
)


def test_token_cross_entropy_is_weighted_by_the_explicit_weights():
    # Uniform logits over 4 classes: every token costs log 4; only weighted tokens count.
    logits = jnp.zeros((1, 3, 4))
    targets = jnp.array([[0, 1, 2]])
    weights = jnp.array([[1.0, 0.0, 2.0]])
    loss_sum, weight_sum, correct = token_cross_entropy(logits, targets, weights)
    assert float(loss_sum) == pytest.approx(3 * math.log(4))
    assert float(weight_sum) == 3.0
    assert float(correct) == 1.0  # argmax of a tie is class 0: right for the first token only


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_token_losses_match_autodiff_through_token_losses(dtype):
    # The training loss's hand-written backward must give autodiff's gradients, z-loss included.
    rng = np.random.default_rng(3)
    hidden = jnp.asarray(rng.standard_normal((2, 7, 16)), dtype)
    head = jnp.asarray(rng.standard_normal((16, 37)) * 0.5, dtype)
    targets = jnp.asarray(rng.integers(0, 37, (2, 7)), jnp.int32)
    weights = jnp.asarray(rng.random((2, 7)) * (rng.random((2, 7)) > 0.3), jnp.float32)

    def objective(losses):
        def total(h, w):
            sums = losses(h, w)
            return sums["ce"] / 5.0 + 0.25 * sums["z"] / 5.0, sums
        return total

    def reference(h, w):
        logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        return token_losses(logits, targets, weights)

    (ref_h, ref_w), ref_sums = jax.grad(objective(reference), argnums=(0, 1), has_aux=True)(hidden, head)
    (got_h, got_w), got_sums = jax.grad(objective(lambda h, w: head_token_losses(h, w, targets, weights)),
                                        argnums=(0, 1), has_aux=True)(hidden, head)
    assert got_h.dtype == hidden.dtype and got_w.dtype == head.dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name in ("ce", "z", "weight", "correct"):
        np.testing.assert_allclose(got_sums[name], ref_sums[name], rtol=tol)
    np.testing.assert_allclose(np.asarray(got_h, np.float32), np.asarray(ref_h, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got_w, np.float32), np.asarray(ref_w, np.float32), rtol=tol, atol=tol)


def _dense_soft_reference(hidden, head, targets, weights, ids, sigma):
    """The soft coordinate target written out densely: −Σ_u q_u log softmax_u, q a Gaussian over `ids`."""
    logits = jnp.einsum("btd,dv->btv", hidden, head, preferred_element_type=jnp.float32)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    vocab = logits.shape[-1]
    dense_q = np.zeros(targets.shape + (vocab,), np.float32)
    for index in np.ndindex(targets.shape):
        t = int(targets[index])
        if t in list(ids):
            v = list(ids).index(t)
            g = np.exp(-0.5 * ((np.arange(len(ids)) - v) / sigma) ** 2)
            dense_q[index + (np.asarray(ids),)] = g / g.sum()
        else:
            dense_q[index + (t,)] = 1.0
    ce = -jnp.sum(jnp.asarray(dense_q) * log_p, axis=-1)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    return {"ce": jnp.sum(ce * weights), "z": jnp.sum(jnp.square(log_z) * weights), "weight": jnp.sum(weights)}


@pytest.mark.parametrize("chunk_length", [None, 3])  # one chunk (logits kept) and the scanned chunks + a tail
@pytest.mark.parametrize("sigma", [0.7, 4.0])
def test_soft_coordinate_targets_match_a_dense_reference_forward_and_backward(sigma, chunk_length):
    # Coordinate ids not contiguous and not in vocabulary order: the value is the position in `ids`.
    rng = np.random.default_rng(5)
    vocab, dim = 41, 12
    ids = np.array([30, 31, 32, 5, 6, 7, 8, 40, 9, 10, 11, 12], np.int32)
    hidden = jnp.asarray(rng.standard_normal((2, 8, dim)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((dim, vocab)) * 0.5, jnp.float32)
    targets = rng.integers(0, vocab, (2, 8)).astype(np.int32)
    targets[0, :4] = ids[[0, 3, 7, 11]]  # edge values and inner ones
    weights = jnp.asarray(rng.random((2, 8)) + 0.1, jnp.float32)

    def objective(losses):
        def total(h, w):
            sums = losses(h, w)
            return sums["ce"] / 3.0 + 0.5 * sums["z"] / 3.0, sums
        return total

    reference = objective(lambda h, w: _dense_soft_reference(h, w, targets, weights, ids, sigma))
    got = objective(lambda h, w: head_token_losses(h, w, jnp.asarray(targets), weights, chunk_length,
                                                   coordinates=(ids, sigma)))
    (ref_h, ref_w), ref_sums = jax.grad(reference, argnums=(0, 1), has_aux=True)(hidden, head)
    (got_h, got_w), got_sums = jax.grad(got, argnums=(0, 1), has_aux=True)(hidden, head)
    for name in ("ce", "z", "weight"):
        np.testing.assert_allclose(got_sums[name], ref_sums[name], rtol=1e-5)
    np.testing.assert_allclose(got_h, ref_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_w, ref_w, rtol=1e-5, atol=1e-5)


def test_soft_coordinate_targets_at_zero_width_are_the_one_hot_loss():
    rng = np.random.default_rng(6)
    hidden = jnp.asarray(rng.standard_normal((1, 6, 8)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((8, 20)), jnp.float32)
    targets = jnp.asarray([[3, 4, 5, 6, 19, 0]], jnp.int32)
    weights = jnp.ones((1, 6), jnp.float32)
    ids = np.arange(3, 13, dtype=np.int32)

    def ce(coordinates):
        return lambda h: head_token_losses(h, head, targets, weights, coordinates=coordinates)["ce"]

    np.testing.assert_array_equal(ce((ids, 0.0))(hidden), ce(None)(hidden))
    np.testing.assert_array_equal(jax.grad(ce((ids, 0.0)))(hidden), jax.grad(ce(None))(hidden))


def test_coordinate_targets_are_a_normalised_gaussian_over_the_grid_and_zero_elsewhere():
    ids = jnp.arange(100, 111)
    is_coordinate, q = coordinate_targets(jnp.asarray([100, 105, 7]), ids, 2.0)
    assert is_coordinate.tolist() == [True, True, False]
    np.testing.assert_allclose(q.sum(-1), [1.0, 1.0, 0.0], rtol=1e-6)
    assert int(jnp.argmax(q[1])) == 5 and float(q[1, 3]) == pytest.approx(float(q[1, 7]))
    assert float(q[1, 7] / q[1, 5]) == pytest.approx(math.exp(-0.5), rel=1e-5)


def test_head_token_losses_count_ties_at_the_maximum_as_hits():
    # Uniform logits: every target ties with the maximum (token_losses' argmax would pick class 0).
    hidden, head = jnp.ones((1, 3, 2)), jnp.zeros((2, 4))
    sums = head_token_losses(hidden, head, jnp.array([[0, 1, 2]]), jnp.array([[1.0, 0.0, 2.0]]))
    assert float(sums["correct"]) == 3.0
    assert float(sums["ce"]) == pytest.approx(3 * math.log(4))


def test_z_loss_adds_the_squared_log_normaliser():
    logits = jnp.log(jnp.array([[[1.0, 3.0]]]))  # Z = 4, p(target=1) = 3/4
    sums = token_losses(logits, jnp.array([[1]]), jnp.array([[1.0]]))
    assert float(sums["ce"]) == pytest.approx(-math.log(0.75), rel=1e-6)
    assert float(sums["z"]) == pytest.approx(math.log(4) ** 2, rel=1e-6)
    loss_sum, _, _ = token_cross_entropy(logits, jnp.array([[1]]), jnp.array([[1.0]]), z_loss=0.1)
    assert float(loss_sum) == pytest.approx(-math.log(0.75) + 0.1 * math.log(4) ** 2, rel=1e-6)


def _log_probs(probs):
    probs = np.asarray(probs, np.float32)
    return jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)


def test_branch_cross_entropy_against_soft_labels_ignores_absent_branches_and_unlabeled_questions():
    # Question 0: three branches, model (0.5, 0.25, 0.25), soft label (0.5, 0.5, 0).
    # Question 1: two branches (third absent), hard label on the second; question 2: unlabeled.
    log_probs = _log_probs([[[0.5, 0.25, 0.25], [0.8, 0.2, 0.0], [0.5, 0.5, 0.0]]])
    labels = jnp.array([[[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    labeled = jnp.array([[True, True, False]])
    losses = branch_cross_entropy(log_probs, labels, labeled)
    expected = [-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)), -math.log(0.2), 0.0]
    np.testing.assert_allclose(np.asarray(losses[0]), expected, rtol=1e-6)


def test_branch_cross_entropy_gradient_is_finite_with_absent_branches():
    labels = jnp.array([[[0.0, 1.0, 0.0]]])

    def loss(scores):
        log_probs = jnp.where(jnp.array([True, True, False]), jax.nn.log_softmax(
            jnp.where(jnp.array([True, True, False]), scores, -jnp.inf)), -jnp.inf)
        return branch_cross_entropy(log_probs[None, None], labels, jnp.array([[True]])).sum()

    grad = jax.grad(loss)(jnp.array([0.3, -0.2, 0.0]))
    assert np.all(np.isfinite(np.asarray(grad)))


def test_state_mean_averages_within_each_state_then_over_states():
    # Row 0 is one state with losses 1 and 3 (mean 2); row 1 packs two states: ids 7 → {4}, 9 → {6, 8}
    # (mean 7), plus an unlabeled question that must not count. Mean over the 3 states = (2+4+7)/3.
    losses = jnp.array([[1.0, 3.0, 0.0], [4.0, 6.0, 8.0]])
    labeled = jnp.array([[True, True, False], [True, True, True]])
    state_ids = jnp.array([[0, 0, 0], [7, 9, 9]])
    num, den = reduce_question_losses(losses, labeled, "state_mean", state_ids)
    assert float(den) == pytest.approx(3.0)
    assert float(mean_of(num, den)) == pytest.approx((2 + 4 + 7) / 3)


def test_state_mean_without_state_ids_treats_each_row_as_one_state():
    losses = jnp.array([[1.0, 3.0, 100.0], [5.0, 0.0, 0.0]])
    labeled = jnp.array([[True, True, False], [True, False, False]])
    num, den = reduce_question_losses(losses, labeled, "state_mean")
    assert float(mean_of(num, den)) == pytest.approx((2 + 5) / 2)


def test_question_mean_averages_over_all_labeled_questions():
    losses = jnp.array([[1.0, 3.0, 100.0], [5.0, 0.0, 0.0]])
    labeled = jnp.array([[True, True, False], [True, False, False]])
    num, den = reduce_question_losses(losses, labeled, "question_mean")
    assert float(mean_of(num, den)) == pytest.approx(3.0)


@pytest.mark.parametrize("reduction", ["state_mean", "question_mean"])
def test_an_all_unlabeled_batch_gives_zero_not_nan(reduction):
    losses = jnp.full((2, 3), jnp.nan)  # even garbage losses of unlabeled questions must not leak
    labeled = jnp.zeros((2, 3), bool)

    def mean(losses):
        return mean_of(*reduce_question_losses(losses, labeled, reduction))

    assert float(mean(losses)) == 0.0
    assert np.all(np.asarray(jax.grad(mean)(jnp.ones((2, 3)))) == 0.0)


def test_reductions_add_over_micro_batches():
    losses = jnp.array([[1.0, 3.0], [4.0, 6.0], [2.0, 2.0], [9.0, 1.0]])
    labeled = jnp.array([[True, True], [True, False], [False, False], [True, True]])
    for reduction in ("state_mean", "question_mean"):
        whole = reduce_question_losses(losses, labeled, reduction)
        halves = [reduce_question_losses(losses[i:i + 2], labeled[i:i + 2], reduction) for i in (0, 2)]
        assert float(mean_of(*whole)) == pytest.approx(float(mean_of(sum(h[0] for h in halves),
                                                                      sum(h[1] for h in halves))))


def test_unknown_reduction_is_an_error():
    with pytest.raises(ValueError, match="state_mean"):
        reduce_question_losses(jnp.zeros((1, 1)), jnp.ones((1, 1), bool), "mean")


def test_combine_weighs_objectives_and_refuses_a_weighted_objective_that_is_missing():
    weights = {"tokens": 1.0, "branches": 0.5, "drafter": 0.0}
    assert float(combine({"tokens": jnp.array(2.0), "branches": jnp.array(4.0)}, weights)) == 4.0
    with pytest.raises(ValueError, match="branches"):
        combine({"tokens": jnp.array(2.0)}, weights)
    with pytest.raises(ValueError, match="no loss weight"):
        combine({"tokens": jnp.array(2.0), "extra": jnp.array(1.0)}, {"tokens": 1.0})
