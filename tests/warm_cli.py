"""Run `python -m MODULE ARGS` as a fresh process would, minus the 3-9 s of imports each start costs here.

    runner = WarmCLI(env)                    # one warm parent per test module (or worker)
    code, stdout, stderr = runner.run("valen_jax.evaluate", ["--workdir=...", ...], cwd=ROOT)
    runner.close()

The parent is a subprocess started with the row's environment (device count, platform) that imports the
commands' dependencies once and then, per request, forks a child that runs the module as `__main__`
(`runpy`, as `python -m` does) with stdout and stderr on their own files. Each command still runs in its own
process: its exit code is the child's, a traceback is Python's own, its logging, absl flags and JAX backend
are its own (the parent never initialises a backend, which is what makes the fork safe: XLA's threads start
with the first backend). A command module is never imported in the parent, only what it imports: running
it as `__main__` beside an imported copy would define its absl flags twice.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

# What the commands import (their own modules excluded, see the module docstring).
WARM_IMPORTS = (
    "jax", "flax.nnx", "optax", "orbax.checkpoint", "grain", "transformers", "PIL.Image",
    "valen_jax.training.loop", "valen_jax.tasks.modes", "valen_jax.cli.boundary", "valen_jax.cli.distributed",
    "valen_jax.evaluation.workdir", "valen_jax.evaluation.answers", "valen_jax.evaluation.report",
    "valen_jax.decoding.engine", "valen_jax.decoding.speculative", "valen_jax.run", "valen_jax.models.build",
    "data_pipeline.format_registry", "data_pipeline.conversion",
)

_PARENT = r"""
import importlib, json, os, runpy, sys, traceback
sys.path[0] = os.getcwd()  # `-c` put "" there: the parent's directory, not each command's
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
from jax._src import xla_bridge
assert not xla_bridge._backends, "a warm import initialised a JAX backend: forking would not be safe"
requests, replies = sys.stdin, sys.stdout
for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid:
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
    else:
        os.chdir(request["cwd"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.close(0)
        code = 0
        # As in a cold start, the module's __main__ run is its first execution; a copy a warm import brought
        # in is dropped (runpy would warn, and the command's own import of itself would be that copy).
        sys.modules.pop(request["module"], None)
        sys.argv = [request["module"], *request["argv"]]
        sys.path.insert(0, request["cwd"])  # `python -m` puts the working directory first
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        except SystemExit as exited:
            if exited.code is None:
                code = 0
            elif isinstance(exited.code, int):
                code = exited.code
            else:
                print(exited.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
    replies.flush()
"""


class WarmCLI:
    """A warm parent process that runs command modules in forked children (see the module docstring)."""

    def __init__(self, env: dict[str, str], workspace: Path, imports=WARM_IMPORTS):
        self.workspace = workspace
        root = Path(__file__).resolve().parent.parent
        self.process = subprocess.Popen([sys.executable, "-c", _PARENT, json.dumps(list(imports))], env=env, cwd=root,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.count = 0

    def run(self, module: str, argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        """`python -m module *argv` in `cwd`: a CompletedProcess with its exit code, stdout and stderr."""
        self.count += 1
        out, err = self.workspace / f"{self.count}.out", self.workspace / f"{self.count}.err"
        request = {"module": module, "argv": argv, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        pid = self._reply(module)["pid"]
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:  # the child hangs: kill it as subprocess.run's timeout would, and say so
            os.kill(pid, signal.SIGKILL)
            self._reply(module)
            raise subprocess.TimeoutExpired([module, *argv], timeout, out.read_text(), err.read_text())
        code = self._reply(module)["code"]
        return subprocess.CompletedProcess([module, *argv], code, out.read_text(), err.read_text())

    def _reply(self, module: str) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm CLI parent exited ({self.process.wait(60)}) while running {module}")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
