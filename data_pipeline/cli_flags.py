"""Multi-word command-line flags: spelled with hyphens, the underscore spelling kept as an alias.

Every argparse CLI (`valen_jax.evaluate`, `predict`, `generate`, `regenerate`, `export`;
`data_pipeline.validate`, `convert`, `split`, `prepared`, `registry`, `vakforge`) registers its
multi-word flags through `add_flag`:

    add_flag(parser, "--max-new-tokens", type=int, default=None, help="...")

`--max-new-tokens` is the documented spelling, the one `--help`, the usage line and argparse's
error messages show; `--max_new_tokens` parses to the same `dest` (`max_new_tokens`), so command
lines written either way keep working. Nothing else is accepted: a misspelt or unknown flag is still
argparse's error. (Abbreviations still work as far as they are unique among the spellings: `--max-new`
does, but `--batch` now matches both `--batch-size` and `--batch_size` and is refused as ambiguous.)
Here, under data_pipeline, so that its CLIs can use it too (data_pipeline never imports valen_jax).
"""

from __future__ import annotations

import argparse
from typing import Any


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> argparse.Action:
    """`parser.add_argument(flag, **kwargs)` for a hyphenated long flag such as `--max-new-tokens`, with
    its underscore spelling `--max_new_tokens` also accepted (same action, same `dest`) but not shown.
    `parser` may be a subcommand's parser or an argument group; a one-word flag gets no alias."""
    if not flag.startswith("--") or "_" in flag:
        raise ValueError(f"add_flag({flag!r}): give the hyphenated long spelling, e.g. --max-new-tokens")
    alias = "--" + flag[2:].replace("-", "_")
    action = parser.add_argument(flag, *([alias] if alias != flag else []), **kwargs)
    # argparse looks the alias up in the parser's own table; `option_strings` is only what help, usage
    # and error messages name, so the alias parses without doubling every help line.
    action.option_strings = [flag]
    return action
