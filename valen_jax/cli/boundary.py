"""The one error boundary of every command (DESIGN: "Commands share one error boundary").

    def main(argv=None) -> int:
        args = build_parser().parse_args(argv)
        with error_boundary("valen_jax.evaluate", paths=(args.workdir, args.data, args.output)):
            ...

A user's mistake (`is_user_error`) leaves the command as ONE stderr line, `ERROR_KIND: message` (the
error's type name, then its message with every line break joined into `; `), and exit code
`USAGE_EXIT` (2, as argparse: a command line that cannot work) or `DATA_EXIT` (1: data, a workdir, a
checkpoint, a file). Anything else is a bug: its traceback is kept, after one line saying so and how
to report it. SystemExit and KeyboardInterrupt pass through untouched.

The user errors: `valen_jax.errors.UserError` (ConfigError, UsageError, EvaluationError, ...) and the
errors of the layers below it that cannot derive from it (`data_pipeline` never imports `valen_jax`;
the checkpoint, lock, assembly and loop errors predate the taxonomy): `USER_ERRORS`. A
FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError or PermissionError counts when it is about a
path the user gave (`paths`: the file itself or anything under it) or has no path at all to blame on
the code; about another file it is a bug.
"""

from __future__ import annotations

import atexit
import difflib
import importlib.util
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from data_pipeline.cli_paths import PathError, check_path
from data_pipeline.formats.errors import FormatError
from data_pipeline.formats.limits import NotARegularFile, TooLarge
from data_pipeline.registry.references import RegistryError
from data_pipeline.render.common import RenderError
from data_pipeline.shards import ShardError
from data_pipeline.tokenizer import TokenizerError
from valen_jax.data.assemble import AssemblyError
from valen_jax.data.media import MediaError
from valen_jax.data.vision_processor import ProcessorError
from valen_jax.errors import UsageError, UserError
from valen_jax.models.hf_common import HFImportError
from valen_jax.models.safetensors_io import SafetensorsError
from valen_jax.models.sharding import ShardingError
from valen_jax.training import checkpoint, workdir_lock
from valen_jax.training.loop import NonFiniteLoss

log = logging.getLogger(__name__)

USAGE_EXIT = 2  # a command line that cannot work as written (argparse's own code)
DATA_EXIT = 1  # data, a workdir, a checkpoint, a file: the state the command was pointed at

# The user errors that cannot derive from UserError (their layer is below `valen_jax.errors`, or they
# predate it). CorruptCheckpoint is a CheckpointError.
USER_ERRORS: tuple[type[BaseException], ...] = (
    UserError, PathError, TokenizerError, ShardError, FormatError, TooLarge, NotARegularFile, RenderError, RegistryError,
    AssemblyError, MediaError, ProcessorError, HFImportError, SafetensorsError, ShardingError,
    checkpoint.CheckpointError, workdir_lock.WorkdirBusy, NonFiniteLoss)
# OS errors that are the user's when they concern a path the user gave.
PATH_ERRORS: tuple[type[OSError], ...] = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                                          PermissionError)

MAX_PROBLEMS = 5  # of a FormatError, on its one line; validate lists them all

REPORT = ("this is a bug in valen_jax, not a mistake in your input: please report it with the command line "
          "and the traceback below (a minimal workdir or data file that reproduces it helps)")


def _under(filename: str, roots: Iterable[str | os.PathLike | None]) -> bool:
    """Whether `filename` is one of `roots` or lies under one (both made absolute, not resolved)."""
    path = Path(os.path.abspath(filename))
    for root in roots:
        if root is None:
            continue
        base = Path(os.path.abspath(os.fspath(root)))
        if path == base or base in path.parents:
            return True
    return False


def is_user_error(error: BaseException, paths: Iterable[str | os.PathLike | None] = ()) -> bool:
    """Whether `error` is the user's to fix and said in full by its message (see the module docstring)."""
    if isinstance(error, USER_ERRORS):
        return True
    if isinstance(error, PATH_ERRORS):
        filename = getattr(error, "filename", None)
        return filename is None or _under(os.fsdecode(filename), paths)
    return False


def exit_code(error: BaseException) -> int:
    """USAGE_EXIT for a command line that cannot work, DATA_EXIT for every other user error."""
    return USAGE_EXIT if isinstance(error, UsageError) else DATA_EXIT


def one_line(error: BaseException) -> str:
    """`ERROR_KIND: message` on one line: the type's name, the message with its line breaks joined by `; `."""
    if isinstance(error, OSError) and error.strerror:  # not "[Errno 2] ...": the path, then what is wrong
        filename = error.filename
        message = error.strerror if filename is None else f"{os.fsdecode(filename)!r}: {error.strerror}"
    elif isinstance(error, FormatError) and len(error.problems) > MAX_PROBLEMS:
        shown = "\n".join(str(problem) for problem in error.problems[:MAX_PROBLEMS])
        message = (f"{shown}\n... {len(error.problems)} problems in all "
                   "(python -m data_pipeline.validate lists every one)")
    else:
        message = str(error)
    parts = [part.strip() for part in message.replace("\r", "\n").split("\n")]
    return f"{type(error).__name__}: {'; '.join(part for part in parts if part)}"


def _is_closed_loop_completion(unraisable) -> bool:
    """Whether an unraisable report is a stray completion reaching an asyncio loop that has closed: when an
    Orbax restore fails (a damaged checkpoint), Orbax closes its loop while TensorStore still reads the
    other arrays; each read that finishes later calls `loop.call_soon_threadsafe` on TensorStore's own
    thread and reports the RuntimeError by PyErr_WriteUnraisable, which may print before the restore's
    own error is raised. The coroutine that awaited the read is gone; nothing is lost."""
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    frames = [(Path(frame.filename).parent.name, frame.name) for frame in
              traceback.extract_tb(unraisable.exc_traceback)[-2:]]
    return frames == [("asyncio", "call_soon_threadsafe"), ("asyncio", "_check_closed")]


def _drop_closed_loop_completions() -> None:
    """Install (once) an unraisable hook that drops `_is_closed_loop_completion` reports (logged at debug)
    and hands every other one to the hook it wraps."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_completions", False):
        return

    def hook(unraisable) -> None:
        if _is_closed_loop_completion(unraisable):
            log.debug("dropped a read completion that reached a closed event loop: %s", unraisable.exc_value)
            return
        previous(unraisable)

    hook.drops_closed_loop_completions = True
    sys.unraisablehook = hook


class _AbandonedCheckpointReads(logging.Filter):
    """Drops the asyncio logger's "Future/Task exception was never retrieved" records whose exception was raised
    in Orbax's array deserialisation: when a restore fails on a damaged checkpoint, the reads of the other
    arrays are abandoned, and the garbage collector may report each one before the restore's own error reaches
    the boundary (seen under load in CI: the report's traceback, ahead of the one line). The restore's error is
    the report; every other asyncio record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[2] is None:
            return True
        frames = traceback.extract_tb(record.exc_info[2])
        if any(Path(frame.filename).parent.name == "serialization" and "orbax" in Path(frame.filename).parts
               for frame in frames):
            log.debug("dropped an abandoned checkpoint read's report: %s", record.exc_info[1])
            return False
        return True


def _drop_abandoned_checkpoint_reads() -> None:
    """Install (once) `_AbandonedCheckpointReads` on the asyncio logger."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedCheckpointReads) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedCheckpointReads())


def _silence_stderr() -> None:
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def _quiet_teardown() -> None:
    """After a user error's line, the one line is the whole report: what the process prints while it tears
    down is a consequence of that error, not news: after a damaged checkpoint's failed restore, Orbax's
    abandoned reads print "Exception ignored in: <coroutine ...>" and the asyncio logger's "Future
    exception was never retrieved" with their TensorStore specs as the interpreter finalizes. So: no
    unraisable reports from here on, and stderr goes to /dev/null once the atexit handlers start (they
    still run: an in-flight save still finishes)."""
    sys.unraisablehook = lambda unraisable: None
    if not getattr(_quiet_teardown, "registered", False):
        atexit.register(_silence_stderr)  # registered last, so run first of the atexit handlers
        _quiet_teardown.registered = True


@contextmanager
def error_boundary(command: str, paths: Iterable[str | os.PathLike | None] = ()) -> Iterator[None]:
    """Run a command's body: a user error exits with one line and its code; a bug keeps its traceback after
    one line naming `command` and how to report it. `paths`: the paths the user gave (see is_user_error)."""
    paths = tuple(paths)
    _drop_closed_loop_completions()
    _drop_abandoned_checkpoint_reads()
    try:
        yield
    except (SystemExit, KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as error:
        if is_user_error(error, paths):
            sys.stdout.flush()
            print(one_line(error), file=sys.stderr, flush=True)
            _quiet_teardown()
            sys.exit(exit_code(error))
        sys.stdout.flush()
        print(f"{command}: {REPORT}", file=sys.stderr, flush=True)
        raise


def _closest(key: str, choices: Iterable[str]) -> str:
    """"; closest: a, b" (difflib) or "; valid: ..." when nothing is close; for a message naming a bad key."""
    choices = sorted(choices)
    close = difflib.get_close_matches(key, choices, n=3, cutoff=0.6)
    if close:
        return "; closest: " + ", ".join(close)
    return "; valid: " + (", ".join(choices) if choices else "none")


def _config_argument(argv: list[str], name: str) -> str | None:
    """The value of `--NAME=VALUE` or `--NAME VALUE` in argv (the last one), None when absent."""
    value = None
    for i, arg in enumerate(argv[1:], 1):
        if re.fullmatch(rf"--?{name}=.*", arg):
            value = arg.split("=", 1)[1]
        elif re.fullmatch(rf"--?{name}", arg) and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def load_config_file(value: str, flag: str = "--config"):
    """The config `PATH[:VARIANT]` names, as ml_collections' config_flags loads it (the module's
    `get_config(VARIANT)`); a missing file or a refused variant is a UsageError naming them."""
    path, _, variant = value.partition(":")
    check_path(flag, path)
    if not path:
        raise UsageError(f"{flag}={value!r}: no config file named")
    if not os.path.isfile(path):
        where = Path(path).parent if str(Path(path).parent) not in ("", ".") else Path(".")
        known = sorted(str(p) for p in where.glob("*.py")) if where.is_dir() else []
        hint = _closest(path, known) if known else f"; {str(where)!r} is not a directory" if not where.is_dir() else ""
        raise UsageError(f"{flag}={value}: no such config file {path!r}{hint}")
    spec = importlib.util.spec_from_file_location(f"_valen_cli_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.get_config(*([variant] if ":" in value else []))
    except ValueError as error:  # the config's own refusal of a variant (it names the known ones)
        raise UsageError(f"{flag}={value}: {error}") from None


def check_config_overrides(argv: list[str], name: str = "config") -> None:
    """Before absl's config_flags applies them: every `--NAME.a.b=value` override of argv names a key of the
    config `--NAME` loads, else a UsageError naming the key and the closest valid ones. A missing config
    file or an unknown variant is one too (`load_config_file`). Nothing is checked without `--NAME`
    (absl refuses a missing required flag itself)."""
    value = _config_argument(argv, name)
    if value is None:
        return
    config = load_config_file(value, f"--{name}")
    for arg in argv[1:]:
        found = re.match(rf"--?(?:no)?{name}\.([^=]*)", arg)
        if not found:
            continue
        node, walked = config, name
        for key in found.group(1).split("."):
            keys = node.keys() if hasattr(node, "keys") else None
            if keys is None:
                raise UsageError(f"{arg.split('=', 1)[0]}: {walked} is {type(node).__name__} {node!r}, "
                                 f"not a group of keys, so it has no key {key!r}")
            if key not in keys:
                raise UsageError(f"{arg.split('=', 1)[0]}: {walked} has no key {key!r} "
                                 f"({value}){_closest(key, keys)}")
            node, walked = node[key], f"{walked}.{key}"


def _none_overrides(argv: list[str], name: str) -> tuple[list[str], list[list[str]]]:
    """(argv without its `--NAME.a.b=None` overrides, the key paths those set to None).

    ml_collections parses an override by the type of the value it replaces: `None` stays the string 'None'
    for a string key and is refused for a group (`--config.model.vision=None`: "`None` is not a dict"), so
    neither could be unset from the command line (issue 54). Here `=None` means None for every key; a file
    named None is spelled `./None`."""
    kept, unset = [argv[0]], []
    for arg in argv[1:]:
        found = re.fullmatch(rf"--?{name}\.([^=]+)=None", arg)
        if found:
            unset.append(found.group(1).split("."))
        else:
            kept.append(arg)
    return kept, unset


def parse_config_flags(argv: list[str], name: str = "config") -> list[str]:
    """An absl `app.run(main, flags_parser=...)` parser: the config checks of `check_config_overrides`, then
    absl's own parsing; a refusal of either is one line and USAGE_EXIT (absl's would be a page of usage,
    or a FATAL after a traceback). `--NAME.a.b=None` sets that key to None, a group included
    (`_none_overrides`), after the other overrides."""
    from absl import flags

    try:
        check_config_overrides(argv, name)
        kept, unset = _none_overrides(argv, name)
        try:
            rest = flags.FLAGS(kept)
        except flags.Error as error:
            raise UsageError(str(error)) from None
        if unset:
            config = flags.FLAGS[name].value
            for path in unset:
                node = config
                for key in path[:-1]:
                    node = node[key]
                node[path[-1]] = None
        return rest
    except USER_ERRORS as error:
        print(one_line(error), file=sys.stderr, flush=True)
        sys.exit(exit_code(error))
