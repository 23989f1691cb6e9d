"""Paths from a command line or a config, refused when they hold control characters.

A NUL cannot name a file (Python raises "embedded null byte" from deep inside whatever opens it),
and a newline or carriage return in a path echoed into an error message forges a second line,
one a reader or a script takes for another error (`PATH:LINE: FIELD: message`). Such a path is
refused at the entry point, in one line that shows it with `repr()`. Here, under data_pipeline,
so that its CLIs can use it too (data_pipeline never imports valen_jax).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class PathError(ValueError):
    """A path holding a control character (NUL, newline, ...)."""


def control_character(text: str) -> str | None:
    """The first control character (NUL, newline, ...) in `text`, or None: what makes a path unusable
    (NUL) or unprintable on one line (the rest). Media paths inside data files are held to it too
    (data_pipeline.formats.media_paths)."""
    found = _CONTROL.search(text)
    return found.group() if found else None


def escaped(text: str) -> str:
    """`text` with each control character written as its escape (`\\n`, `\\x00`), the rest as it is: a path,
    a zip member name or a message from a data file printed so that one problem stays one line."""
    return _CONTROL.sub(lambda found: repr(found.group())[1:-1], text)


def check_path(what: str, value: Any) -> None:
    """Raise PathError naming `what` when `value` (a str or PathLike; None is skipped) holds a control character."""
    if value is None:
        return
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        return
    found = control_character(text)
    if found:
        raise PathError(f"{what}: {text!r} holds the control character {found!r}; "
                        "paths with NUL, newlines or other control characters are refused")


def exit_on_bad_paths(**paths: Any) -> None:
    """For a CLI's arguments (`--some-name=value` as some_name=value; a positional one by its upper-case
    metavar, e.g. PATH; a list for a repeated one): exit with one line on the first bad path."""
    for name, value in paths.items():
        label = name if name.isupper() else "--" + name.replace("_", "-")
        try:
            for item in value if isinstance(value, (list, tuple)) else [value]:
                check_path(label, item)
        except PathError as error:
            sys.exit(f"error: {error}")
