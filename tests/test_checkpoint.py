"""Orbax checkpoints: asynchronous saves, digests that catch damaged files, fallback to the previous step,
old checkpoints still restoring, and what we rely on from Orbax pinned so an upgrade that changes it fails here."""

from __future__ import annotations

import inspect
import json
import logging
import re
import threading
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.hold_checkpoint_write import holding_async_save
from valen_jax.training import checkpoint

ROOT = Path(__file__).resolve().parent.parent
# Written by valen_jax/training/checkpoint.py as of commit 02e97f6 (Orbax 0.12.8, the `state` item through
# StandardCheckpointHandler, digests in `meta`), with zstd and without: step 5 of `old_state()`,
# the iterator of `make_iterator(40)` after two batches.
OLD_CHECKPOINTS = Path(__file__).resolve().parent / "orbax_0_12_checkpoints"


def make_state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"params": {"w": jnp.asarray(rng.normal(size=(256, 128)), jnp.float32),
                       "b": jnp.asarray(rng.normal(size=(128,)), jnp.bfloat16)},
            "step": jnp.asarray(seed, jnp.int32)}


def make_iterator(size: int = 1000):
    return iter(grain.MapDataset.range(size).batch(4).to_iter_dataset())


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def save_steps(workdir: Path, steps):
    mgr = checkpoint.manager(workdir, max_to_keep=5)
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


@pytest.fixture
def held_writes(monkeypatch) -> threading.Event:
    """Every checkpoint's background write held open until the returned event is set."""
    release = threading.Event()
    monkeypatch.setattr(checkpoint.MetaHandler, "async_save", holding_async_save(release))
    yield release
    release.set()


def test_save_returns_before_the_write_finishes_and_steps_overlap_it(tmp_path, held_writes):
    state = make_state(1)
    mgr = checkpoint.manager(tmp_path)
    checkpoint.save(mgr, 1, state, make_iterator(), {"step": 1}, force=True)
    # The save call has returned while the write is held open: training work runs meanwhile, and
    # the step directory is not final (a kill now leaves only the tmp directory).
    x = jnp.ones((256, 256))
    for _ in range(5):
        x = (x @ x) / 256
    x.block_until_ready()
    assert not (tmp_path / "checkpoints" / "1").exists()
    assert list((tmp_path / "checkpoints").glob("1.orbax-checkpoint-tmp*"))
    held_writes.set()
    mgr.wait_until_finished()
    mgr.close()
    assert (tmp_path / "checkpoints" / "1").is_dir()
    assert not list((tmp_path / "checkpoints").glob("1.orbax-checkpoint-tmp*"))


def test_an_intact_checkpoint_restores_state_iterator_and_meta(tmp_path):
    positions = save_steps(tmp_path, [1, 2])
    (step, state, meta), iterator = restore(tmp_path)
    assert step == 2 and meta["step"] == 2
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(make_state(2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert iterator.get_state() == positions[2]
    assert set(meta["digest"]["state"]) == {"params/b", "params/w", "step"}


def test_digests_are_those_of_the_saved_state_even_when_the_next_step_donates_it(tmp_path, held_writes):
    # `save` only dispatches the digest reduction; the background meta write fetches it. The
    # next step donating (overwriting) the state's buffers must not change what was recorded.
    state = make_state(3)
    expected = checkpoint.state_digest(state)
    overwrite = jax.jit(lambda tree: jax.tree.map(lambda x: x + jnp.ones((), x.dtype), tree), donate_argnums=0)
    mgr = checkpoint.manager(tmp_path)
    checkpoint.save(mgr, 1, state, make_iterator(), {"step": 1}, force=True)
    state = jax.block_until_ready(overwrite(state))  # while the meta write is held open
    held_writes.set()
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

    with caplog.at_level(logging.WARNING, logger="valen_jax.training.checkpoint"):
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
    with caplog.at_level(logging.WARNING, logger="valen_jax.training.checkpoint"):
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


def old_state() -> dict:
    rng = np.random.default_rng(7)
    return {"params": {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
                       "b": jnp.asarray(rng.normal(size=(8,)), jnp.bfloat16)},
            "step": jnp.asarray(5, jnp.int32)}


@pytest.mark.parametrize("kind", ["uncompressed", "compressed"])
def test_checkpoints_written_through_the_standard_handler_still_restore_verified(tmp_path, kind):
    import shutil
    workdir = tmp_path / kind
    shutil.copytree(OLD_CHECKPOINTS / kind, workdir)
    mgr = checkpoint.manager(workdir)
    iterator = make_iterator(40)
    step, state, meta = checkpoint.restore_intact(mgr, workdir, abstract(old_state()), iterator,
                                                  lambda step, meta: None)
    mgr.close()
    assert step == 5 and meta["step"] == 5
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(old_state()), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    expected = make_iterator(40)
    next(expected), next(expected)
    assert iterator.get_state() == expected.get_state()

    mgr = checkpoint.manager(workdir, read_only=True)
    params = checkpoint.restore_params_verified(mgr, 5, checkpoint.restore_meta(mgr, 5), abstract(old_state()["params"]))
    mgr.close()
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(old_state()["params"]["w"]))


def test_what_we_rely_on_from_orbax_is_unchanged(tmp_path):
    """If this fails after an Orbax upgrade, the checkpoint format or an API valen_jax uses changed:
    read the Orbax changelog, adapt valen_jax/training/checkpoint.py, and keep the old-checkpoint test green."""
    # Handler type strings recorded in every step's metadata (old steps name StandardCheckpointHandler
    # for `state`; restores choose handlers by argument type, so both read).
    recorded = {
        "state": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
        "meta": "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler",
        "data": "grain._src.python.checkpoint.handler.CheckpointHandler",
    }
    assert ocp.handlers.PyTreeCheckpointHandler.typestr() == recorded["state"]
    assert ocp.handlers.JsonCheckpointHandler.typestr() == recorded["meta"]
    old = json.loads((OLD_CHECKPOINTS / "compressed/checkpoints/5/_CHECKPOINT_METADATA").read_text())
    assert old["item_handlers"]["state"] == ocp.handlers.StandardCheckpointHandler.typestr()

    # The arguments and options we construct, with the fields we pass.
    fields = {ocp.args.PyTreeSave: {"item"}, ocp.args.PyTreeRestore: {"item", "restore_args", "partial_restore"},
              ocp.args.JsonSave: {"item"}, ocp.args.JsonRestore: set(), ocp.AsyncOptions:
              {"create_directories_asynchronously"}}
    for cls, names in fields.items():
        assert names <= set(inspect.signature(cls).parameters), cls
    handler_options = set(inspect.signature(ocp.handlers.PyTreeCheckpointHandler).parameters)
    assert {"use_compression", "save_concurrent_gb", "restore_concurrent_gb"} <= handler_options
    assert "filename" in inspect.signature(ocp.handlers.JsonCheckpointHandler).parameters
    assert inspect.iscoroutinefunction(ocp.handlers.JsonCheckpointHandler.async_save)
    # MetaHandler returns its write as a concurrent.futures.Future: all Orbax's Future protocol asks.
    assert {name for name in vars(ocp.future.Future) if not name.startswith("_")} <= {"result", "cancel"}

    # On disk: one directory per step and item, the meta JSON under Orbax's default file name,
    # readable by the stock handlers alone; a save cut short is a `STEP.orbax-checkpoint-tmp*` directory.
    save_steps(tmp_path, [3])
    step_dir = tmp_path / "checkpoints" / "3"
    assert {p.name for p in step_dir.iterdir() if p.is_dir()} == set(checkpoint.ITEMS) == {"state", "data", "meta"}
    assert json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())["item_handlers"] == recorded
    assert ocp.handlers.JsonCheckpointHandler().restore(step_dir / "meta")["step"] == 3
    assert (step_dir / "meta" / checkpoint.MetaHandler.FILENAME).is_file()
    stock = ocp.handlers.PyTreeCheckpointHandler().restore(
        step_dir / "state", args=ocp.args.PyTreeRestore(item=abstract(make_state(3)),
                                                         restore_args=ocp.checkpoint_utils.construct_restore_args(
                                                             abstract(make_state(3)))))
    np.testing.assert_array_equal(np.asarray(stock["params"]["w"]), np.asarray(make_state(3)["params"]["w"]))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if "tmp" in p.name] == []


PRIVATE_ORBAX = [
    re.compile(r"\bocp\.[A-Za-z_.]*\._"),                        # ocp.x._private
    re.compile(r"\borbax\.checkpoint(\.[A-Za-z_]+)*\._\w+"),         # orbax.checkpoint._src…
    re.compile(r"from orbax[\w.]* import .*\b_\w"),                  # from orbax… import _name
    re.compile(r"\._impl\b|\b_save_fn\b|CommitFutureAwaitingContractedSignals"),
]


def test_no_source_file_reaches_into_orbax_private_names():
    this = Path(__file__).resolve()
    found = []
    for folder in ("valen_jax", "data_pipeline", "benchmarks", "tests", "configs", "launch"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.resolve() == this:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if any(pattern.search(line) for pattern in PRIVATE_ORBAX):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "private Orbax names (use the public API):\n" + "\n".join(found)


def test_a_read_only_manager_logs_no_read_only_warning(tmp_path, caplog):
    """evaluate/predict/generate open the workdir read-only on every run; Orbax's 'Given directory is read
    only' warning said nothing about the directory (issue 27). Other absl records still pass."""
    (tmp_path / "checkpoints").mkdir()
    with caplog.at_level(logging.INFO):
        checkpoint.manager(tmp_path, read_only=True).close()
        logging.getLogger("absl").warning("Given directory is read only=%s", "after")  # the filter is gone
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert messages == ["Given directory is read only=after"], messages
    assert not logging.getLogger("absl").filters
