"""Training that survives faults (issue 7): kill -9 while training and while writing a checkpoint,
a damaged latest checkpoint, mismatched tokenizer fingerprints; plus gradient accumulation across
devices and evaluation during training, checked against one uninterrupted reference run.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import waiting
from tests.train_runs import ROOT, env_with_devices, final_params, metrics, run_train, train_command

pytestmark = pytest.mark.heavy
TINY = "configs/vflash.py:tiny"
# Checkpoints at 2, 4, 6, 8 (the tiny config keeps the last 3); the same schedule in every run.
STEPS = ("--config.train.steps=8", "--config.train.log_every=1", "--config.eval.at_end=False",
         "--config.train.checkpoint_every=2")


def assert_same_run(workdir: Path, reference: Path) -> None:
    """Bitwise the reference's parameters after the planned steps, and one record per step, equal losses."""
    step_a, params_a = final_params(reference)
    step_b, params_b = final_params(workdir)
    assert step_a == step_b == 8
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)
    assert [m["step"] for m in metrics(workdir)] == list(range(1, 9))
    assert [m["loss"] for m in metrics(workdir)] == [m["loss"] for m in metrics(reference)]


def start(workdir: Path, *overrides: str, devices: int = 1, hold_write_of: int | None = None, config: str = TINY):
    """`valen_jax.train` in the background; with `hold_write_of`, that step's checkpoint write is held
    open until the process is killed (tests/hold_checkpoint_write.py)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir.parent / f"{workdir.name}.log", "w")
    command = train_command(config, workdir, *overrides)
    if hold_write_of is not None:
        command = [sys.executable, "-m", "tests.hold_checkpoint_write", str(hold_write_of), *command[3:]]
    process = subprocess.Popen(command, cwd=ROOT, env=env_with_devices(devices),
                               stdout=log, stderr=subprocess.STDOUT, text=True)
    return process, workdir.parent / f"{workdir.name}.log"


def wait_for(condition, process) -> None:
    if not waiting.until(condition, process):
        raise AssertionError("the run ended before the fault could be injected")


def logged_steps(workdir: Path) -> int:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.endswith("}"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("reference") / "run"
    run_train(TINY, workdir, *STEPS)
    return workdir


def killed_after_step_5(workdir: Path, config: str = TINY) -> None:
    """`config` trained in `workdir` with STEPS, killed with -9 once it has logged step 5 (before step 8)."""
    process, _ = start(workdir, *STEPS, config=config)
    wait_for(lambda: logged_steps(workdir) >= 5, process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert logged_steps(workdir) < 8, "the run finished before it was killed"


def test_kill_9_while_training_then_the_same_command_resumes_bitwise(tmp_path, reference):
    workdir = tmp_path / "killed"
    killed_after_step_5(workdir)
    result = run_train(TINY, workdir, *STEPS)
    assert "resumed from step" in result.stderr
    assert_same_run(workdir, reference)


LORA = "configs/vflash.py:tiny,lora"


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("lora-reference") / "run"
    run_train(LORA, workdir, *STEPS)
    return workdir


def test_kill_9_of_a_lora_run_resumes_bitwise_from_its_adapter_only_checkpoint(tmp_path, lora_reference):
    """A LoRA checkpoint holds no base: the resume rebuilds it (here fresh, from the recorded seed), checks
    its fingerprints and puts the adapters and their moments back; the run goes on as if never stopped."""
    workdir = tmp_path / "killed-lora"
    killed_after_step_5(workdir, LORA)
    latest = max(int(d.name) for d in (workdir / "checkpoints").iterdir() if d.name.isdigit())
    meta = json.loads((workdir / "checkpoints" / str(latest) / "meta" / "metadata").read_text())
    assert "params/embed" not in " ".join(meta["state_layout"]) and "embed" in meta["lora_base"]["leaves"]

    result = run_train(LORA, workdir, *STEPS)
    assert "resumed from step" in result.stderr
    assert_same_run(workdir, lora_reference)


def test_kill_9_during_a_checkpoint_write_resumes_from_the_previous_complete_one(tmp_path, reference):
    workdir = tmp_path / "killed-in-save"
    # Step 4's background write is held open (the save call returned, training goes on): kill inside it.
    process, log = start(workdir, *STEPS, hold_write_of=4)
    wait_for(lambda: "holding the write of checkpoint 4 open" in log.read_text(), process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    checkpoints = workdir / "checkpoints"
    assert (checkpoints / "2").is_dir() and not (checkpoints / "4").exists()
    assert list(checkpoints.glob("4.orbax-checkpoint-tmp*")), "step 4 was not being written when killed"

    result = run_train(TINY, workdir, *STEPS)
    assert "resumed from step 2" in result.stderr
    assert not list(checkpoints.glob("*.orbax-checkpoint-tmp*"))
    assert_same_run(workdir, reference)


def test_a_corrupted_latest_checkpoint_is_named_in_a_warning_and_the_previous_one_is_used(tmp_path, reference):
    workdir = tmp_path / "corrupted"
    shutil.copytree(reference, workdir)
    files = [p for p in (workdir / "checkpoints" / "8" / "state").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])  # reads back without error
    largest.write_bytes(bytes(data))

    result = run_train(TINY, workdir, *STEPS)
    assert "checkpoint 8 is corrupt" in result.stderr
    assert "resumed from step 6" in result.stderr
    assert [p.name.split("-")[0] for p in (workdir / "checkpoints-corrupt").iterdir()] == ["8"]
    assert_same_run(workdir, reference)


def test_shards_or_a_tokenizer_other_than_the_checkpoints_are_refused(tmp_path, reference):
    workdir = tmp_path / "mismatch"
    shutil.copytree(reference, workdir)

    # A train shard directory whose manifest names another tokenizer fingerprint.
    shards = tmp_path / "other-shards"
    shutil.copytree(next((workdir / "shards").iterdir()), shards)
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"]["vocab_sha256"] = "0" * 64
    (shards / "manifest.json").write_text(json.dumps(manifest))
    refused = run_train(TINY, workdir, *STEPS, f"--config.data.train={shards}", "--config.train.steps=10",
                        check=False)
    assert refused.returncode != 0
    assert "shards were made with tokenizer" in refused.stderr and "reconvert" in refused.stderr

    # The same run with another tokenizer (its chat template differs) than the checkpoint's.
    tokenizer = tmp_path / "other-tokenizer"
    shutil.copytree(ROOT / "data/tokenizer", tokenizer)
    template = tokenizer / "chat_template.jinja"
    template.write_text(template.read_text() + "{#- another template -#}\n")
    refused = run_train(TINY, workdir, *STEPS, f"--config.data.tokenizer={tokenizer}", "--config.train.steps=10",
                        check=False)
    assert refused.returncode != 0
    assert "checkpoint 8 was trained with tokenizer" in refused.stderr
    # A mismatch is the user's to fix, never a reason to fall back: every checkpoint stays.
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [4, 6, 8]
    assert not (workdir / "checkpoints-corrupt").exists()


def test_accumulated_micro_batches_on_4_devices_match_and_evaluation_runs_during_training(tmp_path, reference):
    workdir = tmp_path / "accumulated"
    run_train(TINY, workdir, *STEPS, "--config.train.grad_accum_steps=2", "--config.mesh.data=4",
              "--config.eval.every=4", devices=4)
    records = metrics(workdir)
    assert [m["step"] for m in records] == list(range(1, 9))
    np.testing.assert_allclose([m["loss"] for m in records], [m["loss"] for m in metrics(reference)], rtol=1e-4)
    evaluated = [m["step"] for m in records if "eval_loss" in m]
    assert evaluated == [4, 8]
    for m in records:
        assert m["mfu"] > 0 and 0 <= m["padding_fraction"] < 1 and m["tokens_per_second"] > 0
        assert {"loss_tokens", "loss_z", "learning_rate", "grad_norm", "examples_seen"} <= set(m)
    assert all(np.isfinite(m["eval_loss"]) and 0 <= m["eval_accuracy"] <= 1 for m in records if "eval_loss" in m)


def test_a_workdir_whose_checkpoints_were_all_quarantined_is_refused_not_restarted(tmp_path, reference):
    # Issue 19: a previous run moved every checkpoint to checkpoints-corrupt/; this one used to train from 0.
    workdir = tmp_path / "quarantined"
    shutil.copytree(reference, workdir)
    (workdir / "checkpoints-corrupt").mkdir()
    for step in (4, 6, 8):
        (workdir / "checkpoints" / str(step)).rename(workdir / "checkpoints-corrupt" / f"{step}-20260101-000000")
    refused = run_train(TINY, workdir, *STEPS, check=False)
    assert refused.returncode != 0
    assert "no checkpoint, and 3 damaged one(s)" in refused.stderr
    assert "--config.train.allow_fresh_start=True" in refused.stderr
    assert not list((workdir / "checkpoints").iterdir()) and [m["step"] for m in metrics(workdir)] == list(range(1, 9))
