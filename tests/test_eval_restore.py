"""Evaluation restores only the params (never the optimizer moments), checked against their save-time digests."""

from __future__ import annotations

import shutil
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from valen_jax.training import checkpoint

STEP = 3


def make_state() -> dict:
    """A train state with Adam moments. The moments are constant so they compress to almost nothing
    (the fixture saves compressed): the largest data file is then the random params, which the
    damage tests aim at."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(256, 128)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(128,)), jnp.bfloat16)}
    opt_state = jax.tree.map(lambda x: jnp.full_like(x, 0.5) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                             optax.adam(1e-3).init(params))
    return {"params": params, "opt_state": opt_state, "step": jnp.asarray(STEP, jnp.int32)}


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@pytest.fixture
def saved(tmp_path) -> Path:
    state = make_state()
    mgr = checkpoint.manager(tmp_path, compress=True)
    iterator = iter(grain.MapDataset.range(100).batch(4).to_iter_dataset())
    checkpoint.save(mgr, STEP, state, iterator, {"state_layout": checkpoint.state_layout(abstract(state))}, force=True)
    mgr.wait_until_finished()
    mgr.close()
    return tmp_path


def restore_params(workdir: Path, abstract_params=None):
    mgr = checkpoint.manager(workdir, read_only=True)
    try:
        meta = checkpoint.restore_meta(mgr, STEP)
        return checkpoint.restore_params_verified(mgr, STEP, meta, abstract_params or abstract(make_state()["params"]))
    finally:
        mgr.close()


@pytest.fixture
def arrays_read(monkeypatch) -> list[str]:
    """The names of the arrays Orbax deserializes (reads from disk into memory) from now on."""
    names: list[str] = []
    original = ocp.type_handlers.ArrayHandler.deserialize

    async def deserialize(self, infos, args=None):
        names.extend(info.name for info in infos)
        return await original(self, infos, args)

    monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "deserialize", deserialize)
    return names


def test_params_restored_alone_equal_the_saved_params(saved):
    params = restore_params(saved)
    expected = make_state()["params"]
    assert set(params) == {"w", "b"}
    for name in expected:
        assert params[name].dtype == expected[name].dtype
        np.testing.assert_array_equal(np.asarray(params[name]), np.asarray(expected[name]))


def test_the_optimizer_state_is_never_read(saved, arrays_read):
    # The full restore (training resume) reads the moments: the spy sees them.
    mgr = checkpoint.manager(saved)
    checkpoint.restore_state(mgr, STEP, abstract(make_state()))
    mgr.close()
    assert any(name.startswith("opt_state.") for name in arrays_read)
    arrays_read.clear()

    restore_params(saved)
    assert sorted(arrays_read) == ["params.b", "params.w"]


def test_garbled_params_are_detected(saved):
    path = max((p for p in (saved / "checkpoints" / str(STEP) / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0x5A for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CorruptCheckpoint, match=f"checkpoint {STEP}: params arrays differ .*params/w"):
        restore_params(saved)


def test_truncated_params_are_detected(saved):
    path = max((p for p in (saved / "checkpoints" / str(STEP) / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    with pytest.raises(checkpoint.CorruptCheckpoint, match=f"checkpoint {STEP}: params"):
        restore_params(saved)


def test_verify_params_checks_every_params_digest_and_only_those(saved):
    mgr = checkpoint.manager(saved, read_only=True)
    meta = checkpoint.restore_meta(mgr, STEP)
    mgr.close()
    params = make_state()["params"]
    checkpoint.verify_params(STEP, meta, params)
    with pytest.raises(checkpoint.CorruptCheckpoint, match="params/b"):
        checkpoint.verify_params(STEP, meta, {**params, "b": params["b"].at[3].add(1)})
    with pytest.raises(checkpoint.CorruptCheckpoint, match="the set of arrays"):
        checkpoint.verify_params(STEP, meta, {**params, "extra": jnp.zeros(3)})
    with pytest.raises(checkpoint.CorruptCheckpoint, match="params/b"):
        checkpoint.verify_params(STEP, meta, {"w": params["w"]})


def test_another_params_layout_is_an_error_not_corruption(saved):
    other = {**abstract(make_state()["params"]), "w": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
    with pytest.raises(checkpoint.CheckpointError, match="another params layout") as error:
        restore_params(saved, other)
    assert not isinstance(error.value, checkpoint.CorruptCheckpoint)


@pytest.mark.slow
def test_evaluate_restores_a_trained_workdir_params_only_and_refuses_a_damaged_one(tmp_path_factory, tmp_path,
                                                                                   arrays_read):
    from tests.smoke_workdirs import smoke_workdir
    from valen_jax.evaluation import workdir as eval_workdir

    workdir = tmp_path / "workdir"  # a copy: the smoke workdir is shared by the session's tests
    shutil.copytree(smoke_workdir(tmp_path_factory, "configs/valen.py:tiny"), workdir)
    restored = eval_workdir.restore(workdir)
    assert not hasattr(restored, "opt_state") and arrays_read
    assert not any(name.startswith(("opt_state.", "step")) for name in arrays_read)

    # The same params as the full train-state restore that training resume uses.
    from valen_jax.training.step import TrainLayout

    mgr = checkpoint.manager(workdir, read_only=True)
    layout = TrainLayout.from_config(restored.model_cfg, restored.config.train, restored.mesh)
    full = checkpoint.restore_state(mgr, restored.step, layout.abstract_state())
    mgr.close()
    for ours, theirs in zip(jax.tree.leaves(restored.params), jax.tree.leaves(full["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))

    # Every array data file cut short: which one holds the params depends on Orbax's write order.
    for path in (workdir / "checkpoints" / str(restored.step) / "state").glob("**/d/*"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    with pytest.raises(checkpoint.CorruptCheckpoint, match=f"checkpoint {restored.step}: params"):
        eval_workdir.restore(workdir)
