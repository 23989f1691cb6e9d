"""A reinforcement run from `config.rl.from_workdir` uses that workdir's tokenizer (issue 54, failure 5).

It used `data/tokenizer` (every config file's default for config.data.tokenizer), and an SFT run trained
with another tokenizer was refused with two digests. Now the start's `WORKDIR/tokenizer` is the run's
unless the user set config.data.tokenizer, and then another one is refused naming both paths and the key.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.test_reinforce_mode import arithmetic, tiny_config
from tests.train_runs import ROOT, run_train
from valen_jax.errors import ConfigError

SMOKE_TOKENIZER = ROOT / "data" / "tokenizer"


def other_tokenizer(path: Path) -> Path:
    """The smoke tokenizer with one more word: another vocabulary, as a hub checkpoint's would be."""
    tokenizer = AutoTokenizer.from_pretrained(str(SMOKE_TOKENIZER))
    tokenizer.add_tokens(["<reinforce_start_word>"])
    tokenizer.save_pretrained(str(path))
    return path


def start_workdir(tmp_path: Path) -> Path:
    """What the preflight reads of an SFT workdir: the tokenizer valen_jax.train keeps there."""
    workdir = tmp_path / "sft"
    other_tokenizer(workdir / "tokenizer")
    return workdir


def config_for(tmp_path: Path, start: Path):
    train, eval_ = arithmetic(tmp_path)
    config = tiny_config()
    config.data.train, config.data.eval = str(train), str(eval_)
    config.rl.from_workdir = str(start)
    return config


def test_the_default_tokenizer_becomes_the_start_workdirs(tmp_path):
    from valen_jax.tasks.reinforce import preflight

    start = start_workdir(tmp_path)
    config = config_for(tmp_path, start)
    assert Path(config.data.tokenizer).resolve() == SMOKE_TOKENIZER  # the config file's default
    preflight(config)
    assert config.data.tokenizer == str((start / "tokenizer").resolve())


def test_a_tokenizer_the_user_set_must_be_the_starts_named_by_both_paths(tmp_path):
    from valen_jax.train import run

    start = start_workdir(tmp_path)
    config = config_for(tmp_path, start)
    mine = tmp_path / "my_tokenizer"
    shutil.copytree(SMOKE_TOKENIZER, mine)
    config.data.tokenizer = str(mine)
    workdir = tmp_path / "rl"
    with pytest.raises(ConfigError) as refused:
        run(config, workdir)
    assert str(refused.value) == (
        f"config.data.tokenizer={mine} is not the tokenizer of config.rl.from_workdir={start.resolve()} "
        f"({start.resolve() / 'tokenizer'}), whose embeddings the policy starts from: leave config.data.tokenizer "
        f"unset to use the start's, or set it to {start.resolve() / 'tokenizer'}")
    assert not workdir.exists()  # before any device or workdir

    # The start's own tokenizer, wherever the user keeps a copy, is accepted as set.
    shutil.rmtree(mine)
    shutil.copytree(start / "tokenizer", mine)
    from valen_jax.tasks.reinforce import preflight

    preflight(config)
    assert config.data.tokenizer == str(mine)


def test_a_start_without_a_tokenizer_is_refused_by_its_key(tmp_path):
    from valen_jax.train import run

    config = config_for(tmp_path, tmp_path / "nothing")
    with pytest.raises(ConfigError, match=rf"config.rl.from_workdir={tmp_path / 'nothing'}: no "
                                          rf"{tmp_path / 'nothing' / 'tokenizer'}; the policy starts from"):
        run(config, tmp_path / "rl")


@pytest.mark.heavy
def test_a_run_from_an_sft_workdir_with_another_tokenizer_trains(tmp_path):
    # The user's case: the SFT run named its own tokenizer; the reinforcement run names only the workdir.
    train, eval_ = arithmetic(tmp_path)
    data = (f"--config.data.train={train}", f"--config.data.eval={eval_}")
    tokenizer = other_tokenizer(tmp_path / "hub_tokenizer")
    sft = tmp_path / "sft"
    run_train("configs/reinforce.py:sft,tiny", sft, *data, f"--config.data.tokenizer={tokenizer}",
              "--config.train.steps=2", "--config.train.checkpoint_every=2", "--config.eval.at_end=False")
    rl = tmp_path / "rl"
    result = run_train("configs/reinforce.py:tiny", rl, *data, f"--config.rl.from_workdir={sft}",
                       "--config.train.steps=1", "--config.train.checkpoint_every=1")
    assert f"tokenizer: {sft / 'tokenizer'} (the start's, config.rl.from_workdir" in result.stderr
    from valen_jax.training import checkpoint

    mgr = checkpoint.manager(rl, read_only=True)
    try:
        meta = checkpoint.restore_meta(mgr, 1)
    finally:
        mgr.close()
    assert meta["tokenizer"]["source"] == str(sft / "tokenizer")
    assert meta["reinforce"]["start"]["workdir"] == str(sft)
