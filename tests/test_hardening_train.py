"""Issue 19 (training side): no silent fresh start after quarantine, one trainer per workdir, and the
items of 7 that reach training (overlong=skip with nothing fitting, impossible hyper-parameters,
non-finite metrics, control characters in paths, a tokenizer path that does not exist)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys

import grain
import pytest

from data_pipeline.cli_paths import PathError, check_path
from data_pipeline.tokenizer import TokenizerError, load_tokenizer
from tests.test_checkpoint import abstract, largest_state_file, make_iterator, make_state, save_steps
from tests.test_packing import SPEC as PACK_SPEC
from tests.test_packing import make_piece
from tests.train_runs import ROOT, run_module, run_train, train_command
from valen_jax.config.schema import ConfigError, validate_config
from valen_jax.data.assemble import AssemblyError, RowSpec
from valen_jax.data.packing import PackingSpec, PackIterDataset
from valen_jax.training import checkpoint, workdir_lock


@pytest.fixture
def tiny_config():
    import importlib.util
    spec = importlib.util.spec_from_file_location("hardening_vflash_cfg", ROOT / "configs/vflash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny")


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
    with caplog.at_level(logging.WARNING, logger="valen_jax.training.checkpoint"):
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
        refused = run_train("configs/vflash.py:tiny", tmp_path, check=False)
        assert refused.returncode != 0
        assert f"{tmp_path}: another trainer is running in this workdir (pid {os.getpid()}" in refused.stderr
        assert not (tmp_path / "shards").exists() and not (tmp_path / "checkpoints").exists()
    # A holder killed with SIGKILL (no cleanup of any kind) leaves the workdir free.
    crashed = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys\n"
        "from valen_jax.training import workdir_lock\n"
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
        "from valen_jax.training import workdir_lock\n"
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


def strict_records(workdir):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return [json.loads(line, parse_constant=refuse) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("log_every", [1, 100], ids=["caught-when-logged", "caught-before-saving"])
def test_a_non_finite_loss_stops_the_run_before_its_step_is_checkpointed(tmp_path, log_every):
    # A finite but absurd learning rate: the first update overflows the weights, step 2's loss is NaN.
    result = run_train(
        "configs/vflash.py:tiny", tmp_path, "--config.train.steps=4", "--config.train.learning_rate=1e30",
        "--config.train.warmup_steps=0", f"--config.train.log_every={log_every}",
        "--config.train.checkpoint_every=1", "--config.eval.at_end=False", "--config.eval.every=0",
        timeout=600, check=False)
    assert result.returncode != 0
    assert ("NonFiniteLoss: step 2: the training loss is nan; stopped without checkpointing this step "
            "(latest checkpoint: step 1)") in result.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
    records = strict_records(tmp_path)
    if log_every == 1:
        assert [r["step"] for r in records] == [1, 2] and records[1]["loss"] is None
        assert records[1]["nonfinite"]["loss"] == "nan"
    else:
        assert [r["step"] for r in records] == [1]


@pytest.mark.parametrize("bad", ["a\x00b", "runs/x\nE1201 00:00:00 forged.py:1] fake error", "a\rb"])
def test_a_path_with_a_control_character_is_one_error_line_showing_it_with_repr(bad):
    with pytest.raises(PathError) as error:
        check_path("--workdir", bad)
    assert str(error.value).startswith(f"--workdir: {bad!r} holds the control character")
    assert "\n" not in str(error.value) and "\x00" not in str(error.value)
    check_path("--workdir", "runs/ok path-ü")  # spaces and non-ASCII are ordinary


def test_a_config_path_with_nul_is_refused_by_field(tiny_config):
    # A NUL cannot come through argv, only from a config file; it used to surface as "embedded null byte".
    with tiny_config.unlocked():
        tiny_config.data.train = "data/smoke/vflash/recipe\x00.json"
    with pytest.raises(ConfigError, match=r"config.data.train: 'data/smoke/vflash/recipe\\x00.json' holds"):
        validate_config(tiny_config)


def cli_lines(command: list[str]) -> list[str]:
    """The stderr lines of `[python, -m, module, *args]`, run forked from the warm parent; it must fail cleanly."""
    assert command[:2] == [sys.executable, "-m"], command
    result = run_module(command[2], *command[3:], check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.splitlines()


@pytest.mark.slow  # train CLI subprocesses
def test_cli_paths_with_a_newline_are_refused_in_one_line_not_forged_into_two(tmp_path):
    forged = "E0000 forged.py:1] a second error line"
    workdir = tmp_path / f"run\n{forged}"
    lines = cli_lines(train_command("configs/vflash.py:tiny", workdir))
    assert lines[-1] == f"PathError: --workdir: {str(workdir)!r} holds the control character '\\n'; " \
                        "paths with NUL, newlines or other control characters are refused"
    assert not any(line.startswith(forged) for line in lines) and not workdir.exists()
    lines = cli_lines([sys.executable, "-m", "valen_jax.evaluate", f"--workdir={tmp_path}",
                       f"--data={tmp_path}/eval\n{forged}.jsonl", f"--output={tmp_path}/report.json"])
    assert lines == [f"error: --data: {str(tmp_path) + '/eval' + chr(10) + forged + '.jsonl'!r} holds the control "
                     "character '\\n'; paths with NUL, newlines or other control characters are refused"]


@pytest.mark.slow  # train CLI subprocesses
def test_a_missing_tokenizer_is_one_line_naming_the_path_not_a_page_of_hub_errors(tmp_path, monkeypatch):
    with pytest.raises(TokenizerError) as error:
        load_tokenizer(tmp_path / "no-such-tokenizer")
    assert str(error.value) == f"{str(tmp_path / 'no-such-tokenizer')!r}: no such directory"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TokenizerError, match=r"^'no-such-org/no-such-model': no such directory, and not a hub "
                                             r"name in the cache \(.*\)$"):
        load_tokenizer("no-such-org/no-such-model")
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(ROOT / "data/tokenizer/tokenizer.json")
    lines = cli_lines(train_command("configs/vflash.py:tiny", tmp_path / "run",
                                    f"--config.data.tokenizer={tmp_path / 'missing'}"))
    assert lines[-1] == f"TokenizerError: {str(tmp_path / 'missing')!r}: no such directory"
    assert sum(str(tmp_path / "missing") in line for line in lines) == 1


def endless(pieces, packing):
    # Training's stream repeats without end: before the stop, nothing fitting meant next() never returned.
    return iter(PackIterDataset(grain.MapDataset.source(pieces).repeat(None).to_iter_dataset(), PACK_SPEC, packing))


def test_overlong_skip_with_no_record_fitting_stops_once_every_record_was_skipped():
    rows = endless([make_piece(i, 11) for i in range(3)], PackingSpec(overlong="skip", records=3))
    with pytest.raises(AssemblyError, match=r"none of the 3 training records fits a row \(each was read and "
                                            r"skipped; the last, hand\.jsonl:2: 11 tokens"):
        next(rows)


def test_overlong_skip_never_stops_while_some_record_fits():
    # The one record that fits comes after each of the others was skipped five times over.
    rows = endless([make_piece(i, 11) for i in range(3)] * 5 + [make_piece(3, 4)],
                   PackingSpec(overlong="skip", records=4))
    assert [int(next(rows)["tokens"][0]) for _ in range(3)] == [103] * 3


@pytest.mark.slow
def test_a_run_where_no_record_fits_stops_with_one_line(tmp_path):
    lines = cli_lines(train_command("configs/vflash.py:tiny", tmp_path, "--config.data.seq_len=16",
                                    "--config.data.overlong=skip", "--config.train.steps=1",
                                    "--config.eval.every=0", "--config.eval.at_end=False"))
    # (the progress bar's last refresh may follow the error line)
    assert [line for line in lines if line.startswith("AssemblyError")] == [next(
        line for line in lines if "none of the 96 training records fits a row" in line)]


def test_a_valen_set_where_no_labeled_record_fits_is_refused_at_start_up_even_with_skip(tmp_path):
    # Valen drops a row that does not fit; with none fitting, the loader used to wait for one forever.
    from data_pipeline.conversion import convert
    from valen_jax.data.sources import ShardSet
    from valen_jax.data.valen_fit import check_training_set
    from valen_jax.data.valen_rows import QuestionSpec
    from valen_jax.models.config import ModelConfig, VisionConfig, padded_vocab

    convert("valen", ROOT / "data/smoke/valen/train.jsonl", tmp_path / "shards", ROOT / "data/tokenizer",
            progress=False)
    tokenizer = load_tokenizer(ROOT / "data/tokenizer")
    cfg = ModelConfig(vocab_size=padded_vocab(len(tokenizer)), dim=8, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=8, mlp_dim=8, score_head=True,
                      image_pad_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                      vision=VisionConfig(patch_size=8, merge_size=2, temporal_patch_size=2, dim=8, num_layers=1,
                                          num_heads=1, mlp_dim=8))
    media = {"max_pixels": 64 * 64, "max_frames": 4}
    question = QuestionSpec("question", 4, 8, training=True)
    shards = ShardSet.open(tmp_path / "shards")
    fitting = check_training_set(shards, RowSpec.of(256, 256, tokenizer, cfg, media), question, "skip")
    assert fitting.records == 6 and len(fitting.unfit) < 6
    with pytest.raises(ConfigError, match=r"6 of 6 records do not fit.*No record is left to train on"):
        check_training_set(shards, RowSpec.of(16, 256, tokenizer, cfg, media), question, "skip")


@pytest.mark.parametrize("cli, args", [
    ("data_pipeline.validate", ["--format=chat", "{ok}", "{bad}"]),
    pytest.param("data_pipeline.convert", ["--format=chat", "--input={bad}", "--output={ok}.shards",
                                           "--tokenizer=data/tokenizer"], marks=pytest.mark.slow),
    pytest.param("valen_jax.predict", ["--workdir={ok}", "--data={bad}", "--output={ok}.answers"],
                 marks=pytest.mark.slow),
])
def test_the_data_clis_refuse_a_path_with_a_newline_in_one_line(tmp_path, cli, args):
    ok, bad = tmp_path / "ok.jsonl", f"{tmp_path}/x\n{tmp_path}/x.jsonl:1: messages: a forged problem"
    label = {"data_pipeline.validate": "PATH", "data_pipeline.convert": "--input", "valen_jax.predict": "--data"}[cli]
    lines = cli_lines([sys.executable, "-m", cli, *(a.format(ok=ok, bad=bad) for a in args)])
    assert lines == [f"error: {label}: {bad!r} holds the control character '\\n'; "
                     "paths with NUL, newlines or other control characters are refused"]
