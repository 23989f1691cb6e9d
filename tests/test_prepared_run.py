"""Seed 003: a run on prepared token rows is refused before it claims a device (tokenizer digests,
repository and commit, longest row vs data.seq_len, a prepared set paired with a chat set), and
trains end to end on the prepared smoke set (configs/prepared.py, data/make_prepared_smoke.py)."""

from __future__ import annotations

import hashlib
import logging
import math
import shutil

import pytest

from configs import prepared as prepared_config
from tests.train_runs import ROOT, metrics, run_train
from valen_jax import train
from valen_jax.config.schema import ConfigError
from valen_jax.data.prepared_checks import check_prepared_run
from valen_jax.training import loop

TOKENIZER = ROOT / "data/tokenizer"
# data/make_prepared_smoke.py records this stand-in identity for the plain tokenizer folder.
COMMIT = hashlib.sha1((TOKENIZER / "tokenizer.json").read_bytes()).hexdigest()


def _config(**data):
    config = prepared_config.get_config("tiny")
    for key, value in data.items():
        config.data[key] = value
    return config


def _snapshot(tmp_path, repository: str, commit: str, template: str | None = None):
    """The tokenizer laid out as the Hugging Face cache keeps a download: it names repository and commit."""
    folder = tmp_path / f"models--{repository.replace('/', '--')}" / "snapshots" / commit
    shutil.copytree(TOKENIZER, folder)
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def test_the_smoke_rows_pass_and_a_plain_tokenizer_folder_is_said_to_be_checked_by_digest_only(caplog):
    with caplog.at_level(logging.WARNING, logger="valen_jax.data.prepared_checks"):
        check_prepared_run(_config())
    assert "repository and commit are unknown" in caplog.text


def test_longest_row_over_seq_len_is_refused_not_skipped():
    with pytest.raises(ConfigError, match=r"train.zip/train.parquet:0: longestRow: 470 tokens, longer than "
                                          r"maxSeqLength 256"):
        check_prepared_run(_config(seq_len=256, overlong="skip"))


def test_prepared_paired_with_chat_is_refused():
    with pytest.raises(ConfigError, match="eval_format='chat'.*make both sets prepared, or neither"):
        check_prepared_run(_config(eval=str(ROOT / "data/smoke/chat/eval.jsonl"), eval_format="chat"))
    with pytest.raises(ConfigError, match="format='chat' and config.data.eval_format='prepared'"):
        check_prepared_run(_config(train=str(ROOT / "data/smoke/chat/train.jsonl"), format="chat"))


def test_tokenizer_repository_commit_and_digests_must_be_the_base_models(tmp_path):
    check_prepared_run(_config(tokenizer=str(_snapshot(tmp_path / "same", "valen/smoke-tokenizer", COMMIT))))
    other_repo = _snapshot(tmp_path / "repo", "valen/other", COMMIT)
    with pytest.raises(ConfigError, match="tokenizer.repository: prepared at .valen/smoke-tokenizer., but the run "
                                          "trains .valen/other."):
        check_prepared_run(_config(tokenizer=str(other_repo)))
    other_commit = _snapshot(tmp_path / "commit", "valen/smoke-tokenizer", "f" * 40)
    with pytest.raises(ConfigError, match="tokenizer.revision"):
        check_prepared_run(_config(tokenizer=str(other_commit)))
    # The base model (init_from) names the identity; the tokenizer's template here differs too.
    changed = _snapshot(tmp_path / "template", "valen/smoke-tokenizer", COMMIT, template="{{ messages }}")
    with pytest.raises(ConfigError, match="chatTemplateSha256: prepared with another tokenizer"):
        check_prepared_run(_config(tokenizer=str(changed)))


def test_train_refuses_before_shards_or_mesh(tmp_path, monkeypatch):
    def claimed(*args, **kwargs):
        raise AssertionError("a device was claimed before the prepared rows were checked")

    monkeypatch.setattr(loop, "config_shards", claimed)
    monkeypatch.setattr(loop.sharding, "make_mesh", claimed)
    with pytest.raises(ConfigError, match="longestRow"):
        train.run(_config(seq_len=256), tmp_path)


@pytest.mark.slow
def test_training_on_prepared_rows_end_to_end(tmp_path):
    workdir = tmp_path / "run"
    run_train("configs/prepared.py:tiny", workdir, "--config.train.steps=3", "--config.train.checkpoint_every=3",
              "--config.eval.every=3")
    logged = metrics(workdir)
    assert [m["step"] for m in logged] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) for m in logged) and math.isfinite(logged[-1]["eval_loss"])
    manifest = (workdir / "shards").glob("*/manifest.json")
    assert any('"prepared"' in path.read_text() for path in manifest)  # the descriptor travels with the shards


def test_the_prepared_smoke_set_regenerates_byte_identically(tmp_path):
    import subprocess
    import sys

    subprocess.run([sys.executable, str(ROOT / "data/make_prepared_smoke.py"), f"--out={tmp_path}"], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    for name in ("train.zip", "eval.zip"):
        assert (tmp_path / name).read_bytes() == (ROOT / "data/smoke/prepared" / name).read_bytes(), name


@pytest.mark.parametrize("variant", ["", "tiny", "hf"])
def test_every_variant_of_the_prepared_config_validates(variant):
    from valen_jax.config.schema import validate_config

    config = prepared_config.get_config(variant)
    validate_config(config)
    assert (config.data.format, config.data.eval_format, config.model.vision, config.eval.at_end) == (
        "prepared", "prepared", None, False)


def test_ready_shards_are_checked_by_the_descriptor_their_manifest_keeps(tmp_path):
    from data_pipeline.conversion import convert

    shards = tmp_path / "shards"
    convert("prepared", ROOT / "data/smoke/prepared/train.zip", shards, TOKENIZER)
    check_prepared_run(_config(train=str(shards)))
    with pytest.raises(ConfigError, match="longestRow: 470 tokens"):
        check_prepared_run(_config(train=str(shards), seq_len=300))
    chat = tmp_path / "chat"
    convert("chat", ROOT / "data/smoke/chat/eval.jsonl", chat, TOKENIZER)
    with pytest.raises(ConfigError, match="shards without a prepared descriptor"):
        check_prepared_run(_config(train=str(chat)))
