"""The token-tiled training loss (issue 14): same sums and gradients as the untiled forms, chunk by chunk."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.train_runs import ROOT, env_with_devices
from valen_jax.training import losses
from valen_jax.training.losses import default_chunk_length, head_token_losses, token_losses

SUMS = ("ce", "z", "weight", "correct")


def _problem(dtype, batch=2, length=11, dim=16, vocab=37, seed=5):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((batch, length, dim)), dtype)
    head = jnp.asarray(rng.standard_normal((dim, vocab)) * 0.5, dtype)
    targets = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    weights = jnp.asarray(rng.random((batch, length)) * (rng.random((batch, length)) > 0.3), jnp.float32)
    return hidden, head, targets, weights


def _grads(losses_of, hidden, head):
    # A z-loss coefficient and a denominator, as step.py uses them: both cotangents are non-trivial.
    def total(h, w):
        sums = losses_of(h, w)
        return sums["ce"] / 7.0 + 0.25 * sums["z"] / 7.0, sums

    return jax.jit(jax.grad(total, argnums=(0, 1), has_aux=True))(hidden, head)


def _autodiff(targets, weights):
    def of(h, w):
        logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        return token_losses(logits, targets, weights)
    return of


def _assert_close(got, want, tol):
    (got_h, got_w), got_sums = got
    (want_h, want_w), want_sums = want
    for name in SUMS:
        np.testing.assert_allclose(got_sums[name], want_sums[name], rtol=tol, err_msg=name)
    np.testing.assert_allclose(np.asarray(got_h, np.float32), np.asarray(want_h, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got_w, np.float32), np.asarray(want_w, np.float32), rtol=tol, atol=tol)


# 11 positions: chunks of 4 leave a last chunk of 3, 1 is every position alone, 11 is one chunk.
@pytest.mark.parametrize("chunk", [1, 4, 11])
def test_tiled_loss_equals_the_one_chunk_form_and_autodiff_in_f32(chunk):
    hidden, head, targets, weights = _problem(jnp.float32)
    tiled = _grads(lambda h, w: head_token_losses(h, w, targets, weights, chunk_length=chunk), hidden, head)
    one_chunk = _grads(lambda h, w: head_token_losses(h, w, targets, weights, chunk_length=11), hidden, head)
    _assert_close(tiled, one_chunk, 1e-5)
    _assert_close(tiled, _grads(_autodiff(targets, weights), hidden, head), 1e-5)
    (d_hidden, d_head), _ = tiled
    assert d_hidden.dtype == hidden.dtype and d_head.dtype == head.dtype


def test_tiled_loss_in_bf16_is_within_bf16_rounding_of_autodiff():
    # bf16 hidden/head: each chunk's softmax − one-hot is rounded to bf16 before its two matmuls
    # (as the one-chunk form does); d_head adds chunks in f32. 2e-2 is bf16's ~3 significant digits
    # after a 16-term dot product.
    hidden, head, targets, weights = _problem(jnp.bfloat16, length=13)
    tiled = _grads(lambda h, w: head_token_losses(h, w, targets, weights, chunk_length=5), hidden, head)
    _assert_close(tiled, _grads(_autodiff(targets, weights), hidden, head), 2e-2)
    (d_hidden, d_head), _ = tiled
    assert d_hidden.dtype == jnp.bfloat16 and d_head.dtype == jnp.bfloat16


def test_forward_without_gradients_gives_the_same_sums():
    hidden, head, targets, weights = _problem(jnp.float32)
    def sums(chunk):
        return jax.jit(lambda *args: head_token_losses(*args, chunk_length=chunk))(hidden, head, targets, weights)

    got, want = sums(4), sums(11)
    for name in SUMS:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6)


def test_default_chunk_keeps_one_chunk_of_logits_within_the_budget():
    vocab = 151_936  # Qwen2.5
    positions = default_chunk_length(1, 32_768, vocab)
    assert positions * vocab * 4 <= losses.CHUNK_BYTES
    assert positions >= 64 and positions % 8 == 0
    # A problem whose whole logits fit the single-chunk budget takes one chunk (no loop).
    assert default_chunk_length(8, 512, 32_000) == 512
    assert default_chunk_length(2, 7, 37) == 7
    with pytest.raises(ValueError, match="chunk_length must be ≥ 1"):
        head_token_losses(*_problem(jnp.float32), chunk_length=0)


def test_compiled_backward_holds_one_chunk_of_logits_not_all():
    # 4096 tokens × 8192 classes: 128 MiB of f32 logits in the one-chunk form. Tiled by 256
    # positions, the compiled gradient's temporaries must stay far below one whole logits array.
    hidden, head, targets, weights = (jax.ShapeDtypeStruct((1, 4096, 32), jnp.float32),
                                      jax.ShapeDtypeStruct((32, 8192), jnp.float32),
                                      jax.ShapeDtypeStruct((1, 4096), jnp.int32),
                                      jax.ShapeDtypeStruct((1, 4096), jnp.float32))
    full = 4096 * 8192 * 4

    def temp_bytes(chunk):
        def loss(h, w, t, wt):
            return head_token_losses(h, w, t, wt, chunk_length=chunk)["ce"]
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, head, targets, weights).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(4096) >= full  # the one-chunk form keeps the logits for its backward
    assert temp_bytes(256) < full // 8


SHARDED = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from valen_jax.models import sharding
from valen_jax.training.losses import head_token_losses

mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
rng = np.random.default_rng(0)
hidden = rng.standard_normal((4, 10, 16)).astype(np.float32)
head = (rng.standard_normal((16, 64)) * 0.5).astype(np.float32)
targets = rng.integers(0, 64, (4, 10)).astype(np.int32)
weights = rng.random((4, 10)).astype(np.float32)

def grads(chunk):
    def total(h, w, t, wt):
        sums = head_token_losses(h, w, t, wt, chunk_length=chunk)
        return sums["ce"] + 0.1 * sums["z"], sums
    return jax.grad(total, argnums=(0, 1), has_aux=True)

want = jax.jit(grads(10))(hidden, head, targets, weights)
rows = NamedSharding(mesh, P(("data", "fsdp")))
with jax.set_mesh(mesh):
    args = (jax.device_put(hidden, rows), jax.device_put(head, NamedSharding(mesh, P(None, "tensor"))),
            jax.device_put(targets, rows), jax.device_put(weights, rows))
    got = jax.jit(grads(3))(*args)
diff = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), got, want)
print(json.dumps({"max_diff": max(jax.tree.leaves(diff)), "shards": len(got[0][0].sharding.device_set)}))
"""


def test_tiled_loss_on_a_sharded_batch_and_vocabulary_matches_one_device():
    # 8 simulated devices: rows over data × fsdp, the vocabulary over tensor; chunks of 3 of 10 positions.
    done = subprocess.run([sys.executable, "-c", SHARDED], cwd=ROOT, env=env_with_devices(8), capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shards"] == 8 and result["max_diff"] < 1e-5
