"""The accelerator kernels equal the reference attention: splash in Pallas interpret mode on CPU (values
and gradients: packed causal rows, bidirectional segments, a Valen branch tree through the two-pass
log-sum-exp merge, GQA, a length that is not a tile multiple), and cuDNN's packed layout as far as a CPU
can check it (offsets and lengths from segment ids, rows it cannot describe flagged, clear refusals)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from valen_jax.models.attention import reference
from valen_jax.models.attention_accel import (
    CUDNN_MAX_SEGMENTS,
    cudnn_attention,
    segment_layout,
    splash_attention,
    splash_block,
)

# 120 tokens: not a multiple of the 128 tile, so the padding of the row to the tile is exercised too.
LENGTH, HEADS, KV_HEADS, HEAD_DIM = 120, 4, 2, 64


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    shape_q, shape_kv = (2, LENGTH, HEADS, HEAD_DIM), (2, LENGTH, KV_HEADS, HEAD_DIM)
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (shape_q, shape_kv, shape_kv))


def _segments():
    # Row 0: two packed examples then padding; row 1: one example, padding at the end.
    segments = np.zeros((2, LENGTH), np.int32)
    segments[0, :40], segments[0, 40:100], segments[1, :112] = 1, 2, 1
    return jnp.asarray(segments)


def _branches():
    # Each example: a shared prefix (0) then branches; row 0's second example reuses branch id 1,
    # which must not see the first example's branch 1 (different segment).
    branches = np.zeros((2, LENGTH), np.int32)
    branches[0, 10:25], branches[0, 25:40], branches[0, 60:80], branches[0, 80:100] = 1, 2, 1, 3
    branches[1, 50:90], branches[1, 90:112] = 1, 2
    return jnp.asarray(branches)


def _value_and_grads(fn, q, k, v):
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * jnp.cos(out)), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


# Interpret mode costs several CPU seconds a case: one in the fast tier, the others with the slow tests.
@pytest.mark.parametrize("case", [
    pytest.param("causal_packed", marks=pytest.mark.slow), "bidirectional_packed",
    pytest.param("branch_tree", marks=pytest.mark.slow), pytest.param("branch_tree_bf16", marks=pytest.mark.slow)])
def test_splash_interpret_equals_reference(case):
    q, k, v = _inputs()
    bf16 = case.endswith("_bf16")
    if bf16:
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    segments = _segments()
    branches = _branches() if case.startswith("branch_tree") else None
    causal = case != "bidirectional_packed"
    want, want_grads = _value_and_grads(lambda q, k, v: reference(q, k, v, segments, branches, causal=causal), q, k, v)
    got, got_grads = _value_and_grads(
        lambda q, k, v: splash_attention(q, k, v, segments, branches, causal=causal, interpret=True), q, k, v)
    assert got.dtype == q.dtype and all(g.dtype == q.dtype for g in got_grads)
    # bf16: a few units in the last place (the reference rounds once from f32, the kernel per step).
    tol = 2e-2 if bf16 else 1e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=2 * tol, rtol=2 * tol, err_msg=f"d{name}")
    if branches is not None and not bf16:
        # The tree changes the answer (a test that a branch-blind kernel would fail).
        plain = reference(q, k, v, segments, None, causal=True)
        assert float(jnp.max(jnp.abs(plain - want))) > 1e-2


def test_splash_block_from_length():
    assert [splash_block(n) for n in (1, 120, 128, 300, 512, 4096)] == [128, 128, 128, 384, 512, 512]


def test_splash_refuses_a_backend_without_tpu():
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match="config.model.attention='splash' is the TPU Pallas kernel"):
        splash_attention(q, k, v, _segments(), causal=True)


def test_segment_layout_offsets_and_lengths():
    segments = jnp.asarray([[1, 1, 2, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
    offsets, lengths, undescribed = segment_layout(segments, max_segments=3)
    np.testing.assert_array_equal(offsets, [[0, 2, -1, -1], [0, -1, -1, -1], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(lengths, [[2, 3, -1], [8, -1, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(undescribed, [False, False, False])
    # A short row's bound is the most runs it can hold (1, 0, 2, 0, ...).
    offsets, lengths, undescribed = segment_layout(jnp.asarray([[1, 0, 2, 0, 3]], jnp.int32))
    np.testing.assert_array_equal(offsets, [[0, 2, 4, -1]])
    np.testing.assert_array_equal(lengths, [[1, 1, 1]])
    assert not bool(undescribed[0])
    # A long row: CUDNN_MAX_SEGMENTS runs fit, one more is flagged.
    runs = np.zeros((2, 2 * (CUDNN_MAX_SEGMENTS + 1)), np.int32)
    runs[0, : 2 * CUDNN_MAX_SEGMENTS : 2] = np.arange(1, CUDNN_MAX_SEGMENTS + 1)
    runs[1, ::2] = np.arange(1, CUDNN_MAX_SEGMENTS + 2)
    offsets, _, undescribed = segment_layout(jnp.asarray(runs))
    assert offsets.shape == (2, CUDNN_MAX_SEGMENTS + 1)
    np.testing.assert_array_equal(undescribed, [False, True])


def test_segment_layout_flags_rows_it_cannot_describe():
    rows = jnp.asarray([[1, 2, 3, 4, 0, 0], [1, 1, 2, 2, 1, 1], [1, 1, 2, 2, 0, 0]], jnp.int32)
    _, _, undescribed = segment_layout(rows, max_segments=3)
    # Four runs over a bound of three; segment 1 split in two runs; a row that fits.
    np.testing.assert_array_equal(undescribed, [True, True, False])


def test_cudnn_refusals_name_the_setting():
    q, k, v = _inputs()
    with pytest.raises(NotImplementedError, match="does not take Valen branch trees"):
        cudnn_attention(q, k, v, _segments(), _branches(), causal=True)
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="needs a CUDA GPU with cuDNN"):
            cudnn_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                            _segments(), causal=True)


def test_auto_on_gpu_runs_branch_trees_with_flash(monkeypatch):
    # auto picks cudnn on a GPU, which refuses branch trees; a Valen row must run flash instead.
    from valen_jax.models import attention
    from valen_jax.models.attention_flash import flash_attention

    monkeypatch.setattr(attention, "target_platform", lambda: "gpu")
    q, k, v = (x[:, :32].astype(jnp.bfloat16) for x in _inputs())
    segments, branches = _segments()[:, :32], _branches()[:, :32]
    got = attention.attend(q, k, v, segments, branches, causal=True, implementation="auto")
    np.testing.assert_array_equal(got, flash_attention(q, k, v, segments, branches, causal=True))


_SHARDED_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from tests.test_attention_accel import _branches, _inputs, _segments, _value_and_grads
from valen_jax.models import sharding
from valen_jax.models.attention import reference
from valen_jax.models.attention_accel import splash_attention
q, k, v = _inputs()
segments, branches = _segments(), _branches()
want, want_grads = _value_and_grads(lambda q, k, v: reference(q, k, v, segments, branches, causal=True), q, k, v)
mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2})
with jax.set_mesh(mesh):
    traced = jax.make_jaxpr(lambda q: splash_attention(q, k, v, segments, branches, causal=True, interpret=True))(q)
    assert "shard_map" in str(traced), "the kernel must run per shard"
    got, got_grads = jax.jit(lambda q, k, v: _value_and_grads(
        lambda q, k, v: splash_attention(q, k, v, segments, branches, causal=True, interpret=True), q, k, v))(q, k, v)
np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
for g, w in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)
print("sharded splash ok")
"""


@pytest.mark.slow  # ~40 s here: a fresh process with 4 simulated devices, the Pallas interpreter per shard
def test_splash_runs_per_shard_on_a_mesh():
    # Rows over data, heads over tensor (4 and 2 heads split in 2): the kernel runs in a shard_map.
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _SHARDED_CHECK], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "sharded splash ok" in done.stdout, done.stderr[-3000:]


def test_cudnn_arguments_pass_jax_cudnn_checks(monkeypatch):
    # No GPU here: pretend one (cuDNN 9.10, Hopper) so the call goes through JAX's own layout/dtype
    # checks of the packed layout, forward and backward, down to abstract shapes (nothing is lowered).
    from jax._src.cudnn import fused_attention_stablehlo as fused

    from valen_jax.models import attention_accel

    monkeypatch.setattr(attention_accel, "target_platform", lambda: "gpu")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)
    q = jax.ShapeDtypeStruct((2, 128, HEADS, HEAD_DIM), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 128, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    for causal in (True, False):
        def loss(q, k, v, s, causal=causal):
            return jnp.sum(cudnn_attention(q, k, v, s, causal=causal).astype(jnp.float32))
        grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, segments)
        assert [(g.shape, g.dtype) for g in grads] == [(x.shape, jnp.bfloat16) for x in (q, kv, kv)]
