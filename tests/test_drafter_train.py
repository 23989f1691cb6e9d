"""End to end on the smoke recipe (issue 16): an ar target, then `vflash` mode trains its block drafter."""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data_pipeline.shards import read_shard
from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT, final_params, metrics, run_train
from valen_jax.data.assemble import RowSpec, assemble
from valen_jax.data.sources import ShardSet
from valen_jax.models.drafter import (
    Drafter,
    DrafterConfig,
    abstract_drafter,
    draft_hidden,
    init_drafter_params,
)
from valen_jax.models.transformer import Transformer
from valen_jax.run import target_record
from valen_jax.training import checkpoint
from valen_jax.vflash.objective import drafter_losses, drafter_targets
from valen_jax.vflash.task import restore_target

sys.path.insert(0, str(ROOT))
from configs import vflash  # noqa: E402

pytestmark = pytest.mark.heavy
STEPS = 30


def drafter_config(target) -> object:
    config = vflash.get_config("tiny,drafter")
    config.model.target_from = str(target)
    return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(target workdir, drafter workdir, the target's params before the drafter trained)."""
    target = smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny")
    before = final_params(target)
    drafter = tmp_path_factory.mktemp("drafter")
    run_train("configs/vflash.py:tiny,drafter", drafter, f"--config.model.target_from={target}",
              f"--config.train.steps={STEPS}", f"--config.train.checkpoint_every={STEPS}",
              "--config.train.learning_rate=0.01")
    return target, drafter, before


def drafter_meta(workdir) -> dict:
    mgr = checkpoint.manager(workdir, read_only=True)
    try:
        return checkpoint.restore_meta(mgr, checkpoint.select_step(mgr, workdir))
    finally:
        mgr.close()


def test_metrics_name_the_drafter_objective_every_step(runs):
    _, drafter, _ = runs
    logged = metrics(drafter)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    for m in logged:
        assert m["loss"] == m["loss_drafter"] and np.isfinite(m["loss"])
        assert {f"drafter_accuracy_{k}" for k in range(1, 9)} <= set(m)
        accuracy = [m[f"drafter_accuracy_{k}"] for k in range(1, 9)]
        assert m["drafter_acceptance_length"] == pytest.approx(float(np.sum(np.cumprod(accuracy))), rel=1e-4)
        assert m["drafter_anchors"] > 0  # every batch of the smoke recipe holds trajectory blocks


def test_the_target_is_bitwise_unchanged_and_recorded_in_the_drafters_meta(runs):
    target, drafter, before = runs
    after = final_params(target)
    assert before[0] == after[0] == 4
    assert all(np.array_equal(a, b) for a, b in zip(before[1], after[1], strict=True))
    recorded = drafter_meta(drafter)["drafter"]["target"]
    restored = restore_target(drafter_config(target), recorded["tokenizer"], _mesh())
    assert recorded == target_record(restored)
    assert recorded["workdir"] == str(target.resolve()) and recorded["step"] == 4
    # The identity comes from the target's saved per-leaf digests (nothing gathered), and it is the one
    # the params in memory give: another set of weights gives another identity.
    assert len(recorded["params_identity"]) == 64 and "params_sha256" not in recorded
    assert checkpoint.params_identity_of(restored.params) == recorded["params_identity"]
    other = jax.tree.map(lambda x: x + 1 if x.ndim == 1 else x, restored.params)
    assert checkpoint.params_identity_of(other) != recorded["params_identity"]


def _mesh():
    from valen_jax.models import sharding
    return sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})


def test_a_target_of_another_tokenizer_or_mode_or_nowhere_is_refused(runs, tmp_path):
    target, drafter, _ = runs
    fingerprint = drafter_meta(drafter)["tokenizer"]["fingerprint"]
    with pytest.raises(checkpoint.CheckpointError, match="must share the target's vocabulary"):
        restore_target(drafter_config(target), {**fingerprint, "tokenizerSha256": "0" * 64}, _mesh())
    with pytest.raises(checkpoint.CheckpointError, match="train.mode=vflash; a drafter's target must be an ar run"):
        restore_target(drafter_config(drafter), fingerprint, _mesh())
    with pytest.raises(checkpoint.CheckpointError, match="train the ar target there first"):
        restore_target(drafter_config(tmp_path / "none"), fingerprint, _mesh())


def test_the_drafter_loss_falls_on_the_same_blocks(runs):
    """Initial against trained drafter, on the same rows and anchors: the trend, free of batch-to-batch noise."""
    target_dir, drafter_dir, _ = runs
    meta = drafter_meta(drafter_dir)
    cfg = DrafterConfig.from_json(meta["drafter"]["config"])
    mesh = _mesh()
    target = restore_target(drafter_config(target_dir), meta["tokenizer"]["fingerprint"], mesh)
    from transformers import AutoTokenizer

    from valen_jax.data.vision_processor import media_kwargs_of
    config = drafter_config(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.tokenizer_dir(drafter_dir)))
    spec = RowSpec.from_config(config, tokenizer, target.model_cfg,
                               media_kwargs_of(config, target.model_cfg.vision)[0])
    spec = dataclasses.replace(spec, draft_blocks=True)
    shards = ShardSet.open(next((drafter_dir / "shards").iterdir()))
    examples = [e for path in shards.manifest.shard_paths for e in read_shard(shards.directory / path)]
    rows = [assemble(e, spec) for e in examples if (e.arrays["primitive_blocks"][:, 0] >= 0).any()][:8]
    batch = {key: jnp.asarray(np.stack([row[key] for row in rows])) for key in rows[0]}

    target_model = nnx.merge(target.graphdef, target.params)
    graphdef = abstract_drafter(cfg)[0]

    @jax.jit
    def loss(params):
        drafter = nnx.merge(graphdef, params)
        anchors, targets, weights = drafter_targets(batch["draft_block"], batch["targets"], batch["target_weights"],
                                                    16, cfg.block_size, jax.random.key(0))
        hidden = draft_hidden(drafter, target_model, batch, anchors)
        sums = drafter_losses(hidden, target_model.head_matrix(), targets, weights, 4.0)
        return sums["ce"] / sums["weight"]

    initial = init_drafter_params(cfg, config.train.seed, None)
    mgr = checkpoint.manager(drafter_dir, read_only=True)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                          nnx.to_pure_dict(abstract_drafter(cfg)[1]))
    trained = checkpoint.restore_params(mgr, STEPS, shapes)
    mgr.close()
    before, after = float(loss(initial)), float(loss(trained))
    print(json.dumps({"drafter_loss_initial": before, "drafter_loss_trained": after}))
    assert after < before - 0.05, (before, after)
    assert isinstance(target_model, Transformer) and isinstance(nnx.merge(graphdef, trained), Drafter)
