"""Train a model from a config; resumes from the workdir's latest intact checkpoint.

    python -m valen_jax.train --config=configs/vflash.py --workdir=runs/vflash-smoke
    python -m valen_jax.train --config=configs/vflash.py:tiny --workdir=/tmp/tiny --config.train.steps=4

The run converts its data into `WORKDIR/shards/` when needed, checkpoints asynchronously to
`WORKDIR/checkpoints/` (state, Grain iterator, meta) every `train.checkpoint_every` steps, at the
end and on SIGTERM or Ctrl-C (then exit 143 / 130), writes `metrics.jsonl` and TensorBoard events (loss per objective, learning
rate, gradient norm, tokens/s, MFU, examples seen, padding, and `eval_*` every `eval.every`
steps), and with `eval.at_end` writes `WORKDIR/eval/report-STEP.json`. Running the same command
again continues from the latest checkpoint at the same step and data position, after a SIGTERM,
a Ctrl-C or a `kill -9` alike; a damaged latest checkpoint is reported and the one before it used. A
workdir keeps its task: a config of another task, data format or training mode is refused on it.

The loop is `valen_jax.training.loop`; the mode is a task (`valen_jax.tasks.modes` names them).
Two training modes (seed 004's --training_mode, `config.train.mode`): `ar` trains the model itself;
`vflash` trains VFlash's block drafter (valen_jax/models/drafter.py) against the frozen target of an
`ar` workdir, restored from its latest checkpoint; the drafter's meta records that target (workdir,
step, sha256 of its params) and `metrics.jsonl` the drafter's loss, per-position accuracy and
expected acceptance length:
    python -m valen_jax.train --config=configs/vflash.py:tiny --workdir=/tmp/target
    python -m valen_jax.train --config=configs/vflash.py:tiny,drafter --workdir=/tmp/drafter \
        --config.model.target_from=/tmp/target

`reinforce` (issue 32, seed 003's reinforcement runs) samples G completions per prompt with the decode
engine, rewards them against the assistant message and trains a group-relative clipped objective
(valen_jax/tasks/reinforce.py; configs/reinforce.py). `--smoke-check` runs a few prompts of such a run end
to end in a temporary workdir (render, sample, reward, one update, a checkpoint written and discarded)
and prints the findings; prepared rows are refused for it, as for a reinforcement run:
    python -m valen_jax.train --config=configs/reinforce.py:tiny --workdir=/tmp/rl --smoke-check
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from data_pipeline.cli_paths import check_path
from valen_jax.cli import distributed
from valen_jax.cli import log_setup as cli_logging
from valen_jax.cli.boundary import error_boundary, parse_config_flags
from valen_jax.errors import UsageError
from valen_jax.tasks.modes import check_mode, open_task, preflight
from valen_jax.training import loop

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/vflash.py[:tiny]")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and reports")
_SMOKE_CHECK = flags.DEFINE_bool("smoke_check", False, "Seed 003's smoke check of a reinforcement run: a few "
                                 "prompts end to end in a temporary workdir, the findings printed")


def run(config, workdir) -> dict:
    """Train `config` in `workdir` with the mode `config.train.mode` names (valen_jax.tasks.modes)."""
    check_mode(config)
    return loop.run(config, workdir, open_task, preflight)


def _user_paths() -> list[str]:
    """The paths the user gave: the workdir, the config file and every string of the config (data files,
    tokenizer, init_from, target_from, ...)."""
    paths = [_WORKDIR.value, config_flags.get_config_filename(flags.FLAGS["config"]).partition(":")[0]]

    def strings(node):
        if hasattr(node, "items"):
            for _, value in node.items():
                yield from strings(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                yield from strings(value)
        elif isinstance(node, str) and node:
            yield node

    try:
        found = list(strings(_CONFIG.value))
    except Exception:  # noqa: BLE001 - a config that cannot be read is refused by the run itself
        found = []
    # Only path-like strings, and never the current directory or one above it (a mode name is no path).
    here = Path.cwd()
    paths.extend(text for text in found if "/" in text and Path(os.path.abspath(text)) not in (here, *here.parents))
    return [path for path in paths if path]


def main(argv) -> None:
    cli_logging.configure(timestamps=True)
    # The one error boundary (valen_jax.cli.boundary): a user's mistake is one line `ERROR_KIND: message`
    # (exit 2 for the command line, 1 for data and state), a traceback means a bug. An OS error counts
    # as the user's when it is about a path of the command line or the config.
    with error_boundary("valen_jax.train", paths=_user_paths()):
        if len(argv) > 1:
            raise UsageError(f"unexpected arguments: {argv[1:]}")
        if _WORKDIR.value is None:
            raise UsageError("--workdir is required")
        check_path("--workdir", _WORKDIR.value)
        check_path("--config", config_flags.get_config_filename(flags.FLAGS["config"]))
        if os.path.exists(_WORKDIR.value) and not os.path.isdir(_WORKDIR.value):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory; --workdir names a directory (or one to "
                                     "create)", _WORKDIR.value)
        distributed.initialize()  # before any JAX backend use; a single-process run is left as it is
        if _SMOKE_CHECK.value:
            from valen_jax.tasks.smoke_check import format_findings, smoke_check

            check_mode(_CONFIG.value)
            print(format_findings(smoke_check(_CONFIG.value)))
            return
        result = run(_CONFIG.value, _WORKDIR.value)
    if result["losses"]:
        print(f"loss: first logged {result['losses'][0][1]:.4f} (step {result['losses'][0][0]}), "
              f"last {result['losses'][-1][1]:.4f} (step {result['losses'][-1][0]})")
    if "records_without_labels" in result:
        print(f"records without labels (never trained on, media not read): {result['records_without_labels']}")
    print(f"checkpoint: {result['checkpoint']}")
    if "report" in result:
        print(f"evaluation report: {result['report']}")
    sys.stdout.flush()
    if result["stop_signal"] is not None:
        # Stopped by SIGTERM or Ctrl-C after checkpointing: 128 + the signal (143, 130), as a shell reports a
        # process the signal ended, so a scheduler never reads the stop as success. The same command resumes.
        print(f"stopped by {signal.Signals(result['stop_signal']).name} at step {result['step']}; "
              "the same command resumes from there", file=sys.stderr)
        sys.exit(128 + result["stop_signal"])


def _parse_flags(argv: list[str]) -> list[str]:
    # The command line spells flags with hyphens (seed 003's --smoke-check); absl names them with underscores.
    spelled = [("--smoke_check" + arg[len("--smoke-check"):]) if arg.startswith("--smoke-check") else arg
               for arg in argv]
    return parse_config_flags(spelled)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    # A config key or variant typo, a missing config file, a flag absl refuses: one line, exit 2.
    app.run(main, flags_parser=_parse_flags)
