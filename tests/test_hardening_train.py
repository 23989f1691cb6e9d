"""Issue 19 (training side): no silent fresh start after quarantine, one trainer per workdir, and the
items of 7 that reach training (overlong=skip with nothing fitting, impossible hyper-parameters,
non-finite metrics, control characters in paths, a tokenizer path that does not exist)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.test_checkpoint import abstract, largest_state_file, make_iterator, make_state, save_steps
from tests.train_runs import ROOT, env_with_devices, train_command
from valen_jax import checkpoint, workdir_lock


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


def test_a_second_trainer_on_a_workdir_is_refused_naming_the_holder_and_a_crash_frees_it(tmp_path):
    with workdir_lock.exclusive(tmp_path):
        assert (tmp_path / "train.lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
        with pytest.raises(workdir_lock.WorkdirBusy, match=f"pid {os.getpid()} on "):
            with workdir_lock.exclusive(tmp_path):
                pass
        # The real second trainer: refused at start-up with one line naming the workdir and the holder.
        refused = subprocess.run(train_command("configs/vflash.py:tiny", tmp_path), cwd=ROOT,
                                 env=env_with_devices(1), capture_output=True, text=True, timeout=300)
        assert refused.returncode != 0
        assert f"{tmp_path}: another trainer is running in this workdir (pid {os.getpid()}" in refused.stderr
        assert not (tmp_path / "shards").exists() and not (tmp_path / "checkpoints").exists()
    # A holder killed with SIGKILL (no cleanup of any kind) leaves the workdir free.
    crashed = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys\n"
        "from valen_jax import workdir_lock\n"
        f"with workdir_lock.exclusive({str(tmp_path)!r}):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert crashed.returncode == -signal.SIGKILL
    with workdir_lock.exclusive(tmp_path):
        pass


def test_a_forked_child_outliving_a_killed_trainer_does_not_keep_the_workdir_locked(tmp_path):
    # The trainer forks a worker (as Grain or a converter may), then dies by SIGKILL; the worker lives on,
    # blocked on its stdin, holding a copy of every descriptor its parent had at the fork.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, sys\n"
        "from valen_jax import workdir_lock\n"
        f"with workdir_lock.exclusive({str(tmp_path)!r}):\n"
        "    if os.fork() == 0:\n"
        "        print('forked', flush=True)\n"
        "        sys.stdin.read()\n"
        "        os._exit(0)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "forked\n"  # the worker is alive (the trainer may be dead already)
        assert holder.wait(timeout=120) == -signal.SIGKILL
        with workdir_lock.exclusive(tmp_path):
            pass
    finally:
        holder.stdin.close()  # lets the worker exit
