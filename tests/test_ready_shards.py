"""Shards made by `python -m data_pipeline.convert` are training and evaluation data as they are (issue 27):
the config's converter options (`data.train_options` / `data.eval_options`) no longer refuse a shard
folder; the manifest's own options are logged and a difference is one warning line."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from data_pipeline.tokenizer import load_tokenizer
from tests.train_runs import ROOT, run_module
from valen_jax.data.shard_cache import ensure_shards
from valen_jax.training.checkpoint import fingerprint_of

TOKENIZER = ROOT / "data/tokenizer"


@pytest.fixture(scope="module")
def chat_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("ready") / "chat_shards"
    run_module("data_pipeline.convert", "--format=chat", f"--input={ROOT / 'data/smoke/chat/train.jsonl'}",
               f"--output={out}", f"--tokenizer={TOKENIZER}")
    return out


def test_a_shard_folder_is_used_as_converted_and_a_differing_option_is_one_warning(chat_shards, tmp_path, caplog):
    fingerprint = fingerprint_of(load_tokenizer(TOKENIZER))
    with caplog.at_level(logging.INFO, logger="valen_jax.data.shard_cache"):
        # convert's default is configs/chat.py's assistant_turns=all; a config asking for last differs.
        shard_set = ensure_shards("chat", chat_shards, tmp_path / "cache", TOKENIZER, fingerprint,
                                  {"assistant_turns": "last"})
    assert shard_set.directory == chat_shards and len(shard_set) > 0
    assert not (tmp_path / "cache").exists()  # nothing converted: the folder is the data
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("converted with options" in m and "'assistant_turns': 'all'" in m for m in infos), infos
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "assistant_turns='last' (shards: 'all')" in warnings[0]


def test_matching_or_no_options_warn_nothing(chat_shards, tmp_path, caplog):
    fingerprint = fingerprint_of(load_tokenizer(TOKENIZER))
    with caplog.at_level(logging.INFO, logger="valen_jax.data.shard_cache"):
        ensure_shards("chat", chat_shards, tmp_path / "cache", TOKENIZER, fingerprint, {"assistant_turns": "all"})
        ensure_shards("chat", chat_shards, tmp_path / "cache", TOKENIZER, fingerprint, {})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.slow
def test_evaluate_reads_a_shard_folder_whatever_the_workdirs_eval_options(tmp_path_factory, tmp_path):
    """configs/chat.py's eval_options (assistant_turns) once refused a shard folder as --data, with no way
    around it; the command now evaluates it, and the difference from the shards' options is not an error."""
    from tests.smoke_workdirs import smoke_workdir

    workdir = smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")
    shards = tmp_path / "eval_shards"
    run_module("data_pipeline.convert", "--format=chat", "--assistant-turns=last",
               f"--input={ROOT / 'data/smoke/chat/eval.jsonl'}", f"--output={shards}", f"--tokenizer={TOKENIZER}")
    copy = tmp_path / "wd"
    shutil.copytree(workdir, copy)
    result = run_module("valen_jax.evaluate", f"--workdir={copy}", f"--data={shards}",
                        f"--output={tmp_path / 'report.json'}", timeout=600)
    assert json.loads((tmp_path / "report.json").read_text())
    differ = [line for line in result.stderr.splitlines() if "converter options differ" in line]
    assert len(differ) == 1 and "assistant_turns='all' (shards: 'last')" in differ[0], result.stderr[-3000:]
