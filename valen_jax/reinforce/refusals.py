"""Seed 003's refusals of a reinforcement run (or a smoke check), made from the config and the rows
before any device is claimed: "An evaluation, a reinforcement run and a smoke check read prompts,
which prepared rows do not hold"; "Optimize refuses a reinforcement run over a dataset with
images"; and a row with no assistant message has no prompt to read. Each error names the dataset,
and for a row its file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from valen_jax.data.prepared_checks import is_prepared_run
from valen_jax.errors import ConfigError

_IMAGE_PARTS = ("image", "image_url", "video")


def check_not_prepared(config, what: str = "a reinforcement run") -> None:
    if is_prepared_run(config):
        key = "format" if config.data.format == "prepared" else "eval_format"
        raise ConfigError(f"config.data.{key}='prepared': {what} reads prompts, which prepared rows do not hold "
                          "(seed 003); train on chat or vakforge rows")


def prompts(path: str | Path) -> Iterator[tuple[list[Mapping], Mapping, str]]:
    """(prompt messages, gold assistant message, 'file:line') for each assistant message of each row:
    the prompt is the conversation before it. Refuses image rows and rows with no assistant message."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ConfigError(f"{where}: not JSON: {error}") from None
            messages = row.get("messages") if isinstance(row, Mapping) else None
            if not isinstance(messages, list):
                raise ConfigError(f"{where}: a chat row needs a \"messages\" list")
            found = False
            for index, message in enumerate(messages):
                content = message.get("content")
                if isinstance(content, list) and any(
                        isinstance(p, Mapping) and p.get("type") in _IMAGE_PARTS for p in content):
                    raise ConfigError(f"{where}: message {index} holds an image; seed 003 refuses a reinforcement "
                                      f"run over a dataset with images ({path})")
                if message.get("role") == "assistant":
                    found = True
                    yield messages[:index], message, where
            if not found:
                raise ConfigError(f"{where}: no assistant message, so no prompt to read (the prompt is the "
                                  "conversation before an assistant message)")
