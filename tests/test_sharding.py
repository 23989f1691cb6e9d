"""Logical-axis sharding on 8 simulated devices (run in a subprocess: XLA_FLAGS precede jax)."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import ml_collections
import pytest
from flax import nnx

from tests.train_runs import ROOT, env_with_devices
from valen_jax.cli.boundary import is_user_error, one_line
from valen_jax.config.schema import defaults
from valen_jax.models.config import ModelConfig
from valen_jax.models.sharding import ShardingError, choose_mesh, logical_to_spec, memory_advice, mesh_shape
from valen_jax.models.transformer import abstract_model
from valen_jax.training import mesh_choice

GIB = 1024 ** 3
UNSET = {"data": None, "fsdp": None, "tensor": None}
DATA_PARALLEL = {"data": -1, "fsdp": 1, "tensor": 1}
FSDP = {"data": 1, "fsdp": -1, "tensor": 1}
FSDP_FLAGS = "--config.mesh.data=1 --config.mesh.fsdp=-1"

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


def test_an_unset_mesh_is_data_parallel_while_the_state_fits_a_device_and_fsdp_over_all_once_it_does_not():
    """Issue 54: a 7B full fine-tune (16 bytes a parameter: 113.5 GiB replicated) on v5p-64 (32 chips of 95 GiB)
    was compiled data parallel and refused for 126 GB of temporaries a chip; FSDP fits it in 12.8 GB."""
    shape, why = choose_mesh(UNSET, 32, 113.5 * GIB, 95 * GIB, "TPU v5")
    assert shape == FSDP
    assert why.startswith("config.mesh unset: FSDP over the 32 devices (3.55 GiB of state each)")
    assert "113.5 GiB" in why and "TPU v5's 95.0 GiB" in why and FSDP_FLAGS in why
    # The target's memory decides: the same 20 GiB of state fits a v5p chip replicated, not a v5e chip.
    assert choose_mesh(UNSET, 8, 20 * GIB, 95 * GIB)[0] == DATA_PARALLEL
    assert choose_mesh(UNSET, 8, 20 * GIB, 16 * GIB)[0] == FSDP
    # Half the device for the state, the rest for activations: 8 GiB fits a 16 GiB chip, 8.1 does not.
    assert choose_mesh(UNSET, 8, 8 * GIB, 16 * GIB)[0] == DATA_PARALLEL
    assert choose_mesh(UNSET, 8, 8.1 * GIB, 16 * GIB)[0] == FSDP
    # No memory size to go by (CPU devices) or one device: data parallel, and the reason says so.
    shape, why = choose_mesh(UNSET, 8, 113.5 * GIB, None, "cpu")
    assert shape == DATA_PARALLEL and "cpu devices report no memory size" in why
    assert choose_mesh(UNSET, 1, 113.5 * GIB, 16 * GIB) == (DATA_PARALLEL, "config.mesh unset: one device")


def test_mesh_keys_the_user_sets_are_kept_and_the_unset_ones_are_one_or_the_rest():
    asked = {**UNSET, "data": -1}  # data parallel asked for by name: kept, whatever the state
    assert choose_mesh(asked, 32, 113.5 * GIB, 95 * GIB) == (DATA_PARALLEL, "as config.mesh sets it")
    assert choose_mesh({**UNSET, "fsdp": -1}, 32)[0] == FSDP  # `data` does not take the rest twice
    assert choose_mesh({**UNSET, "data": 2, "fsdp": 4}, 8)[0] == {"data": 2, "fsdp": 4, "tensor": 1}
    assert choose_mesh({**UNSET, "tensor": 2}, 8)[0] == {"data": -1, "fsdp": 1, "tensor": 2}
    assert choose_mesh({**UNSET, "data": 8}, 1)[0] == {"data": 8, "fsdp": 1, "tensor": 1}  # refused by make_mesh


def test_a_memory_refusal_names_the_mesh_keys_to_change():
    replicated = memory_advice({"data": 32, "fsdp": 1, "tensor": 1}, 32)
    assert "keeps 32 copies of the params and optimizer state" in replicated and replicated.endswith(FSDP_FLAGS)
    assert FSDP_FLAGS in memory_advice({"data": 8, "fsdp": 2, "tensor": 2}, 32)
    sharded = memory_advice({"data": 1, "fsdp": 32, "tensor": 1}, 32)
    assert "already shards the params over all 32 devices" in sharded and "config.data.global_batch" in sharded
    assert FSDP_FLAGS not in sharded


def test_training_out_of_device_memory_is_one_line_with_the_mesh_keys():
    config = ml_collections.ConfigDict({"mesh": DATA_PARALLEL})
    with pytest.raises(mesh_choice.DeviceMemoryError) as raised, mesh_choice.refused_for_memory(config):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 40.00GiB.\n"
                                         "BufferAssignment OOM Debugging.")
    line = one_line(raised.value)
    assert is_user_error(raised.value) and "\n" not in line
    assert line.startswith("DeviceMemoryError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 40.00GiB.; ")
    assert "config.data.global_batch" in line  # one CPU device here: the mesh already holds it all
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"), mesh_choice.refused_for_memory(config):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")


def test_the_train_state_counts_params_gradients_and_adam_moments():
    cfg = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                      image_pad_id=7)
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.to_pure_dict(abstract_model(cfg)[1])))
    config = ml_collections.ConfigDict({"train": defaults("train")})
    full = mesh_choice.train_state_bytes(config, cfg)
    assert 4 * params <= full < 4 * params + 1024  # f32 weights, gradients, two moments (and step counters)
    config.train.mode = "vflash"  # the target is frozen: its weights alone
    assert mesh_choice.train_state_bytes(config, cfg) == params
