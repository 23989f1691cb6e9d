"""`python -m valen_jax.serve` as a user starts it (issue 31): a subprocess on 127.0.0.1 with an API key;
SIGTERM or Ctrl-C (SIGINT) while an answer streams lets that answer finish, then the process exits 143 / 130
(128 + the signal, as `train` does; issue 54: it used to exit 0 on Ctrl-C)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT, env_with_devices


@pytest.fixture
def server(tmp_path_factory):
    workdir = smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "valen_jax.serve", f"--workdir={workdir}", f"--port={port}",
                                "--max-batch=2", "--api-key=sesame"], cwd=ROOT, env=env_with_devices(1),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    while True:  # until it listens, or it exits (then say why); pytest-timeout bounds a hang
        try:
            httpx.get(url + "/health", timeout=5).raise_for_status()
            break
        except httpx.TransportError:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}: {process.stderr.read()[-3000:]}")
            try:
                process.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
    yield process, url, workdir.name
    if process.poll() is None:
        process.kill()
        process.wait()


def stream_through(process, url: str, model: str, stop: signal.Signals) -> str | None:
    """A streamed answer with `stop` sent to the server after its first chunk → its finish reason."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 24, "stream": True}
    key = {"Authorization": "Bearer sesame"}
    finish = None
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=key, timeout=120) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        process.send_signal(stop)  # mid-answer: it must still complete
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    return finish


@pytest.mark.slow  # a cold `python -m valen_jax.serve` subprocess: restore, compile, serve (~30 s)
def test_api_key_then_sigterm_drains(server):
    process, url, model = server
    refused = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hello"}, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["param"] == "Authorization"
    assert stream_through(process, url, model, signal.SIGTERM) in {"stop", "length"}
    # Drained, then 128 + SIGTERM, as `train` exits on a preemption.
    assert process.wait(timeout=120) == 143
    with pytest.raises(httpx.TransportError):  # no longer listening
        httpx.get(url + "/health", timeout=5)
    # Its start-up lines reach the log (an import used to leave the root logger at WARNING), and SIGTERM
    # during the background compile waited for the compile under way instead of aborting.
    log = process.stderr.read()
    assert "serve: compiled every prefill bucket and greedy decode shape" in log, log[-3000:]
    assert "objects frozen out of garbage collection" in log and "FATAL" not in log, log[-3000:]
    assert "serve: stopped by SIGTERM after draining" in log, log[-3000:]


@pytest.mark.slow  # a cold `python -m valen_jax.serve` subprocess (~30 s)
def test_ctrl_c_drains_then_exits_130(server):
    process, url, model = server
    assert stream_through(process, url, model, signal.SIGINT) in {"stop", "length"}
    assert process.wait(timeout=120) == 130  # `train`'s status for Ctrl-C (it was 0)
    log = process.stderr.read()
    assert "serve: stopped by SIGINT after draining" in log and "Traceback" not in log, log[-3000:]


@pytest.mark.slow  # a subprocess restoring and warming the smoke workdir (~20 s)
def test_exiting_during_the_background_compile_does_not_abort(tmp_path_factory):
    """A script that warms a server's engine and exits without `stop` (the background compile of the sampled
    kinds still under way) ends normally: the compile under way finishes, the rest is skipped. The
    interpreter used to kill the daemon thread inside XLA: SIGABRT, "exception not rethrown"."""
    workdir = smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")
    script = ("from valen_jax.cli import log_setup\n"
              "from valen_jax.serve import load_service\n"
              "log_setup.configure(force=True)\n"
              f"service = load_service({str(workdir)!r}, slots=2)\n"
              "assert service.engine.background_warm_seconds is None  # still compiling\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env_with_devices(1), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "FATAL" not in done.stderr, done.stderr[-3000:]
    assert "the background compile stopped (exit) after" in done.stderr, done.stderr[-3000:]
