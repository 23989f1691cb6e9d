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


class ScriptedEngine:
    """A stand-in for the decode engine whose answers are given, not decoded: `answer(request)` → the text
    the model "generates" for that request, tokenised with the served tokenizer and delivered `per_sync`
    tokens per event, then the end-of-turn token, as `SlotEngine` delivers tokens. A tiny model does not
    write tool calls by itself; this drives everything after decoding (detokenising, stop strings, the
    tool-call split, the HTTP route, the client) with the markup a trained model writes."""

    def __init__(self, service, answer, per_sync: int = 3):
        self.tokenizer, self.answer, self.per_sync = service.tokenizer, answer, per_sync
        self.stop_ids, self.slots, self.failure, self._stopping = frozenset({service.eot}), 1, None, False
        self.eot = service.eot
        self.prompts: list[list[int]] = []  # every request's prompt ids, in arrival order

    def submit(self, *requests) -> None:
        self.prompts += [list(map(int, r.ids)) for r in requests]
        threading.Thread(target=self._run, args=(requests,), daemon=True).start()

    def _run(self, requests) -> None:
        for request in requests:
            ids = [*self.tokenizer.encode(self.answer(request), add_special_tokens=False), self.eot]
            ids = ids[:request.max_new]
            for start in range(0, len(ids), self.per_sync):
                if request.cancelled:
                    break
                request.tokens.extend(ids[start:start + self.per_sync])
                if len(request.tokens) < len(ids):
                    request.emit(request.tokens[-1])
            request.finish_reason = "stop" if request.tokens and request.tokens[-1] == self.eot else "length"
            request.emit(None)

    def cancel(self, request) -> None:
        request.cancelled = True

    def busy(self) -> int:
        return 0

    def stop(self, drain: bool = True) -> None:
        self._stopping = True
