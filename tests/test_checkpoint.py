"""Orbax checkpoints: asynchronous saves, digests that catch damaged files, fallback to the previous step."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from valen_jax import checkpoint


def make_state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"params": {"w": jnp.asarray(rng.normal(size=(256, 128)), jnp.float32),
                       "b": jnp.asarray(rng.normal(size=(128,)), jnp.bfloat16)},
            "step": jnp.asarray(seed, jnp.int32)}


def make_iterator():
    return iter(grain.MapDataset.range(1000).batch(4).to_iter_dataset())


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def save_steps(workdir: Path, steps, pause_s: float = 0.0):
    mgr = checkpoint.manager(workdir, max_to_keep=5, debug_pause_in_save_s=pause_s)
    iterator = make_iterator()
    positions = {}
    for step in steps:
        next(iterator)
        positions[step] = iterator.get_state()
        checkpoint.save(mgr, step, make_state(step), iterator, {"step": step,
                                                                "state_layout": checkpoint.state_layout(
                                                                    abstract(make_state(step)))}, force=True)
    mgr.wait_until_finished()
    mgr.close()
    return positions


def restore(workdir: Path, check_meta=lambda step, meta: None, abstract_state=None):
    mgr = checkpoint.manager(workdir, max_to_keep=5)
    iterator = make_iterator()
    abstract_state = abstract(make_state(0)) if abstract_state is None else abstract_state
    result = checkpoint.restore_intact(mgr, workdir, abstract_state, iterator, check_meta)
    mgr.close()
    return result, iterator


def largest_state_file(workdir: Path, step: int) -> Path:
    files = [p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def test_save_returns_before_the_write_finishes_and_steps_overlap_it(tmp_path):
    state = make_state(1)
    checkpoint.state_digest(state)  # compiled before timing
    mgr = checkpoint.manager(tmp_path, debug_pause_in_save_s=2.0)
    started = time.perf_counter()
    checkpoint.save(mgr, 1, state, make_iterator(), {"step": 1}, force=True)
    returned = time.perf_counter() - started
    # Training work runs while the write is held open; the step directory is not final yet.
    x = jnp.ones((256, 256))
    for _ in range(5):
        x = (x @ x) / 256
    x.block_until_ready()
    assert not (tmp_path / "checkpoints" / "1").exists()
    mgr.wait_until_finished()
    finished = time.perf_counter() - started
    mgr.close()
    assert returned < 1.0 and finished >= 2.0
    assert (tmp_path / "checkpoints" / "1").is_dir()


def test_an_intact_checkpoint_restores_state_iterator_and_meta(tmp_path):
    positions = save_steps(tmp_path, [1, 2])
    (step, state, meta), iterator = restore(tmp_path)
    assert step == 2 and meta["step"] == 2
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(make_state(2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert iterator.get_state() == positions[2]
    assert set(meta["digest"]["state"]) == {"params/b", "params/w", "step"}


def test_digests_are_those_of_the_saved_state_even_when_the_next_step_donates_it(tmp_path):
    # `save` only dispatches the digest reduction; the background meta write fetches it. The
    # next step donating (overwriting) the state's buffers must not change what was recorded.
    state = make_state(3)
    expected = checkpoint.state_digest(state)
    overwrite = jax.jit(lambda tree: jax.tree.map(lambda x: x + jnp.ones((), x.dtype), tree), donate_argnums=0)
    mgr = checkpoint.manager(tmp_path, debug_pause_in_save_s=0.5)
    checkpoint.save(mgr, 1, state, make_iterator(), {"step": 1}, force=True)
    state = jax.block_until_ready(overwrite(state))
    mgr.wait_until_finished()
    meta = checkpoint.restore_meta(mgr, 1)
    mgr.close()
    assert meta["digest"]["state"] == expected
    assert all(isinstance(v, int) for v in meta["digest"]["state"].values())
    assert checkpoint.state_digest(state) != expected


def test_state_arrays_are_written_uncompressed_unless_asked_and_both_restore(tmp_path):
    # Zeros compress to almost nothing: the bytes on disk tell which codec was used.
    state = {"params": {"w": jnp.zeros((512, 1024), jnp.float32)}, "step": jnp.asarray(1, jnp.int32)}
    sizes = {}
    for compress in (False, True):
        workdir = tmp_path / str(compress)
        mgr = checkpoint.manager(workdir, compress=compress)
        checkpoint.save(mgr, 1, state, make_iterator(), {"step": 1}, force=True)
        mgr.wait_until_finished()
        mgr.close()
        files = (workdir / "checkpoints" / "1" / "state").rglob("*")
        sizes[compress] = sum(p.stat().st_size for p in files if p.is_file())
        (step, restored, _), _ = restore(workdir, abstract_state=abstract(state))
        np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.zeros((512, 1024), np.float32))
    assert sizes[False] > 2 * 2**20 > 100 * sizes[True] > 0


@pytest.mark.parametrize("damage", ["garble", "truncate"])
def test_a_damaged_latest_checkpoint_is_reported_moved_aside_and_the_previous_one_used(tmp_path, caplog, damage):
    positions = save_steps(tmp_path, [1, 2])
    path = largest_state_file(tmp_path, 2)
    data = bytearray(path.read_bytes())
    if damage == "garble":
        # Flipped bits in the middle of the array data: they read back without any error.
        middle = len(data) // 2
        data[middle:middle + 16] = bytes(b ^ 0x5A for b in data[middle:middle + 16])
    else:
        data = data[: len(data) // 3]
    path.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="valen_jax.checkpoint"):
        (step, state, _), iterator = restore(tmp_path)
    assert step == 1
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.asarray(make_state(1)["params"]["w"]))
    assert iterator.get_state() == positions[1]
    assert any("checkpoint 2 is corrupt" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "checkpoints" / "2").exists()
    assert [p.name.split("-")[0] for p in (tmp_path / "checkpoints-corrupt").iterdir()] == ["2"]


def test_damaged_meta_is_corruption_too(tmp_path, caplog):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "checkpoints" / "2" / "meta" / "metadata").write_text('{"step": 2, "dig')
    with caplog.at_level(logging.WARNING, logger="valen_jax.checkpoint"):
        (step, _, _), _ = restore(tmp_path)
    assert step == 1 and any("checkpoint 2 is corrupt" in r.getMessage() for r in caplog.records)


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    save_steps(tmp_path, [1])
    largest_state_file(tmp_path, 1).write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="no intact checkpoint"):
        restore(tmp_path)


def test_a_checkpoint_of_another_setup_is_an_error_and_is_left_alone(tmp_path):
    save_steps(tmp_path, [1, 2])

    def refuse(step, meta):
        raise checkpoint.CheckpointError(f"checkpoint {step} has another tokenizer")

    with pytest.raises(checkpoint.CheckpointError, match="checkpoint 2 has another tokenizer"):
        restore(tmp_path, refuse)
    assert (tmp_path / "checkpoints" / "2").is_dir() and not (tmp_path / "checkpoints-corrupt").exists()


def test_another_train_state_layout_is_an_error_not_corruption(tmp_path):
    save_steps(tmp_path, [1])
    mgr = checkpoint.manager(tmp_path)
    other = {**make_state(0), "params": {**make_state(0)["params"], "extra": jnp.zeros((3,))}}
    with pytest.raises(checkpoint.CheckpointError, match="another train-state layout"):
        checkpoint.restore_intact(mgr, tmp_path, abstract(other), make_iterator(), lambda step, meta: None)
    mgr.close()
    assert (tmp_path / "checkpoints" / "1").is_dir()


def test_no_checkpoint_gives_none(tmp_path):
    (result, _) = restore(tmp_path)
    assert result is None
