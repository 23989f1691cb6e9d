"""vakforge data tools: `python -m data_pipeline.vakforge COMMAND …` (seed 002, issue 18).

Example:

    python -m data_pipeline.vakforge inspect data/smoke/vakforge/audio/conv_hi_0002.wav
    python -m data_pipeline.vakforge prepare RAW_DIR --manifest=RAW_DIR/vakforge.jsonl --out=DATA_DIR
    python -m data_pipeline.vakforge synth --manifest=data/smoke/vakforge/vakforge.jsonl --out=/tmp/synth
    python -m data_pipeline.vakforge split --help

Commands: inspect (what a recording is), prepare (raw uploads → 24 kHz dataset with per-turn
language and redaction), synth (speech for rows without audio), split (speaker-disjoint splits).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "inspect": "data_pipeline.vakforge.inspect",
    "prepare": "data_pipeline.vakforge.prepare",
    "synth": "data_pipeline.vakforge.synth",
    "split": "data_pipeline.vakforge.split",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"vakforge: unknown command {command!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # Each command imports its own libraries, so `inspect` never loads the language models of `split`.
    return importlib.import_module(COMMANDS[command]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
