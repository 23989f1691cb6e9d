"""Optimizer state on a 2×2×2 mesh (8 simulated devices) with scanned layers and parameter groups.

Adam holds two moments per trained parameter; replicating one of them on every device would undo
FSDP for the optimizer, which is most of the memory. Run in a subprocess: XLA_FLAGS precede jax.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.train_runs import ROOT, env_with_devices

SCRIPT = r"""
import json
import jax, ml_collections
from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig, VisionConfig
from valen_jax.models.transformer import init_params
from valen_jax.training.optim import path_of
from valen_jax.training.step import TrainLayout

cfg = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                  image_pad_id=7, scan_layers=True, vision=VisionConfig(patch_size=8, merge_size=2,
                  temporal_patch_size=2, dim=32, num_layers=1, num_heads=2, mlp_dim=64))
train = ml_collections.ConfigDict(dict(
    steps=10, learning_rate=1e-3, warmup_steps=2, decay="cosine", end_learning_rate_fraction=0.1, weight_decay=0.01,
    adam_b1=0.9, adam_b2=0.95, grad_clip_norm=1.0,
    param_groups=[{"pattern": "vision/.*", "frozen": True}, {"pattern": "embed", "lr_multiplier": 0.1}],
    vision_lr_multiplier=0.1))
mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
layout = TrainLayout.from_config(cfg, train, mesh)
params = init_params(cfg, 0, layout.param_shardings)
# As train.py does: the shardings that come back are what the devices really hold.
opt_state = jax.jit(layout.tx.init, out_shardings=layout.state_shardings["opt_state"])(params)
describe = lambda tree: {path_of(p): [a.shape, str(a.sharding.spec), len(a.sharding.device_set),
                                      a.addressable_shards[0].data.size]
                         for p, a in jax.tree_util.tree_leaves_with_path(tree)}
print(json.dumps({"params": describe(params), "opt": describe(opt_state)}))
"""


@pytest.mark.slow
def test_no_large_moment_is_replicated_and_each_moment_is_sharded_like_its_parameter():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env_with_devices(8),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    params, opt = report["params"], report["opt"]
    assert params["layers/mlp/gate"][0] == [2, 64, 128]  # scanned: one stacked array with a leading layer axis

    # Replicated means each device holds the whole array; for any moment of 1024+ entries that is a bug.
    whole = [path for path, (shape, _, _, local) in opt.items() if len(shape) and local == math.prod(shape)
             and math.prod(shape) >= 1024]
    assert whole == []

    moments = {}
    for path, (shape, spec, devices, _) in opt.items():
        for kind in (".mu/", ".nu/"):
            if kind in path:
                moments.setdefault(path.split(kind, 1)[1], []).append((kind, shape, spec, devices))
    trained = {path for path in params if not path.startswith("vision/")}
    # The frozen group (vision) holds no moments; every other parameter, embed in its own lr group
    # included, holds mu and nu with its own shape and sharding.
    assert set(moments) == trained
    for path in trained:
        shape, spec, devices, _ = params[path]
        assert sorted(moments[path]) == [(".mu/", shape, spec, devices), (".nu/", shape, spec, devices)], path
    assert opt["1/.inner_states/trained/.inner_state/0/.mu/layers/mlp/down"][1] == "P(None, 'tensor', 'fsdp')"
