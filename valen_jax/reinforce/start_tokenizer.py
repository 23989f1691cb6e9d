"""The tokenizer of a reinforcement run that starts from another workdir (`config.rl.from_workdir`).

The start's embeddings index its own tokenizer, kept in `WORKDIR/tokenizer` by the run that wrote it, so
that tokenizer is the run's (issue 54: the run read `data/tokenizer`, every config file's default, and
the refusal showed two digests). `resolve` runs in the preflight, before the loop loads the tokenizer:

- `config.data.tokenizer` left at the config files' default (`configs/common.py` sets the repository's
  `data/tokenizer`): it becomes `WORKDIR/tokenizer`, logged.
- set to anything else (the user chose it): it must be the start's tokenizer; another is refused naming
  both paths and the key to change.

The config files give no way to tell "left at the default" from "set to the default" (a placeholder
would need the config files and the schema to change), so a user who names `data/tokenizer` itself gets
the start's tokenizer too: the start cannot be trained with another.
"""

from __future__ import annotations

import logging
from pathlib import Path

from data_pipeline.tokenizer import load_tokenizer
from valen_jax.errors import ConfigError
from valen_jax.training import checkpoint

log = logging.getLogger(__name__)

# configs/common.py's `data_group` sets this for every config file (the repository's smoke tokenizer).
CONFIG_DEFAULT = Path(__file__).resolve().parents[2] / "data" / "tokenizer"


def is_config_default(tokenizer: object) -> bool:
    return isinstance(tokenizer, str) and Path(tokenizer).resolve() == CONFIG_DEFAULT


def resolve(config) -> None:
    """Point `config.data.tokenizer` at `config.rl.from_workdir`'s tokenizer, or refuse another one the user set."""
    if not config.rl.from_workdir:
        return
    workdir = Path(str(config.rl.from_workdir)).resolve()
    start = checkpoint.tokenizer_dir(workdir)
    key = f"config.rl.from_workdir={workdir}"
    if not start.is_dir():
        raise ConfigError(f"{key}: no {start}; the policy starts from a workdir valen_jax.train wrote "
                          "(train the SFT run there first, train.mode=ar)")
    given = str(config.data.tokenizer)
    if is_config_default(given):
        log.info("tokenizer: %s (the start's, config.rl.from_workdir; config.data.tokenizer was the default %s)",
                 start, given)
        config.data.tokenizer = str(start)
        return
    family = config.data.template_family
    if checkpoint.fingerprint_of(load_tokenizer(given, family)) != checkpoint.fingerprint_of(load_tokenizer(start, family)):
        raise ConfigError(f"config.data.tokenizer={given} is not the tokenizer of {key} ({start}), whose "
                          "embeddings the policy starts from: leave config.data.tokenizer unset to use the start's, "
                          f"or set it to {start}")
