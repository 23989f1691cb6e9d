"""Run one multi-process training job on this machine: N `python -m valen_jax.train` processes.

    python launch/local.py --processes=2 --devices-per-process=2 -- \\
        --config=configs/vflash.py:tiny --workdir=/tmp/run

Everything after `--` goes to every process unchanged. Each process gets the coordinator (a free
localhost port, process 0 serves it) and its id through VALEN_* variables, which
`valen_jax.cli.distributed.initialize` reads. `--devices-per-process` simulates CPU devices with
XLA_FLAGS, so this exercises the multi-host code paths (per-process data slices, global arrays,
cross-process collectives over gloo, Orbax multi-host saves) without accelerators; pass 0 to leave
the platform and devices as they are. Output lines are prefixed `[pN]`. The exit status is 0 when
all processes succeed; the first failure stops the others and its status is returned.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    # The OS picks an unused port; it is released before process 0 binds it, a race that only
    # another program grabbing the same port in that instant can lose.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def process_env(index: int, count: int, coordinator: str, devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VALEN_COORDINATOR=coordinator, VALEN_NUM_PROCESSES=str(count), VALEN_PROCESS_ID=str(index))
    if devices > 0:
        # Read when the backend starts, hence per process and never changed inside one.
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _forward(stream, prefix: str, sink) -> None:
    for line in stream:
        sink.write(f"{prefix} {line}")
        sink.flush()


TRAIN = (sys.executable, "-m", "valen_jax.train")


def launch(count: int, devices: int, args: list[str], command: tuple[str, ...] = TRAIN) -> int:
    """Run `command + args` as processes 0..count-1 of one job; the exit status of the job."""
    coordinator = f"localhost:{free_port()}"
    processes, threads = [], []
    for index in range(count):
        process = subprocess.Popen([*command, *args], cwd=ROOT,
                                   env=process_env(index, count, coordinator, devices),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)  # own group: stopping it reaches Grain workers too
        processes.append(process)
        thread = threading.Thread(target=_forward, args=(process.stdout, f"[p{index}]", sys.stdout), daemon=True)
        thread.start()
        threads.append(thread)
    status = 0
    try:
        while None in (codes := [p.poll() for p in processes]):  # poll each: any() would stop early
            failed = [p for p, code in zip(processes, codes, strict=True) if code not in (None, 0)]
            if failed:
                # The survivors would block in a collective or at the coordinator until its timeout.
                status = failed[0].returncode
                print(f"[launch] process {processes.index(failed[0])} exited with {status}; stopping the others",
                      file=sys.stderr, flush=True)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        status = 130
    finally:
        _stop(processes)
        for thread in threads:
            thread.join(timeout=5)
    return status or next((p.returncode for p in processes if p.returncode), 0)


def _stop(processes, grace_s: float = 10.0) -> None:
    running = [p for p in processes if p.poll() is None]
    for process in running:
        os.killpg(process.pid, signal.SIGTERM)  # train.py checkpoints on SIGTERM when it can
    deadline = time.time() + grace_s
    for process in running:
        try:
            process.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1,
                        help="simulated CPU devices per process; 0 keeps the platform's own devices")
    args = parser.parse_args(ours)
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    return launch(args.processes, args.devices_per_process, train_args)


if __name__ == "__main__":
    sys.exit(main())
