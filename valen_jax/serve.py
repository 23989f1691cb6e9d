"""Serve a trained workdir over an OpenAI-compatible HTTP API (FastAPI on uvicorn), with continuous
batching over fixed decode slots.

    python -m valen_jax.serve --workdir=runs/chat-smoke [--host=127.0.0.1] [--port=8000] [--max-batch=8] \
        [--max-queue=64] [--api-key=KEY] [--drafter=DRAFTER_WORKDIR]
    curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model": "chat-smoke", "messages": [{"role": "user", "content": "What is 4 plus 23?"}]}'

Routes: `/v1/chat/completions` (stream with `"stream": true`; image parts as `data:image/...;base64,` URLs
for a workdir with a vision tower), `/v1/completions`, `/v1/models` (the model id is the workdir's
directory name), `/health`, `/v1/valen/score` (seed-000 records in, `predict`'s answer lines out), and `/v1/valen/metrics` (where the latest
requests' time to first token went in the engine: queue, other prefills, their own prefill). Greedy unless `temperature` > 0 (the default is
0, as `generate`); a greedy answer is token for token `python -m valen_jax.generate`'s for the same prompt,
alone or beside other requests. `--max-batch` decode slots share one compiled step; up to `--max-queue`
requests wait for a slot, beyond that the answer is 429 with `Retry-After`. It listens on 127.0.0.1
unless `--host` says otherwise; with `--api-key` (or `VALEN_API_KEY`) every route but `/health` wants
`Authorization: Bearer KEY`. SIGTERM or Ctrl-C stops accepting, lets in-flight requests finish, then exits
143 / 130 (128 + the signal, as `train`), so a scheduler never reads a stop as success.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

from data_pipeline.cli_flags import add_flag
from valen_jax.cli import log_setup as cli_logging
from valen_jax.cli.boundary import error_boundary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    add_flag(parser, "--max-batch", type=int, default=8, help="decode slots (default 8)")
    add_flag(parser, "--max-queue", type=int, default=64, help="requests waiting for a slot before 429 (default 64)")
    add_flag(parser, "--steps-per-sync", type=int, default=4,
             help="decode steps on the device between two host syncs, when requests join and leave (default 4)")
    add_flag(parser, "--api-key", default=None, help="default: $VALEN_API_KEY, else no key")
    parser.add_argument("--drafter", default=None,
                        help="a vflash drafter workdir trained against --workdir: announced blocks are decoded "
                             "speculatively (lossless; usage reports accepted tokens and verify passes)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_batch < 1:
        raise SystemExit(f"--max-batch={args.max_batch}: must be >= 1")
    if args.max_queue < 1:
        raise SystemExit(f"--max-queue={args.max_queue}: must be >= 1")
    if args.steps_per_sync < 1:
        raise SystemExit(f"--steps-per-sync={args.steps_per_sync}: must be >= 1")
    for flag, path in (("--workdir", args.workdir), ("--drafter", args.drafter)):
        if path is not None and not os.path.isdir(path):
            raise SystemExit(f"{flag}={path}: no such directory")
    # force: importing orbax logs through absl, which configures the root logger at WARNING first, and the
    # server's start-up lines (its warm-up, what it froze out of garbage collection) were never shown.
    cli_logging.configure(force=True)
    with error_boundary("valen_jax.serve", paths=(args.workdir, *([args.drafter] if args.drafter else []))):
        import uvicorn

        from valen_jax.serving.app import build_app
        app = build_app(load_service(args.workdir, args.step, slots=args.max_batch, max_queue=args.max_queue,
                                     steps_per_sync=args.steps_per_sync, api_key=args.api_key or os.environ.get("VALEN_API_KEY"),
                                     drafter=args.drafter))
        stopped = _stop_signals()
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    if stopped:
        print(f"serve: stopped by {signal.Signals(stopped[0]).name} after draining", file=sys.stderr)
        return 128 + stopped[0]
    return 0


def _stop_signals() -> list[int]:
    """The signals that stopped the server, filled once it has drained: uvicorn catches SIGINT and SIGTERM
    while it serves, drains, restores the handlers it found (these) and raises each signal again, which
    lands here instead of ending the process with SIGTERM's status or a KeyboardInterrupt traceback.
    Installed after start-up, so Ctrl-C during the restore and warm-up still interrupts at once."""
    stopped: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda number, _frame: stopped.append(number))
    return stopped


def load_service(workdir, step=None, *, slots: int = 8, max_queue: int = 64, steps_per_sync: int = 4,
                 api_key: str | None = None, warm: bool = True, drafter=None):
    """The restored workdir and its slot engine, ready for `serving.app.build_app`; `drafter`: a vflash
    workdir (its latest step) trained against this workdir's weights, refused otherwise (`run.check_target`)."""
    from valen_jax.run import decoding_layout, restore_drafter, restore_model
    from valen_jax.serving.service import Service
    from valen_jax.training.checkpoint import CheckpointError

    restored = restore_model(workdir, step)
    try:
        draft = None if drafter is None else restore_drafter(drafter, target=restored)
    except CheckpointError as error:  # the message names the directory; the user also needs the flag
        raise CheckpointError(f"--drafter: {error}") from None
    restored = decoding_layout(restored)  # after the drafter's check of the target as saved
    if draft is not None:
        draft = dataclasses.replace(draft, target=restored)
    return Service(restored, slots=slots, max_queue=max_queue, steps_per_sync=steps_per_sync, api_key=api_key,
                   warm=warm, drafter=draft)


if __name__ == "__main__":
    sys.exit(main())
