"""`transformer.per_layer` / `run.handle.decoding_layout`: a `scan_layers` model's stacked decoder weights laid
out per layer for decoding (each decode step would otherwise copy every layer's slice out of the stack: 2.1x
slower on an H200). The same weights must give the same model: logits of a forward pass and the engine's greedy
tokens equal to the stacked layout's, for plain, LoRA and QLoRA (NF4) decoders, on an 8-device mesh where the
split leaves keep the unscanned model's shardings."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

from tests.train_runs import ROOT, env_with_devices
from valen_jax.decoding import generate_ids
from valen_jax.decoding.sampling import Sampling
from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig
from valen_jax.models.lora import LoraConfig
from valen_jax.models.transformer import PerLayer, Transformer, per_layer

VOCAB = 97


def _perturbed(params, only: str = ""):
    """Every floating leaf whose path holds `only` plus small noise (adapters start at B = 0, so a LoRA model
    would otherwise equal its base; NF4 codes are integers and stay as quantised). The noise is keyed by a
    stable hash of the path: Python's `hash` of a str changes per process, which made the weights, and so
    a near-tie between two greedy tokens of the two layouts, differ from run to run (1 run in ~15 failed)."""
    key = jax.random.key(1)

    def perturb(path, leaf):
        if only not in jax.tree_util.keystr(path) or not np.issubdtype(leaf.dtype, np.floating):
            return leaf
        noise = jax.random.normal(jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()) % 2**31), leaf.shape)
        return leaf + 0.05 * noise.astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(perturb, params)


@pytest.mark.parametrize("lora", [pytest.param(None, marks=pytest.mark.slow),
                                  pytest.param(LoraConfig(rank=4), marks=pytest.mark.slow),
                                  LoraConfig(rank=4, quantize_base="nf4")], ids=["plain", "lora", "qlora"])
def test_per_layer_decodes_like_the_stacked_layout(lora):
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                      scan_layers=True, lora=lora)
    graphdef, state = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    params = _perturbed(params, "" if lora is None else "lora")
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    flat_cfg, flat_graphdef, flat = per_layer(cfg, params, mesh)
    assert not flat_cfg.scan_layers and dataclasses.replace(flat_cfg, scan_layers=True) == cfg
    assert sorted(flat["layers"]) == list(range(cfg.num_layers))
    for i in range(cfg.num_layers):  # layer i's leaves are slice i of the stack, on the unscanned shardings
        jax.tree.map(lambda stacked, one, i=i: np.testing.assert_array_equal(np.asarray(stacked)[i], np.asarray(one)),
                     params["layers"], flat["layers"][i])

    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (2, 11)).astype(np.int32)
    positions, segments = np.tile(np.arange(11, dtype=np.int32), (2, 1)), np.ones((2, 11), np.int32)
    stacked_logits, flat_logits = (nnx.merge(g, nnx.State(p))(ids, positions, segments)
                                   for g, p in ((graphdef, params), (flat_graphdef, flat)))
    np.testing.assert_allclose(np.asarray(flat_logits), np.asarray(stacked_logits), atol=1e-5, rtol=1e-5)
    assert float(np.std(np.asarray(stacked_logits))) > 1e-3  # the weights do something

    prompts = [{"ids": rng.integers(0, VOCAB, n).astype(np.int32), "positions": np.arange(n, dtype=np.int32)}
               for n in (5, 9, 14)]
    stacked_tokens = generate_ids(params, graphdef, prompts, max_new_tokens=8, stop_ids=(), vocab=VOCAB)
    flat_tokens = generate_ids(flat, flat_graphdef, prompts, max_new_tokens=8, stop_ids=(), vocab=VOCAB)
    assert flat_tokens == stacked_tokens
    assert len({tuple(t) for t in stacked_tokens}) > 1  # the prompts matter


@pytest.mark.slow
def test_a_splitter_compiles_once_and_splits_the_params_it_is_given():
    """A reinforcement run splits its policy before every rollout (`tasks.reinforce`): the split program must
    compile once, split the params of the moment (not those it first saw), and sample as the stacked layout."""
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                      scan_layers=True)
    graphdef, state = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    first = nnx.to_pure_dict(state)
    split = PerLayer(cfg, sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1]))
    prompts = [{"ids": np.arange(3, 3 + n, dtype=np.int32), "positions": np.arange(n, dtype=np.int32)}
               for n in (4, 7)]
    sampled = []
    for params in (first, _perturbed(first)):
        flat = split(params)
        jax.tree.map(lambda stacked, one: np.testing.assert_array_equal(np.asarray(stacked)[1], np.asarray(one)),
                     params["layers"], flat["layers"][1])
        draws = [generate_ids(p, g, prompts, max_new_tokens=6, stop_ids=(), vocab=VOCAB,
                              sampling=Sampling(temperature=1.0), seed=3)
                 for p, g in ((params, graphdef), (flat, split.graphdef))]
        assert draws[0] == draws[1]
        sampled.append(draws[0])
    assert sampled[0] != sampled[1]  # the second split decoded the perturbed weights
    assert split._take._cache_size() == 1


def test_per_layer_refuses_leaves_that_are_not_stacked_layers():
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                      scan_layers=True)
    params = nnx.to_pure_dict(nnx.split(Transformer(cfg, nnx.Rngs(0)))[1])
    params["layers"]["attn"]["q"] = params["layers"]["attn"]["q"][:1]
    with pytest.raises(ValueError, match="not 2 layers of the unscanned model"):
        per_layer(cfg, params, sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1]))


SHARDED = r"""
import json
import jax
from flax import nnx
from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import Transformer, abstract_model, per_layer

cfg = ModelConfig(vocab_size=96, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                  scan_layers=True)
mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
graphdef, abstract = abstract_model(cfg)
stacked = jax.device_put(nnx.to_pure_dict(nnx.split(Transformer(cfg, nnx.Rngs(0)))[1]),
                         nnx.to_pure_dict(sharding.state_shardings(abstract, mesh)))
flat_cfg, _, flat = per_layer(cfg, stacked, mesh)
wanted = nnx.to_pure_dict(sharding.state_shardings(abstract_model(flat_cfg)[1], mesh))["layers"]
got = jax.tree.map(lambda leaf: leaf.sharding, flat["layers"])
print(json.dumps({"same": jax.tree.all(jax.tree.map(lambda a, b: a.is_equivalent_to(b, 3), got, wanted)),
                  "q_split": sorted({s.data.shape for s in flat["layers"][1]["attn"]["q"].addressable_shards})}))
"""


def test_per_layer_leaves_take_the_unscanned_shardings_on_eight_devices():
    done = subprocess.run([sys.executable, "-c", SHARDED], cwd=ROOT, env=env_with_devices(8), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["same"]
    assert report["q_split"] == [[32, 2, 16]]  # [embed/fsdp, heads/tensor, head_dim]: split, not replicated
