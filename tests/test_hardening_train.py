"""Issue 19 (training side): no silent fresh start after quarantine, one trainer per workdir, and the
items of 7 that reach training (overlong=skip with nothing fitting, impossible hyper-parameters,
non-finite metrics, control characters in paths, a tokenizer path that does not exist)."""

from __future__ import annotations

import logging

import pytest

from tests.test_checkpoint import abstract, largest_state_file, make_iterator, make_state, save_steps
from valen_jax import checkpoint


def restore(workdir, allow_fresh_start=False):
    mgr = checkpoint.manager(workdir, max_to_keep=5)
    try:
        return checkpoint.restore_intact(mgr, workdir, abstract(make_state(0)), make_iterator(),
                                         lambda step, meta: None, allow_fresh_start=allow_fresh_start)
    finally:
        mgr.close()


def test_a_workdir_whose_checkpoints_were_all_quarantined_is_refused_unless_a_fresh_start_is_asked(tmp_path,
                                                                                                  caplog):
    save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        largest_state_file(tmp_path, step).write_bytes(b"")
    # The run that finds the damage quarantines every step and refuses to start over.
    with pytest.raises(checkpoint.CheckpointError, match="no intact checkpoint") as error:
        restore(tmp_path)
    assert "config.train.allow_fresh_start=True" in str(error.value)
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "checkpoints-corrupt").iterdir()) == ["1", "2"]
    # The next run finds checkpoints/ empty: it used to train from step 0 without a word.
    with pytest.raises(checkpoint.CheckpointError, match="checkpoints-corrupt") as error:
        restore(tmp_path)
    assert "config.train.allow_fresh_start=True" in str(error.value) and "\n" not in str(error.value)
    with caplog.at_level(logging.WARNING, logger="valen_jax.checkpoint"):
        assert restore(tmp_path, allow_fresh_start=True) is None
    assert any("from step 0" in r.getMessage() for r in caplog.records)


def test_allow_fresh_start_still_resumes_an_intact_checkpoint_and_starts_after_damage_found_now(tmp_path):
    save_steps(tmp_path, [1, 2])
    step, _, _ = restore(tmp_path, allow_fresh_start=True)
    assert step == 2  # permission to start over, never an order to: an intact checkpoint is resumed
    for step in (1, 2):
        largest_state_file(tmp_path, step).write_bytes(b"")
    assert restore(tmp_path, allow_fresh_start=True) is None


def test_an_empty_workdir_starts_fresh_without_asking(tmp_path):
    assert restore(tmp_path) is None
