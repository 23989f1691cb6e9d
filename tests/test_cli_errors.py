"""Every command's error boundary (valen_jax/cli/boundary.py; issue 27): one row per mistake per CLI.

Each row runs the command as a user would (`python -m valen_jax.X ...` from the repository root) and
asserts: the stated exit code (2 for a command line that cannot work, 1 for data and state), no
traceback, a last stderr line that names the file, key or step, and a workdir whose every file is
byte for byte what it was (names and sha256 of everything under it; a workdir that did not exist is
not created). The trained workdir is the shared tiny VFlash one (tests/smoke_workdirs.py), copied per
row, so a row that damages or writes into it touches only its copy.

`train.lock` is compared by name only: every trainer that takes the lock rewrites its informational
`pid N on HOST` line (valen_jax/training/workdir_lock.py), and the lock is taken before the data is read.

Each row is its own process, forked from a warm parent (tests/train_runs.run_module): a row that
only parses its command line costs 0.1 s instead of the 3-9 s of a cold start's imports. The rows that need
no trained workdir run by default; the whole table is `slow`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT, run_module

VFLASH_EVAL = "data/smoke/vflash/eval.jsonl"
CHAT_DATA = "data/smoke/chat/train.jsonl"
VALEN_DATA = "data/smoke/valen/train.jsonl"
PREPARED = "data/smoke/prepared/train.zip"
TINY = "--config=configs/vflash.py:tiny"


def tree_digest(root: Path) -> dict[str, str] | None:
    """{relative path: sha256 (or 'dir')} of everything under `root`; None when it does not exist."""
    if not root.exists():
        return None
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    digest = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_dir():
            digest[name] = "dir"
        elif path.name == "train.lock":
            digest[name] = "lock"
        else:
            digest[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


# Workdirs a row starts from.
def _trained(tmp: Path, trained: Path) -> Path:
    shutil.copytree(trained, tmp / "wd", symlinks=True)
    return tmp / "wd"


def _latest_step(workdir: Path) -> Path:
    return max((p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def _truncated_state(tmp: Path, trained: Path) -> Path:
    """Every array file of the latest step's state cut to half: the params are damaged wherever OCDBT put
    them (the largest file alone may hold only optimizer moments, which evaluation never reads)."""
    workdir = _trained(tmp, trained)
    for path in (_latest_step(workdir) / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    return workdir


def _deleted_state(tmp: Path, trained: Path) -> Path:
    workdir = _trained(tmp, trained)
    shutil.rmtree(_latest_step(workdir) / "state")
    return workdir


def _garbled_meta(tmp: Path, trained: Path) -> Path:
    workdir = _trained(tmp, trained)
    (_latest_step(workdir) / "meta" / "metadata").write_text("{garbled")
    return workdir


def _empty_dir(tmp: Path, trained: Path | None) -> Path:
    (tmp / "wd").mkdir()
    return tmp / "wd"


def _a_file(tmp: Path, trained: Path | None) -> Path:
    (tmp / "wd").write_text("not a workdir\n")
    return tmp / "wd"


def _absent(tmp: Path, trained: Path | None) -> Path:
    return tmp / "wd"


WORKDIRS = {"trained": _trained, "truncated_state": _truncated_state, "deleted_state": _deleted_state,
            "garbled_meta": _garbled_meta, "empty": _empty_dir, "file": _a_file, "absent": _absent}
NEEDS_TRAINING = {"trained", "truncated_state", "deleted_state", "garbled_meta"}


def _data_files(tmp: Path) -> dict[str, str]:
    """Broken data files a row may name: {key: path}. `nul_vflash` / `nul_chat`: a record whose media path
    holds a NUL byte (once "ValueError: embedded null byte"); `zero_zip`: a prepared zip that is /dev/zero
    (once read until MemoryError)."""
    lines = (ROOT / VFLASH_EVAL).read_text().splitlines(keepends=True)
    (tmp / "empty.jsonl").write_text("")
    (tmp / "truncated.jsonl").write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    vflash = json.loads(lines[0])
    vflash["image"] = "images/a\x00b.png"
    (tmp / "nul_vflash.jsonl").write_text(json.dumps(vflash) + "\n")
    chat = json.loads((ROOT / CHAT_DATA).read_text().splitlines()[0])
    chat["messages"] = [{"role": "user", "content": [{"type": "image", "path": "a\x00b.png"},
                                                     {"type": "text", "text": "hi"}]},
                        {"role": "assistant", "content": "x"}]
    (tmp / "nul_chat.jsonl").write_text(json.dumps(chat) + "\n")
    if not (tmp / "train.zip").is_symlink():
        (tmp / "train.zip").symlink_to("/dev/zero")
    return {"missing": str(tmp / "missing.jsonl"), "empty": str(tmp / "empty.jsonl"),
            "truncated": str(tmp / "truncated.jsonl"), "nul_vflash": str(tmp / "nul_vflash.jsonl"),
            "nul_chat": str(tmp / "nul_chat.jsonl"), "zero_zip": str(tmp / "train.zip")}


# The flag a command is given its workdir by: `--workdir` unless named here (None: the command has none;
# its row's workdir is an absent folder, which must stay absent).
WORKDIR_FLAGS = {"data_pipeline.split": "--output-dir", "data_pipeline.validate": None}


def row(cli: str, workdir: str, args: str, code: int, names: str, fast: bool = False):
    """One mistake: `python -m valen_jax.CLI` (a `data_pipeline.X` CLI by its full name) with `args` (`{wd}`:
    the row's workdir, `{tmp}`: its temp dir, `{target}`: the trained tiny workdir, `{missing}` / `{empty}` /
    `{truncated}` / `{nul_vflash}` / `{nul_chat}` / `{zero_zip}`: broken data files) on a workdir of kind
    `workdir`; exits `code`, its last stderr line holding `names` (formatted like `args`)."""
    marks = () if fast else (pytest.mark.slow,)
    return pytest.param(cli, workdir, args, code, names, marks=marks, id=f"{cli}-{names}-{workdir}"[:90])


E = VFLASH_EVAL
ROWS = [
    # train: the config and its flags (usage, exit 2)
    row("train", "empty", f"{TINY} --config.train.stpes=8", 2, "'stpes'", fast=True),
    row("train", "empty", f"{TINY} --config.trian.steps=3", 2, "'trian'"),
    row("train", "empty", f"{TINY} --config.train.steps.x=3", 2, "config.train.steps"),
    row("train", "empty", "--config=configs/vflash.py:tinny", 2, "'tinny'", fast=True),
    row("train", "empty", "--config=configs/nope.py", 2, "configs/nope.py", fast=True),
    row("train", "empty", "--config=configs/vflash.py:tiny,bogus", 2, "bogus"),
    row("train", "empty", f"{TINY} --config.train.steps=abc", 2, "config.train.steps"),
    row("train", "empty", f"{TINY} --wrokdir=/tmp/x", 2, "wrokdir"),
    row("train", "absent", f"{TINY} extra", 2, "extra"),
    row("train", "absent", "", 2, "config"),
    # train: the config's values, the workdir, the data (exit 1)
    row("train", "empty", f"{TINY} --config.train.mode=bogus", 1, "config.train.mode"),
    row("train", "empty", f"{TINY} --config.model.init_from=/nope", 1, "/nope"),
    row("train", "file", TINY, 1, "{wd}"),
    row("train", "trained", f"{TINY} --config.data.train={{missing}}", 1, "{missing}"),
    row("train", "trained", f"{TINY} --config.data.train={{empty}}", 1, "{empty}"),
    row("train", "trained", f"{TINY} --config.data.train={{truncated}}", 1, "{truncated}"),
    row("train", "trained", f"{TINY} --config.data.train=/etc/passwd", 1, "/etc/passwd"),
    row("train", "trained", f"{TINY} --config.data.train={CHAT_DATA}", 1, CHAT_DATA),
    row("train", "trained", f"{TINY} --config.mesh.data=8", 1, "8 devices"),
    row("train", "trained", "--config=configs/vflash.py:tiny,drafter --config.model.target_from=/nope", 1,
        "trains another task"),
    # evaluate
    row("evaluate", "empty", f"--data={E} --output={{tmp}}/r.json", 1, "no checkpoint", fast=True),
    row("evaluate", "absent", f"--data={E} --output={{tmp}}/r.json", 1, "no checkpoint"),
    row("evaluate", "file", f"--data={E} --output={{tmp}}/r.json", 1, "{wd}"),
    row("evaluate", "truncated_state", f"--data={E} --output={{tmp}}/r.json", 1, "checkpoint 4"),
    row("evaluate", "deleted_state", f"--data={E} --output={{tmp}}/r.json", 1, "checkpoint 4"),
    row("evaluate", "garbled_meta", f"--data={E} --output={{tmp}}/r.json", 1, "checkpoint 4"),
    row("evaluate", "trained", f"--step=99 --data={E} --output={{tmp}}/r.json", 1, "step 99"),
    row("evaluate", "trained", "--data={missing} --output={tmp}/r.json", 1, "{missing}"),
    row("evaluate", "trained", "--data={empty} --output={tmp}/r.json", 1, "{empty}"),
    row("evaluate", "trained", "--data={truncated} --output={tmp}/r.json", 1, "{truncated}"),
    row("evaluate", "trained", "--data=/etc/passwd --output={tmp}/r.json", 1, "/etc/passwd"),
    row("evaluate", "trained", f"--data={CHAT_DATA} --output={{tmp}}/r.json", 1, CHAT_DATA),
    row("evaluate", "trained", f"--data={PREPARED} --format=prepared --output={{tmp}}/r.json", 1, PREPARED),
    row("evaluate", "trained", f"--data={E} --from-call --output={{tmp}}/r.json", 2, "--from-call"),
    row("evaluate", "empty", f"--data={E} --format=bogus --output={{tmp}}/r.json", 2, "--format"),
    row("evaluate", "empty", f"--step=abc --data={E} --output={{tmp}}/r.json", 2, "--step"),
    # predict
    row("predict", "empty", f"--data={E} --output={{tmp}}/a.jsonl", 1, "no checkpoint"),
    row("predict", "deleted_state", f"--data={E} --output={{tmp}}/a.jsonl", 1, "checkpoint 4"),
    row("predict", "trained", f"--step=99 --data={E} --output={{tmp}}/a.jsonl", 1, "step 99"),
    row("predict", "trained", "--data={missing} --output={tmp}/a.jsonl", 1, "{missing}"),
    row("predict", "trained", f"--data={CHAT_DATA} --output={{tmp}}/a.jsonl", 1, CHAT_DATA),
    row("predict", "trained", f"--data={PREPARED} --format=prepared --output={{tmp}}/a.jsonl", 2, PREPARED),
    row("predict", "trained", f"--data={E} --mode=question --output={{tmp}}/a.jsonl", 2, "--mode"),
    # generate
    row("generate", "empty", f"--data={E} --output={{tmp}}/a.jsonl", 1, "no checkpoint"),
    row("generate", "garbled_meta", f"--data={E} --output={{tmp}}/a.jsonl", 1, "checkpoint 4"),
    row("generate", "truncated_state", f"--data={E} --output={{tmp}}/a.jsonl", 1, "checkpoint 4"),
    row("generate", "trained", "--data={truncated} --output={tmp}/a.jsonl", 1, "{truncated}"),
    row("generate", "trained", f"--data={VALEN_DATA} --format=valen --output={{tmp}}/a.jsonl", 2, VALEN_DATA),
    row("generate", "empty", f"--data={E} --top-p=2 --output={{tmp}}/a.jsonl", 1, "--top-p=2"),
    # regenerate
    row("regenerate", "empty", f"--data={E} --output={{tmp}}/regen", 1, "no checkpoint"),
    row("regenerate", "trained", "--data={missing} --output={tmp}/regen", 1, "{missing}"),
    row("regenerate", "empty", f"--data={E} --samples=-1 --output={{tmp}}/regen", 1, "--samples=-1"),
    # export
    row("export", "empty", "--output={tmp}/exported", 1, "no checkpoint", fast=True),
    row("export", "trained", "--step=99 --output={tmp}/exported", 1, "step 99"),
    row("export", "trained", "--output={tmp}/exported", 1, "family 'valen'"),
    row("export", "deleted_state", "--output={tmp}/exported", 1, "checkpoint 4"),
    # Refusals after the workdir was created and locked and the data converted (issue 27): what start-up
    # wrote is removed, so an absent workdir stays absent and an empty one empty.
    row("train", "absent", f"{TINY} --config.data.train={{missing}}", 1, "{missing}", fast=True),
    row("train", "empty", f"{TINY} --config.data.train=/etc/passwd", 1, "/etc/passwd"),
    row("train", "absent", f"{TINY} --config.mesh.data=8", 1, "8 devices"),
    # Nothing to train: a drafter on points only (seed 004: points announce no block), with the counts found.
    row("train", "absent", "--config=configs/vflash.py:tiny,drafter --config.model.target_from={target} "
        "--config.data.train=data/smoke/vflash/points.jsonl --config.data.format=vflash", 1,
        "28 records, 0 primitive blocks"),
    # A NUL in a media path; /dev/zero as a prepared zip.
    row("train", "absent", f"{TINY} --config.data.train={{nul_vflash}} --config.data.format=vflash "
        "--config.data.eval=None", 1,
        "holds the control character '\\x00'"),
    row("train", "absent", "--config=configs/prepared.py:tiny --config.data.train={zero_zip}", 1,
        "is a device; a data file must be a regular file"),
    row("evaluate", "trained", "--data={nul_vflash} --format=vflash --output={tmp}/r.json", 1,
        "holds the control character '\\x00'"),
    row("evaluate", "trained", "--data={nul_chat} --format=chat --output={tmp}/r.json", 1,
        "holds the control character '\\x00'"),
    # regenerate with every record skipped: the reasons counted on its line (the tiny target finishes no box).
    row("regenerate", "trained", "--data=data/smoke/vflash/boxes.jsonl --max-new-tokens=8 --output={tmp}/regen", 1,
        "every record was skipped, nothing to write (20 skips: 20 unfinished"),
    # The data CLIs: the split refusals leave no output folder; validate's problems are one line each.
    row("data_pipeline.split", "absent", "--format=vakforge --input=data/smoke/vakforge/vakforge.jsonl "
        "--fractions=train=0.5,eval=0.5 --seed=1", 1, "meta.split: 'dev' is not one of --fractions", fast=True),
    row("data_pipeline.split", "absent", "--format=valen --input={missing} --fractions=train=0.5,eval=0.5 --seed=1",
        1, "{missing}", fast=True),
    row("data_pipeline.split", "absent", "--format=chat --input=data/smoke/chat/train.jsonl "
        "--fractions=train=0.5,eval=0.5 --seed=1", 1, "name media relative to", fast=True),
    row("data_pipeline.validate", "absent", "--format=vflash {nul_vflash}", 1, "holds the control character '\\x00'",
        fast=True),
    row("data_pipeline.validate", "absent", "--format=prepared {zero_zip}", 1,
        "is a device; a data file must be a regular file", fast=True),
]


@pytest.mark.parametrize("cli, workdir_kind, args, code, names", ROWS)
def test_a_mistake_is_one_line_with_its_exit_code_and_changes_nothing(
        tmp_path, tmp_path_factory, cli, workdir_kind, args, code, names):
    needs = workdir_kind in NEEDS_TRAINING or "{target}" in args
    trained = smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny") if needs else None
    workdir = WORKDIRS[workdir_kind](tmp_path, trained)
    values = {"wd": str(workdir), "tmp": str(tmp_path), "target": str(trained), **_data_files(tmp_path)}
    module = cli if "." in cli else f"valen_jax.{cli}"
    flag = WORKDIR_FLAGS.get(module, "--workdir")
    argv = [*([f"{flag}={workdir}"] if flag else []), *(arg.format(**values) for arg in args.split())]
    before = tree_digest(workdir)
    result = run_module(module, *argv, check=False)
    lines = result.stderr.strip().splitlines()
    shown = json.dumps({"argv": argv, "code": result.returncode, "stderr": result.stderr[-3000:]}, indent=1)
    assert "Traceback" not in result.stderr, shown
    assert result.returncode == code, shown
    assert lines and names.format(**values) in lines[-1], shown
    assert tree_digest(workdir) == before, shown
    # Warnings only for real conditions: Orbax's notice on every read-only open was none (issue 27).
    assert "Given directory is read only" not in result.stderr, shown


# The boundary itself, in process.

def test_the_boundary_prints_one_line_and_exits_by_kind(capsys):
    from data_pipeline.formats.errors import FormatError, Problem
    from valen_jax.cli.boundary import error_boundary
    from valen_jax.errors import ConfigError, UsageError

    with pytest.raises(SystemExit) as exited, error_boundary("cmd"):
        raise UsageError("--x=1: no such thing")
    assert exited.value.code == 2 and capsys.readouterr().err == "UsageError: --x=1: no such thing\n"
    with pytest.raises(SystemExit) as exited, error_boundary("cmd"):
        raise ConfigError("config.a: bad")
    assert exited.value.code == 1 and capsys.readouterr().err == "ConfigError: config.a: bad\n"
    with pytest.raises(SystemExit) as exited, error_boundary("cmd"):
        raise FormatError([Problem("f.jsonl", i, "record", "invalid JSON") for i in range(1, 8)])
    err = capsys.readouterr().err
    assert exited.value.code == 1 and err.count("\n") == 1 and err.startswith("FormatError: f.jsonl:1: record")
    assert "7 problems in all" in err and "f.jsonl:6:" not in err


def test_an_os_error_is_the_users_only_about_their_paths(tmp_path, capsys):
    from valen_jax.cli.boundary import error_boundary, is_user_error

    mine = FileNotFoundError(2, "No such file or directory", str(tmp_path / "data" / "x.jsonl"))
    assert is_user_error(mine, [tmp_path / "data"]) and not is_user_error(mine, [tmp_path / "other"])
    with pytest.raises(SystemExit) as exited, error_boundary("cmd", paths=[tmp_path]):
        raise mine
    assert exited.value.code == 1
    assert capsys.readouterr().err == f"FileNotFoundError: {str(tmp_path / 'data' / 'x.jsonl')!r}: No such file or directory\n"
    with pytest.raises(FileNotFoundError), error_boundary("cmd", paths=[tmp_path / "other"]):
        raise mine
    assert "this is a bug in valen_jax" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback_after_a_line_saying_so(capsys):
    from valen_jax.cli.boundary import error_boundary

    with pytest.raises(KeyError), error_boundary("valen_jax.cmd"):
        raise KeyError("internal")
    assert capsys.readouterr().err.startswith("valen_jax.cmd: this is a bug in valen_jax, not a mistake in your input")
    with pytest.raises(SystemExit), error_boundary("cmd"):  # a command's own exit passes through
        sys.exit(3)
    assert capsys.readouterr().err == ""


def test_config_overrides_are_checked_against_the_config_with_the_closest_keys(tmp_path):
    from valen_jax.cli.boundary import check_config_overrides
    from valen_jax.errors import UsageError

    config = tmp_path / "c.py"
    config.write_text("import ml_collections\n\ndef get_config(variant=''):\n"
                      "    if variant not in ('', 'small'):\n"
                      "        raise ValueError(f'unknown variant {variant!r}; known: small')\n"
                      "    return ml_collections.ConfigDict({'train': {'steps': 1, 'lr': 0.1}})\n")
    check_config_overrides(["prog", f"--config={config}:small", "--config.train.steps=3"])
    check_config_overrides(["prog", "--config", str(config), "--config.train.lr", "1"])
    with pytest.raises(UsageError, match=r"--config.train.stpes: config.train has no key 'stpes' .*closest: steps"):
        check_config_overrides(["prog", f"--config={config}", "--config.train.stpes=3"])
    with pytest.raises(UsageError, match=r"config has no key 'zzz' .*valid: train"):
        check_config_overrides(["prog", f"--config={config}", "--config.zzz=3"])
    with pytest.raises(UsageError, match=r"unknown variant 'smal'; known: small"):
        check_config_overrides(["prog", f"--config={config}:smal"])
    with pytest.raises(UsageError, match=r"no such config file .*nope.py.*closest: .*c.py"):
        check_config_overrides(["prog", f"--config={tmp_path}/nope.py"])


def test_a_read_completion_reaching_a_closed_loop_is_dropped_and_other_reports_are_kept(capsys):
    """TensorStore reports a read that finishes after Orbax closed its loop (a failed restore) through the
    unraisable hook; the boundary's hook drops exactly that report and passes on every other one."""
    import asyncio

    from valen_jax.cli import boundary as cli_errors

    seen = []
    previous = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        with cli_errors.error_boundary("test"):
            pass
        loop = asyncio.new_event_loop()
        loop.close()
        for make in (lambda: loop.call_soon_threadsafe(print), lambda: (_ for _ in ()).throw(RuntimeError("other"))):
            try:
                make()
            except RuntimeError as error:
                sys.unraisablehook(type("U", (), {"exc_type": RuntimeError, "exc_value": error,
                                                  "exc_traceback": error.__traceback__, "object": None,
                                                  "err_msg": None})())
    finally:
        sys.unraisablehook = previous
    assert [str(u.exc_value) for u in seen] == ["other"]


def test_an_abandoned_checkpoint_reads_report_is_dropped_and_other_asyncio_records_are_kept():
    """After a failed restore, the garbage collector may log an abandoned Orbax read's "Future exception was
    never retrieved" before the restore's own error reaches the boundary (a CI run under load printed its
    traceback ahead of the one line). The boundary's filter drops exactly those records."""
    import logging

    from valen_jax.cli import boundary as cli_errors

    def raised_in(filename: str) -> BaseException:
        namespace = {}
        exec(compile("def read():\n    raise OSError('Encountered error while reading array index')\n", filename,
                     "exec"), namespace)
        try:
            namespace["read"]()
        except OSError as error:
            return error
        raise AssertionError("not raised")

    orbax = raised_in("/site-packages/orbax/checkpoint/_src/serialization/serialization.py")
    other = raised_in("/site-packages/someone/else.py")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.exc_info[1] if record.exc_info else None)

    asyncio_log, handler = logging.getLogger("asyncio"), Keep()
    asyncio_log.addHandler(handler)
    try:
        with cli_errors.error_boundary("test"):
            pass
        for error in (orbax, other):
            asyncio_log.error("Future exception was never retrieved",
                              exc_info=(type(error), error, error.__traceback__))
        asyncio_log.error("no exception at all")
    finally:
        asyncio_log.removeHandler(handler)
    assert seen == [other, None]
