"""The FastAPI routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`, and the Valen
extension `/v1/valen/score` (seed-000 records in, `predict`'s answer lines out).

Streaming answers are server-sent events (`data: {chunk}` lines, then `data: [DONE]`). A client that
disconnects cancels its choices: their slots are free before the next decode step."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from valen_jax.serving import errors
from valen_jax.serving.detokenize import IncrementalText, StopCut
from valen_jax.serving.errors import APIError
from valen_jax.serving.logprobs import ChoiceLogprobs, merged
from valen_jax.serving.protocol import ChatRequest, CompletionRequest, ScoreRequest
from valen_jax.serving.service import Service
from valen_jax.serving.tool_calls import ToolCallSplit


def build_app(service: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        # uvicorn has stopped accepting and let in-flight requests finish (SIGTERM): then the engine drains.
        service.engine.stop(drain=True)

    app = FastAPI(title="valen-jax", lifespan=lifespan)
    errors.install(app)
    if service.api_key:
        app.add_middleware(_APIKey, key=service.api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok", "busy": service.engine.busy(), "slots": service.engine.slots}

    @app.get("/v1/valen/metrics")
    async def metrics(reset: bool = False):
        # Where the latest requests' time to first token went in the engine (`SlotEngine.metrics`); `?reset=true`
        # starts a new window (a benchmark's phase).
        return {"object": "valen.metrics", "model": service.name, **service.engine.metrics(reset),
                "garbage_collection": service.pauses.summary(reset)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [service.model_card()]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        service.check_model(body)
        if service.has_images(body):
            prompt = await asyncio.to_thread(service.chat_prompt, body)  # converts and processes its images
        else:
            prompt = service.chat_prompt(body)
        return await _answer(service, body, [prompt], request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service.check_model(body)
        return await _answer(service, body, service.completion_prompts(body), request, chat=False)

    @app.post("/v1/valen/score")
    async def valen_score(body: ScoreRequest):
        service.check_model(body)
        return await asyncio.to_thread(service.score, body)

    return app


class _APIKey:
    """`--api-key`: every route but /health needs `Authorization: Bearer <key>`, else 401 naming the header.
    A plain ASGI middleware: Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`) runs each request
    through an extra task and memory stream, which cost every streamed token's event a hop (and the route a
    few hundred microseconds of a time to first token)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization")
            if given != self.expected:
                response = APIError(401, "Authorization: a valid 'Bearer <api key>' header is required",
                                    "Authorization", "invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Choice:
    """One choice's text as tokens arrive (`detokenize`: only the new tokens decoded, half characters and
    the start of a possible stop string held back); a stop string ends it early (its slot then freed).
    With log-probabilities asked for, `logprobs` makes the entries of the text sent (`serving.logprobs`)."""

    def __init__(self, service: Service, request, stops: list[str], live: bool, logprobs: ChoiceLogprobs | None):
        self.service, self.request = service, request
        self.text, self.cut = IncrementalText(service.tokenizer), StopCut(stops)
        # A non-streamed answer without stop strings needs its text once, at the end.
        self.live = live or bool(stops)
        self.sent, self.finish = "", None
        self.split = ToolCallSplit(service.family)  # a streamed chat answer's content and tool calls
        self.logprobs, self.pending = logprobs, None  # entries not yet sent with a chunk

    def advance(self, token) -> str:
        """The new text to send after an event (token None: the choice ended)."""
        if self.finish is not None:  # cut at a stop string: what the engine still sends is dropped
            return ""
        ended = token is None
        if not ended and not self.live:
            return ""
        ids = self.request.tokens[:len(self.request.tokens)]  # a snapshot: the engine thread appends
        if ids and ids[-1] in self.service.engine.stop_ids:  # a stop token is never text
            ids = ids[:-1]
        new = self.cut.feed(self.text.finish(ids) if ended else self.text.add(ids), final=ended)
        if self.cut.stopped:
            self.finish = "stop"
            self.service.engine.cancel(self.request)
        elif ended:
            self.finish = self.request.finish_reason
        self.sent += new
        return new

    async def entries(self):
        """The log-probability entries the text sent so far adds (with those held back), or None."""
        if self.logprobs is None:
            return None
        tokens = self.request.tokens[:len(self.request.tokens)]
        stopped_by_token = self.finish == "stop" and not self.cut.stopped
        new = await asyncio.to_thread(self.logprobs.entries, tokens, self.sent, self.finish is not None,
                                      stopped_by_token)
        held, self.pending = merged(self.pending, new), None
        return held


async def _answer(service: Service, body, prompts: list[dict], http: Request, *, chat: bool):
    top, echo = body.top(), not chat and body.echo
    requests, events = service.submit(body, prompts)
    per_request = [prompt for prompt in prompts for _ in range(body.n)]

    def logprobs(request) -> ChoiceLogprobs | None:
        if top is None:
            return None
        return ChoiceLogprobs(service.scores, service.token_text, request.ids, top, chat=chat, echo=echo,
                              stop_ids=service.engine.stop_ids)

    choices = [_Choice(service, r, body.stops(), body.stream, logprobs(r)) for r in requests]
    ident, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": service.name}

    def usage():
        completion = sum(len(r.tokens) for r in requests)
        prompt = sum(len(r.ids) for r in requests)
        counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if service.drafter is None:
            return counts
        # OpenAI's predicted-output counts, and ours: verify passes and the tokens they committed in blocks,
        # outside blocks the passes verifying a call's fixed text and the tokens they committed, and the spans
        # whose drafting stopped (`loop.PATIENCE` misses in a row) with the tokens plain steps committed there.
        spec = {k: sum((r.speculation or {}).get(k, 0) for r in requests)
                for k in ("verify_passes", "block_tokens", "drafted_tokens", "accepted_tokens", "spelling_passes",
                          "spelling_tokens", "stopped_spans", "undrafted_tokens")}
        return dict(counts, completion_tokens_details={
            "accepted_prediction_tokens": spec["accepted_tokens"],
            "rejected_prediction_tokens": spec["drafted_tokens"] - spec["accepted_tokens"]}, valen=spec)

    def valen(choice: _Choice) -> dict:
        extension = service.extension(choice.sent)
        return {} if extension is None else {"valen": extension}

    async def final(choice: _Choice, index: int) -> dict:
        entries = await choice.entries()
        if entries is None and choice.logprobs is not None:  # asked for, but no token to show
            entries = [] if chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if not chat:
            text = (per_request[index]["text"] if echo else "") + choice.sent
            return {"index": index, "text": text, "finish_reason": choice.finish, "logprobs": entries,
                    **valen(choice)}
        message, finish = service.message(choice.sent, choice.finish)
        return {"index": index, "message": message, "finish_reason": finish,
                "logprobs": None if entries is None else {"content": entries}, **valen(choice)}

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
        if any(c.finish == "error" for c in choices):
            raise APIError(500, f"the decode engine failed: {service.engine.failure}", None, "engine_failed",
                           "server_error")
        return JSONResponse(dict(head, choices=[await final(c, i) for i, c in enumerate(choices)], usage=usage()))

    chunk_head = dict(head, object="chat.completion.chunk" if chat else "text_completion")

    def chunk(index: int, delta, finish=None, tail=None, entries=None) -> str:
        """One choice's chunk: chat, its `delta` (a dict: content or tool_calls); completions, its text."""
        if chat:
            shown = None if entries is None else {"content": entries}
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": shown}
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish, "logprobs": entries}
        choice.update(tail or {})  # the last chunk of a choice: its `valen` extension
        return f"data: {json.dumps(dict(chunk_head, choices=[choice]))}\n\n"

    async def sse(index: int, text: str, done: set) -> list[str]:
        """The chunks one event makes (none while its text is held back); log-probability entries go with
        the choice's next chunk."""
        choice = choices[index]
        ended = choice.finish is not None
        if index in done:
            return []
        if chat:  # content and tool calls apart, no markup in content (`serving.tool_calls`)
            deltas = choice.split.feed(text, final=ended)
        else:
            deltas = [text] if text else []
        entries = await choice.entries()
        if not ended:
            if not deltas:
                choice.pending = entries
                return []
            return [chunk(index, delta, entries=entries if k == 0 else None) for k, delta in enumerate(deltas)]
        done.add(index)
        out = [chunk(index, delta, entries=entries if k == 0 else None) for k, delta in enumerate(deltas)]
        finish = "tool_calls" if chat and choice.split.calls else choice.finish
        return [*out, chunk(index, {} if chat else "", finish, valen(choice), None if out else entries)]

    async def opening(index: int) -> str:
        """A choice's first chunk: chat, the role; completions with echo, the prompt (and its entries)."""
        if chat:
            return chunk(index, {"role": "assistant", "content": ""})
        return chunk(index, per_request[index]["text"], entries=await choices[index].entries())

    async def stream():
        # Every event already waiting is sent in one write (the role chunks go with the first, the usage and
        # [DONE] with the last): each write is a send on the socket, and under load they were most of the
        # event loop's time; the chunks themselves, one per event, are unchanged.
        try:
            out = [await opening(i) for i in range(len(choices))] if chat or echo else []
            done: set[int] = set()
            while len(done) < len(choices):
                pending = [await events.get()]
                while not events.empty():
                    pending.append(events.get_nowait())
                for index, token in pending:
                    out += await sse(index, choices[index].advance(token), done)
                if out and len(done) < len(choices):
                    yield "".join(out)
                    out = []
            if (body.stream_options or {}).get("include_usage"):
                out.append(f"data: {json.dumps(dict(chunk_head, choices=[], usage=usage()))}\n\n")
            yield "".join([*out, "data: [DONE]\n\n"])
        finally:  # the client went away (the generator is closed) or the answer is complete
            cancel_all()

    return StreamingResponse(stream(), media_type="text/event-stream")
