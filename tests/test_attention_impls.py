"""Every attention implementation available on CPU equals the dense reference (values and gradients)
for every mask kind the model uses, and the model path builds its masks from ids (issue 14)."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.train_runs import ROOT, env_with_devices
from valen_jax.models import attention
from valen_jax.models.attention_blockwise import blockwise_attention
from valen_jax.models.attention_flash import flash_attention
from valen_jax.models.config import ModelConfig, VisionConfig
from valen_jax.models.qwen_vision import QwenVisionEncoder, cell_segments
from valen_jax.models.transformer import Transformer

# Small tiles so every case crosses several tiles (and ragged last ones) at T ≤ 64.
IMPLS = {
    "blockwise": functools.partial(blockwise_attention, chunk=16),
    "flash": functools.partial(flash_attention, block=16),
    "flash_one_tile": flash_attention,  # default block: the whole short row in one tile
}
ONE_TILE_CASES = (1, 4)  # the one-tile flash on a causal packed row and a bidirectional one suffices


def _ids(kind, length):
    """(segment_ids [2, T], branch_ids or None) for one mask kind."""
    seg = np.ones((2, length), np.int32)
    branch = None
    if kind == "packed":  # three packed examples then padding; second row full
        seg[0] = 0
        for s, (a, b) in enumerate([(0, 7), (7, 30), (30, length - 5)], start=1):
            seg[0, a:b] = s
    elif kind == "ragged":  # different real lengths, tail padding
        seg[0, length - 13:] = 0
        seg[1, 3:] = 0
    elif kind == "branches":  # Valen rows: prefix, three branches; second row two records with trees
        branch = np.zeros((2, length), np.int32)
        bounds = np.linspace(length // 4, length - 4, 4).astype(int)
        for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), start=1):
            branch[0, lo:hi] = b
        seg[0, length - 4:] = 0
        seg[1, length // 2:] = 2
        branch[1, 10:14], branch[1, 14:20] = 1, 2
        branch[1, length // 2 + 5:length // 2 + 9] = 1
        branch = jnp.asarray(branch)
    return jnp.asarray(seg), branch


def _inputs(length, heads, kv_heads, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(2, length, heads, head_dim), (2, length, kv_heads, head_dim), (2, length, kv_heads, head_dim)]
    return [jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype) for s in shapes]


def _value_and_grads(fn, q, k, v):
    probe = jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32))

    def objective(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    # Jitted: one compile costs a fraction of eager mode's per-operation compiles of the unrolled blocks.
    (_, out), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


CASES = [  # (mask kind, causal, T, N, K, H)
    ("causal", True, 64, 4, 4, 16),
    ("packed", True, 50, 4, 2, 8),  # GQA, T not a multiple of the tile
    ("ragged", True, 37, 6, 1, 8),  # MQA, ragged padding
    ("branches", True, 48, 4, 2, 8),
    ("packed", False, 50, 4, 2, 8),  # vision: bidirectional within a segment
    ("ragged", False, 37, 2, 2, 16),
]


@functools.cache
def _reference_case(case):
    """Inputs, ids and the reference's values and gradients of one case, computed once for every implementation."""
    kind, causal, length, heads, kv_heads, head_dim = CASES[case]
    q, k, v = _inputs(length, heads, kv_heads, head_dim, jnp.float32)
    seg, branch = _ids(kind, length)
    want = _value_and_grads(functools.partial(attention.reference, segment_ids=seg, branch_ids=branch,
                                              causal=causal), q, k, v)
    return (q, k, v), (seg, branch), want


@pytest.mark.parametrize("impl,case", [(impl, case) for impl in sorted(IMPLS) for case in range(len(CASES))
                                       if impl != "flash_one_tile" or case in ONE_TILE_CASES])
def test_implementation_equals_reference_f32(impl, case):
    (q, k, v), (seg, branch), (want, want_grads) = _reference_case(case)
    causal = CASES[case][1]
    got, got_grads = _value_and_grads(lambda q, k, v: IMPLS[impl](q, k, v, seg, branch, causal=causal), q, k, v)
    assert got.dtype == jnp.float32 and got.shape == q.shape
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["blockwise", "flash"])
@pytest.mark.parametrize("kind,causal", [("branches", True), ("packed", False)])
def test_implementation_in_bfloat16_follows_the_f32_reference(impl, kind, causal):
    # bf16 inputs: scores, softmax and accumulation stay f32, probabilities are rounded to bf16 for the
    # P·V product (as cuDNN/FlashAttention do), so outputs and gradients stay within a few bf16 ulps
    # of magnitude-1 values: 2e-2 absolute.
    q, k, v = _inputs(48, 4, 2, 8, jnp.bfloat16, seed=3)
    seg, branch = _ids(kind, 48)
    want, want_grads = _value_and_grads(
        lambda q, k, v: attention.reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                            seg, branch, causal=causal), q, k, v)
    got, got_grads = _value_and_grads(lambda q, k, v: IMPLS[impl](q, k, v, seg, branch, causal=causal), q, k, v)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-2, rtol=2e-2)


def test_flash_keeps_branches_apart():
    # Changing branch 3's keys and values leaves every other position's output bit-identical.
    q, k, v = _inputs(48, 4, 2, 8, jnp.float32, seed=1)
    seg, branch = _ids("branches", 48)
    third = np.asarray(branch[0]) == 3
    k2, v2 = k.at[0, third].add(1.0), v.at[0, third].add(1.0)
    before = flash_attention(q, k, v, seg, branch, causal=True, block=16)
    after = flash_attention(q, k2, v2, seg, branch, causal=True, block=16)
    np.testing.assert_array_equal(np.asarray(after)[0, ~third], np.asarray(before)[0, ~third])
    assert not np.allclose(np.asarray(after)[0, third], np.asarray(before)[0, third])


def test_auto_resolves_by_backend_and_length_and_logs_once(caplog):
    attention._logged.clear()
    with caplog.at_level(logging.INFO, logger="valen_jax.models.attention"):
        assert attention.resolve("auto", 512) == "blockwise"
        assert attention.resolve("auto", 512) == "blockwise"
        assert attention.resolve("auto", attention.CPU_BLOCKWISE_MAX_LENGTH + 1) == "flash"
    assert len([r for r in caplog.records if "config.model.attention=auto" in r.message]) == 2
    assert attention.resolve("flash", 512) == "flash"
    with pytest.raises(ValueError, match="config.model.attention='dense'"):
        attention.resolve("dense", 512)


def test_auto_on_gpu_gives_cudnn_only_what_its_packed_layout_expresses(monkeypatch):
    monkeypatch.setattr(attention, "target_platform", lambda: "gpu")
    bf16 = jnp.bfloat16
    assert attention.choose("auto", 4096, bf16, causal=True, branches=False) == "cudnn"  # decoder rows
    assert attention.choose("auto", 4096, jnp.float32, causal=True, branches=False) == "flash"
    assert attention.choose("auto", 4096, bf16, causal=True, branches=True) == "flash"  # Valen trees
    assert attention.choose("auto", 4096, bf16, causal=False, branches=False) == "flash"  # vision windows
    assert attention.choose("cudnn", 4096, bf16, causal=False, branches=False) == "cudnn"  # explicit: kept
    monkeypatch.setattr(attention, "target_platform", lambda: "tpu")
    assert attention.choose("auto", 4096, bf16, causal=False, branches=True) == "splash"


def test_cell_segments_equal_ids_exactly_where_the_frame_and_window_mask_allows():
    # Two items (the second a 2-frame clip) and padding; windows of 2 patches a side.
    rng = np.random.default_rng(0)
    seg = np.array([[1] * 16 + [2] * 18 + [0] * 6])
    t = np.concatenate([np.zeros(16), np.repeat([0, 1], 9), np.zeros(6)]).astype(np.int32)
    h = np.concatenate([np.repeat(np.arange(4), 4), np.tile(np.repeat(np.arange(3), 3), 2), rng.integers(0, 9, 6)])
    w = np.concatenate([np.tile(np.arange(4), 4), np.tile(np.tile(np.arange(3), 3), 2), rng.integers(0, 9, 6)])
    positions = jnp.asarray(np.stack([t, h, w], axis=-1)[None], jnp.int32)
    for window in (0, 2):
        ids = np.asarray(cell_segments(positions, jnp.asarray(seg, jnp.int32), window))[0]
        same = (seg[0][:, None] == seg[0][None]) & (seg[0][:, None] > 0) & (t[:, None] == t[None])
        if window:
            same &= (h[:, None] // window == h[None] // window) & (w[:, None] // window == w[None] // window)
        np.testing.assert_array_equal((ids[:, None] == ids[None]) & (ids[:, None] > 0), same)
        assert (ids[seg[0] == 0] == 0).all()


def _shapes_in(jaxpr):
    """Every intermediate's (shape, dtype) in a jaxpr and all its sub-jaxprs (scan, while, cond, custom_vjp)."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval.shape, var.aval.dtype
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):  # a Jaxpr (or a ClosedJaxpr's)
                    yield from _shapes_in(inner)


def test_decoder_forward_with_flash_never_builds_a_length_by_length_mask():
    length = 256  # two flash tiles: a [T, T] array could only be a whole-row mask
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                      attention="flash")
    graph, state = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    tokens = jnp.zeros((1, length), jnp.int32)
    segments = jnp.concatenate([jnp.ones((1, 200), jnp.int32), jnp.zeros((1, 56), jnp.int32)], axis=1)
    branches = jnp.zeros((1, length), jnp.int32)

    def forward(state):
        return nnx.merge(graph, state)(tokens, jnp.broadcast_to(jnp.arange(length), (1, length)), segments,
                                       branch_ids=branches)

    shapes = list(_shapes_in(jax.make_jaxpr(forward)(state).jaxpr))
    assert any(dtype == jnp.bool_ and shape[-2:] == (128, 128) for shape, dtype in shapes)  # tile masks exist
    square = [(shape, dtype) for shape, dtype in shapes if shape[-2:] == (length, length)]
    assert not square, square


def test_windowed_vision_tower_with_flash_never_builds_a_patch_by_patch_array():
    # Qwen2.5-VL: window blocks and full blocks; one 16 x 16 image and padding, 256 patches.
    cfg = VisionConfig(patch_size=2, merge_size=2, temporal_patch_size=1, dim=32, num_layers=2, num_heads=2,
                       mlp_dim=32, family="qwen2_5_vl", hidden_act="silu", window_size=8, fullatt_blocks=(1,))
    graph, state = nnx.split(QwenVisionEncoder(cfg, 16, "float32", "float32", nnx.Rngs(0), attention="flash"))
    count = 256
    grid = np.stack(np.meshgrid(np.arange(15), np.arange(15), indexing="ij"), -1).reshape(-1, 2)[:count - 32]
    positions = np.zeros((1, count, 3), np.int32)
    positions[0, :len(grid), 1:] = grid
    segments = (np.arange(count) < len(grid)).astype(np.int32)[None]
    patches = jnp.zeros((1, count, cfg.patch_dim), jnp.float32)

    def forward(state):
        return nnx.merge(graph, state)(patches, jnp.asarray(positions), jnp.asarray(segments))

    shapes = list(_shapes_in(jax.make_jaxpr(forward)(state).jaxpr))
    assert any(dtype == jnp.bool_ and shape[-2:] == (128, 128) for shape, dtype in shapes)
    square = [(shape, dtype) for shape, dtype in shapes if shape[-2:] == (count, count)]
    assert not square, square


def test_decoder_logits_are_the_same_with_every_cpu_implementation():
    # config.model.attention reaches every layer: same parameters, same rows, same logits.
    seg, branch = _ids("branches", 48)
    positions = jnp.broadcast_to(jnp.arange(48), (2, 48))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 48)), jnp.int32)
    logits = {}
    for impl in ("blockwise", "flash"):
        cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                          attention=impl)
        model = Transformer(cfg, nnx.Rngs(0))
        assert all(layer.attn.implementation == impl for layer in model.layers)
        graph, state = nnx.split(model)
        logits[impl] = jax.jit(lambda s, g=graph: nnx.merge(g, s)(tokens, positions, seg, branch_ids=branch))(state)
    np.testing.assert_allclose(logits["flash"], logits["blockwise"], atol=1e-5, rtol=1e-5)


def test_an_unknown_implementation_is_refused_by_name():
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                      attention="dense")
    with pytest.raises(ValueError, match="attention implementation 'dense'"):
        Transformer(cfg, nnx.Rngs(0))


SHARDED_FLASH = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import abstract_model, init_params

cfg = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                  attention="flash")
mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
graphdef, abstract = abstract_model(cfg)
params = init_params(cfg, 0, nnx.to_pure_dict(sharding.state_shardings(abstract, mesh)))
local = jax.device_put(params, jax.devices()[0])
rng = np.random.default_rng(0)
tokens = rng.integers(0, 256, (8, 40)).astype(np.int32)
positions = np.tile(np.arange(40, dtype=np.int32), (8, 1))
segments = np.repeat(np.array([[1] * 15 + [2] * 20 + [0] * 5]), 8, axis=0).astype(np.int32)
branches = np.zeros((8, 40), np.int32); branches[:, 5:10], branches[:, 10:15] = 1, 2

def loss(p, t, pos, s, b):
    return jnp.mean(nnx.merge(graphdef, p)(t, pos, s, branch_ids=b) ** 2)

grad = jax.value_and_grad(loss)
want, want_grads = jax.jit(grad)(local, tokens, positions, segments, branches)
batch = sharding.global_batch({"t": tokens, "p": positions, "s": segments, "b": branches}, mesh)
with jax.set_mesh(mesh):
    got, got_grads = jax.jit(grad)(params, batch["t"], batch["p"], batch["s"], batch["b"])
diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(np.asarray(a) - np.asarray(b)))), got_grads, want_grads)
print(json.dumps({"loss_diff": abs(float(got) - float(want)), "grad_diff": max(jax.tree.leaves(diffs))}))
"""


@pytest.mark.slow  # a subprocess with 8 simulated devices: ~20 s of compiles
def test_flash_on_a_data_fsdp_tensor_mesh_equals_one_device():
    # The tiles' reshapes and loops must partition under the model's shardings (rows over data x fsdp,
    # heads over tensor) without changing the loss or its gradients.
    result = subprocess.run([sys.executable, "-c", SHARDED_FLASH], cwd=ROOT, env=env_with_devices(8),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loss_diff"] < 1e-6 and report["grad_diff"] < 1e-5, report


def test_flash_gradient_memory_is_linear_in_length():
    # Compile (not run) the attention gradient: flash keeps O(T) residuals (output and log-sum-exp) and
    # O(tile²) scratch, so its temp memory about doubles with T and stays far below one layer's [N, T, T]
    # f32 scores (blockwise: 314 MiB at 2k, 1124 MiB at 4k for this shape; flash 30 and 58).
    heads, kv_heads, head_dim = 14, 2, 64  # Qwen2.5-0.5B's attention

    def temp_bytes(length):
        q = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, length, kv_heads, head_dim), jnp.bfloat16)
        seg = jax.ShapeDtypeStruct((1, length), jnp.int32)

        def loss(q, k, v, s):
            return jnp.sum(flash_attention(q, k, v, s, causal=True).astype(jnp.float32))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    short, long = temp_bytes(1024), temp_bytes(2048)
    assert long < 2.3 * short, (short, long)
    assert long < heads * 2048 * 2048 * 4 / 4, long


def _abstract_mesh(platform: str):
    """A mesh of 4 devices of `platform` as tracing sees it (no such device needed here)."""
    from jax._src.mesh import AbstractDevice  # the public AbstractMesh takes one; JAX exports no constructor

    return jax.sharding.AbstractMesh((4,), ("data",), abstract_device=AbstractDevice(
        device_kind=f"{platform} device", num_cores=None, platform=platform))


@pytest.mark.parametrize("platform, chosen", [("tpu", "splash"), ("gpu", "cudnn"), ("cpu", "blockwise")])
def test_auto_follows_the_mesh_being_traced_for_not_the_host(platform, chosen):
    """Choices by target (DESIGN): a step traced under a TPU mesh (an ahead-of-time compile from this CPU
    host) gets the TPU's kernel, inside jit too; with no mesh, the host's backend decides."""
    from valen_jax.models.platform import target_platform

    assert target_platform() == jax.default_backend() == "cpu"
    with jax.sharding.use_abstract_mesh(_abstract_mesh(platform)):
        assert target_platform() == platform
        assert attention.resolve("auto", 4096) == chosen
        traced = []
        jax.make_jaxpr(lambda x: traced.append(target_platform()) or x)(1.0)
        assert traced == [platform]
    assert attention.resolve("auto", 4096) == "blockwise"


def test_remat_offload_is_judged_on_the_target_platform():
    from valen_jax.errors import ConfigError
    from valen_jax.models.remat import check_offload

    with jax.sharding.use_abstract_mesh(_abstract_mesh("tpu")):
        check_offload()  # a TPU target offloads; this CPU host would not
    with pytest.raises(ConfigError, match="which the cpu backend does not do"):
        check_offload()
