"""A real server for the serving tests: the smoke chat workdir behind uvicorn on 127.0.0.1, a free port,
in a background thread of the test process (so a test can also read the engine's state)."""

from __future__ import annotations

import socket
import threading

import uvicorn

from valen_jax.serve import load_service
from valen_jax.serving.app import build_app


class Served:
    def __init__(self, workdir, *, slots: int, max_queue: int, api_key: str | None = None, drafter=None):
        # No warm-up: compiling every prompt bucket up front costs the suite seconds its prompts never use.
        self.service = load_service(workdir, slots=slots, max_queue=max_queue, api_key=api_key, warm=False,
                                    drafter=drafter)
        with socket.socket() as probe:  # a free port: the kernel picks, the server binds it next
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(build_app(self.service), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:  # an event would be nicer; uvicorn exposes only this flag
            if not self.thread.is_alive():
                raise RuntimeError("the server thread ended before it started")
            self.thread.join(timeout=0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def serve_together(engine, requests) -> None:
    """`requests` (`serving.slots.Request`s; their `emit` is set here) admitted in one round of `engine`
    (a `SlotEngine`), until all have ended (bounded by pytest-timeout)."""
    done, pending = threading.Event(), [len(requests)]

    def emit(token):
        if token is None:
            pending[0] -= 1
            if not pending[0]:
                done.set()

    for request in requests:
        request.emit = emit
    engine.submit(*requests)  # queued together: admitted in one round where slots allow
    assert done.wait(timeout=300) and engine.failure is None
