"""Logical-axis sharding on 8 simulated devices (run in a subprocess: XLA_FLAGS precede jax)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.train_runs import ROOT, env_with_devices
from valen_jax.models.sharding import ShardingError, logical_to_spec, mesh_shape

SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig, VisionConfig
from valen_jax.models.transformer import abstract_model, init_params

cfg = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                  image_pad_id=7, vision=VisionConfig(patch_size=8, merge_size=2, temporal_patch_size=2, dim=32,
                  num_layers=1, num_heads=2, mlp_dim=64))
mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
_, abstract = abstract_model(cfg)
shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
params = init_params(cfg, 0, shardings)
specs = {"/".join(map(str, p)): str(a.sharding.spec) for p, a in
         ((tuple(k.key for k in path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params))}
replicated_big = [k for k, a in zip(specs, jax.tree.leaves(params)) if a.size >= 4096 and
                  all(s is None for s in a.sharding.spec)]
local = jax.device_put(params, jax.devices()[0])
rng = np.random.default_rng(0)
tokens = rng.integers(8, 256, (8, 24)).astype(np.int32); tokens[:, 1:5] = 7
positions = np.tile(np.arange(24, dtype=np.int32), (8, 1)); segments = np.ones((8, 24), np.int32)
patches = rng.normal(size=(8, 16, 2 * 8 * 8 * 3)).astype(np.float32)
patch_positions = np.tile(np.stack(np.meshgrid([0], range(4), range(4), indexing="ij"), -1).reshape(1, 16, 3), (8, 1, 1)).astype(np.int32)
patch_segments = np.ones((8, 16), np.int32)
graphdef = abstract_model(cfg)[0]
forward = lambda p, t, pos, s, pa, pp, ps: nnx.merge(graphdef, p)(t, pos, s, (pa, pp, ps))
reference = jax.jit(forward)(local, tokens, positions, segments, patches, patch_positions, patch_segments)
batch = sharding.global_batch({"t": tokens, "p": positions, "s": segments, "pa": patches, "pp": patch_positions,
                               "ps": patch_segments}, mesh)
with jax.set_mesh(mesh):
    sharded = jax.jit(forward)(params, batch["t"], batch["p"], batch["s"], batch["pa"], batch["pp"], batch["ps"])
print(json.dumps({"specs": specs, "replicated_big": replicated_big,
                  "rows_per_device": sorted({s.data.shape[0] for s in batch["t"].addressable_shards}),
                  "embed_per_device": sorted({s.data.shape for s in params["embed"].addressable_shards}),
                  "max_diff": float(jnp.max(jnp.abs(np.asarray(sharded) - np.asarray(reference))))}))
"""


@pytest.mark.slow
def test_parameters_follow_the_rules_and_outputs_match_unsharded():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env_with_devices(8),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    specs = report["specs"]
    assert specs["embed"] == "P('tensor', 'fsdp')"
    assert specs["layers/0/mlp/gate"] == "P('fsdp', 'tensor')"
    assert specs["layers/0/mlp/down"] == "P('tensor', 'fsdp')"
    assert specs["layers/0/attn/q"] == "P('fsdp', 'tensor', None)"
    assert specs["layers/0/attn/o"] == "P('tensor', None, 'fsdp')"
    assert specs["layers/0/attn_norm/scale"] == "P(None,)"
    assert report["replicated_big"] == []
    # What the rules produce: the batch split over data × fsdp (8 rows, 2 per device), the embedding
    # table split by tensor (vocab) and fsdp (embed), never whole on a device.
    assert report["rows_per_device"] == [2]
    assert report["embed_per_device"] == [[128, 32]]
    assert report["max_diff"] < 1e-4


def test_mesh_shape_resolves_the_rest_and_refuses_impossible_meshes():
    assert mesh_shape({"data": -1, "fsdp": 2, "tensor": 1}, 8) == {"data": 4, "fsdp": 2, "tensor": 1}
    with pytest.raises(ShardingError, match="at most one"):
        mesh_shape({"data": -1, "fsdp": -1, "tensor": 1}, 8)
    with pytest.raises(ShardingError, match="needs 4 devices"):
        mesh_shape({"data": 2, "fsdp": 2, "tensor": 1}, 8)
    with pytest.raises(ShardingError, match="not divisible"):
        mesh_shape({"data": -1, "fsdp": 3, "tensor": 1}, 8)


def test_a_mesh_axis_shards_one_dimension_only_and_an_unknown_name_is_an_error():
    # `embed` twice (a square weight): the second would reuse fsdp, which JAX refuses; it stays whole.
    assert logical_to_spec(("embed", "embed")) == logical_to_spec(("embed", None))
    assert logical_to_spec(("embed", "embed"))[1] is None
    with pytest.raises(ShardingError, match="no rule"):
        logical_to_spec(("nonsense",))
