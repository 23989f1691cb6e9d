"""The FastAPI routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`.

Streaming answers are server-sent events (`data: {chunk}` lines, then `data: [DONE]`). A client that
disconnects cancels its choices: their slots are free before the next decode step."""

from __future__ import annotations

import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from valen_jax.serving import errors
from valen_jax.serving.errors import APIError
from valen_jax.serving.protocol import ChatRequest, CompletionRequest
from valen_jax.serving.service import Service, cut_at_stop


def build_app(service: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        # uvicorn has stopped accepting and let in-flight requests finish (SIGTERM): then the engine drains.
        service.engine.stop(drain=True)

    app = FastAPI(title="valen-jax", lifespan=lifespan)
    errors.install(app)

    @app.middleware("http")
    async def api_key(request: Request, call_next):
        if service.api_key and request.url.path != "/health":
            if request.headers.get("authorization") != f"Bearer {service.api_key}":
                return APIError(401, "Authorization: a valid 'Bearer <api key>' header is required",
                                "Authorization", "invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "busy": service.engine.busy(), "slots": service.engine.slots}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [service.model_card()]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        service.check_model(body)
        return await _answer(service, body, service.chat_ids(body), request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service.check_model(body)
        return await _answer(service, body, service.completion_ids(body), request, chat=False)

    return app


class _Choice:
    """One choice's text as tokens arrive; stop strings end it early (its slot then freed)."""

    def __init__(self, service: Service, request, stops: list[str]):
        self.service, self.request, self.stops = service, request, stops
        self.sent, self.finish = "", None

    def advance(self, token) -> str:
        """The new text to send after an event (the tail that could still start a stop string held back)."""
        request = self.request
        text = self.service.text(request)
        if token is None and self.finish is None:
            self.finish = request.finish_reason
        cut = cut_at_stop(text, self.stops)
        if cut is not None and self.finish in (None, "stop", "length"):
            text, self.finish = text[:cut], "stop"
            self.service.engine.cancel(request)
        elif self.finish is None and self.stops:
            text = text[:max(len(self.sent), len(text) - max(map(len, self.stops)) + 1)]
        elif self.finish is None and text.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
            text = self.sent
        new, self.sent = text[len(self.sent):], text
        return new


async def _answer(service: Service, body, ids, http: Request, *, chat: bool):
    requests, events = service.submit(body, ids)
    choices = [_Choice(service, r, body.stops()) for r in requests]
    ident, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": service.name}

    def usage():
        completion = sum(len(r.tokens) for r in requests)
        return {"prompt_tokens": len(ids) * len(requests), "completion_tokens": completion,
                "total_tokens": len(ids) * len(requests) + completion}

    def valen(choice: _Choice) -> dict:
        extension = service.extension(choice.sent)
        return {} if extension is None else {"valen": extension}

    def final(choice: _Choice, index: int) -> dict:
        if not chat:
            return {"index": index, "text": choice.sent, "finish_reason": choice.finish, "logprobs": None,
                    **valen(choice)}
        message, finish = service.message(choice.sent, choice.finish)
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": None, **valen(choice)}

    async def next_event():
        index, token = await events.get()
        return index, choices[index].advance(token)

    def cancel_all():
        for request in requests:
            service.engine.cancel(request)

    if not body.stream:
        try:
            while any(c.finish is None for c in choices):
                await next_event()
        finally:
            cancel_all()
        return JSONResponse(dict(head, choices=[final(c, i) for i, c in enumerate(choices)], usage=usage()))

    chunk_head = dict(head, object="chat.completion.chunk" if chat else "text_completion")

    def chunk(index: int, text: str, finish=None, extra=None, tail=None) -> str:
        if chat:
            delta = dict({"content": text} if text or finish is None else {}, **(extra or {}))
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        choice.update(tail or {})  # the last chunk of a choice: its `valen` extension
        return f"data: {json.dumps(dict(chunk_head, choices=[choice]))}\n\n"

    async def stream():
        try:
            if chat:
                for i in range(len(choices)):
                    yield chunk(i, "", extra={"role": "assistant"})
            done = set()
            while len(done) < len(choices):
                index, text = await next_event()
                choice = choices[index]
                if choice.finish is None:
                    if text:
                        yield chunk(index, text)
                    continue
                if index in done:
                    continue
                done.add(index)
                if text:
                    yield chunk(index, text)
                finish = choice.finish
                extra = None
                if chat:
                    message, finish = service.message(choice.sent, choice.finish)
                    if "tool_calls" in message:
                        extra = {"tool_calls": [dict(call, index=k) for k, call in enumerate(message["tool_calls"])]}
                yield chunk(index, "", finish, extra, valen(choice))
            if (body.stream_options or {}).get("include_usage"):
                yield f"data: {json.dumps(dict(chunk_head, choices=[], usage=usage()))}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is closed) or the answer is complete
            cancel_all()

    return StreamingResponse(stream(), media_type="text/event-stream")
