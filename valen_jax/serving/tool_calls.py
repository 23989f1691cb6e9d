"""An assistant answer's text split into content and tool calls in OpenAI's shapes, as the text arrives.

The markup is the template family's (`data_pipeline.chat_templates`): ChatML/Qwen writes each call as
`<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>` (several per message, text around them
allowed); Llama 3.x writes the whole message as one `{"name": …, "parameters": …}` object. A block is
read by `evaluation.chat.parse_tool_calls`, the parser `generate` and `evaluate` use, so the server
reads a call exactly as the evaluation scores it.

OpenAI's API returns `function.arguments` as a JSON string (clients `json.loads` it) and streams calls as
`delta.tool_calls` entries (`index`, `id`, `type`, `function`), never as markup in `content`. So the
stream holds back whatever could still be markup: the tail that could start `<tool_call>`, a block until
it closes, a Llama-3 message that opens with `{` until it ends. A block that is not a call (not JSON, no
`name`, never closed) is text after all and goes out as content, markup included, as the non-streamed
answer shows it. Whitespace next to a call (the template's newlines between calls and around them) is
not content. The non-streamed message is this same split run on the whole text (`split_message`), so the
two cannot disagree."""

from __future__ import annotations

import json
import uuid

from valen_jax.evaluation.chat import parse_tool_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    """A call's id, unique per call (a client matches each tool message to its call by it)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_text(arguments) -> str:
    """`function.arguments` as OpenAI sends it: a JSON string (a string the model wrote is kept as is)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)


def _call(block: str, family: str | None) -> dict | None:
    """The OpenAI tool call a block of markup makes, or None when it is not one."""
    calls = parse_tool_calls(block, family)
    if len(calls) != 1 or not isinstance(calls[0], dict) or not isinstance(calls[0].get("name"), str):
        return None
    return {"id": call_id(), "type": "function",
            "function": {"name": calls[0]["name"], "arguments": arguments_text(calls[0].get("arguments"))}}


def _open_tail(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for size in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


class ToolCallSplit:
    """One choice's text (`feed`, piece by piece) → deltas: `{"content": text}` or `{"tool_calls": [call]}`
    with the call's `index` within the choice (module docstring)."""

    def __init__(self, family: str | None):
        self.llama3 = family == "llama3"
        self.family = family
        self.held = ""  # text that could still be (part of) a call
        self.space = ""  # whitespace after the last content or call: content only if text follows
        self.calls: list[dict] = []
        self.after_call = False  # no content since the last call
        self.started = False  # Llama 3: the message's first non-space character was seen
        self.call = False  # Llama 3: the message opens with `{` (it may be a call)

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """The deltas `text` completes; `final`: the choice ended, nothing is held back any more."""
        self.held += text
        out: list[dict] = []
        if self.llama3:
            self._llama3(out, final)
        else:
            self._chatml(out, final)
        if final:
            if self.space and not self.calls:  # an answer without calls keeps its text whole
                self._append(out, self.space)
            self.space = ""
        return out

    def _content(self, out: list[dict], text: str) -> None:
        if self.after_call:  # the template's whitespace after a call
            text = text.lstrip()
        if not text:
            return
        if not text.strip():  # whitespace: content only once text follows it
            self.space += text
            return
        body = text.rstrip()
        self._append(out, self.space + body)
        self.space, self.after_call = text[len(body):], False

    @staticmethod
    def _append(out: list[dict], text: str) -> None:
        if out and "content" in out[-1]:
            out[-1]["content"] += text
        else:
            out.append({"content": text})

    def _tool_call(self, out: list[dict], call: dict) -> None:
        self.space, self.after_call = "", True  # the template's whitespace around a call
        out.append({"tool_calls": [dict(call, index=len(self.calls))]})
        self.calls.append(call)

    def _chatml(self, out: list[dict], final: bool) -> None:
        while True:
            start = self.held.find(OPEN)
            if start < 0:
                keep = 0 if final else _open_tail(self.held)
                self._content(out, self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                return
            self._content(out, self.held[:start])
            self.held = self.held[start:]
            end = self.held.find(CLOSE)
            if end < 0:  # an open block: wait for its end (at the end of the choice it is text)
                if final:
                    self._content(out, self.held)
                    self.held = ""
                return
            block, self.held = self.held[:end + len(CLOSE)], self.held[end + len(CLOSE):]
            call = _call(block, self.family)
            if call is None:
                self._content(out, block)
            else:
                self._tool_call(out, call)

    def _llama3(self, out: list[dict], final: bool) -> None:
        if not self.started:
            stripped = self.held.lstrip()
            if not stripped:  # only whitespace so far: it may still open a call
                if final:
                    self._content(out, self.held)
                    self.held = ""
                return
            self.started = True
            self.call = stripped.startswith("{")
        if not self.call:
            self._content(out, self.held)
            self.held = ""
            return
        if not final:  # the message is one JSON object: readable once it has ended
            return
        call = _call(self.held, self.family)
        if call is None:
            self._content(out, self.held)
        else:
            self._tool_call(out, call)
        self.held = ""


def split_message(text: str, family: str | None) -> tuple[str | None, list[dict]]:
    """A finished answer's (content, tool calls) as the stream would have sent them: content None when the
    answer is calls only."""
    deltas = ToolCallSplit(family).feed(text, final=True)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", ())]
    for call in calls:
        del call["index"]
    return (content or None) if calls else content, calls
