"""Chat record → Example (seed 003, "Format", "Conversations and tool calls", "Images").

Arrays are those of VFlash, so the training loader reads chat shards unchanged:
- `input_ids` int32 [T]: the conversation through the tokenizer's training chat template (tools,
  tool calls and tool results included; each image part becomes one vision slot
  `<|vision_start|><|image_pad|><|vision_end|>`, which the loader expands);
- `target_weights` float32 [T]: 1 on the tokens of trained assistant messages, their end-of-turn
  token included, 0 elsewhere;
- `media_{i}` uint8: the bytes of the i-th image, in conversation order; headers in `meta.media`.

Meta: `format`, `source`, `line`, `entry`, `media`, `turns` (messages in the row),
`trained_turns` (assistant messages carrying weight), `tool_calls` (one list per assistant message
of `{"name", "arguments"}`, for exact-match evaluation), `answers` (one text per assistant message,
its text parts joined as the template writes them, '' for a message that only calls tools: the
reference the evaluation compares a generated answer with, seed 003). `arguments` is the JSON text
as rendered, not an object: the shard header is written with sorted keys, which would reorder an
object.

Decisions where the seed leaves room:
- Loss policy (seed 003: "Use the run's loss policy to specify how to train on multi-turn or
  tool-calling rows"): `assistant_turns="all"` trains every assistant message, `"last"` only the
  final one. Each assistant message must be exactly one marked span, or the policy could not be
  applied; a template that merges or splits them is refused.
- Control tokens (the tokenizer's special tokens and the added tokens its chat template writes,
  such as `<|im_start|>`, `<|image_pad|>`, `<tool_call>`) are refused in every text a row carries,
  the assistant's included: tokenised as control tokens they would forge template structure (a
  fake turn, a vision slot without an image, a span ending early).
- A template that renders a conversation without one of its tool calls, tool results or declared
  tools is refused: a dropped turn must never pass silently (DESIGN, "Lessons").
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
from transformers import PreTrainedTokenizerBase

from data_pipeline import examples, vocabulary
from data_pipeline.formats.chat import ChatMessage, ChatRecord, ImagePart, TextPart, ToolCall
from data_pipeline.render.common import (
    ChatTemplater,
    ChatTokens,
    ControlTokenGuard,
    RenderError,
    mask_runs,
    read_media,
    render_chat,
)
from data_pipeline.shards import Example
from data_pipeline.tokenizer import end_of_turn_id, token_id

ASSISTANT_TURNS = ("all", "last")


def arguments_text(call: ToolCall) -> str:
    """The arguments as the templates write them: a string verbatim, an object as `tojson` does."""
    if call.arguments_form == "string" and call.arguments_json is not None:
        return call.arguments_json
    return json.dumps(call.arguments, ensure_ascii=False)


class ChatRenderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, assistant_turns: str = "all"):
        if assistant_turns not in ASSISTANT_TURNS:
            raise ValueError(f"assistant_turns={assistant_turns!r}: choose one of {', '.join(ASSISTANT_TURNS)}")
        self.tokenizer = tokenizer
        self.assistant_turns = assistant_turns
        self.end_of_turn = end_of_turn_id(tokenizer)
        self.image_pad_id = token_id(tokenizer, vocabulary.IMAGE_PAD)
        self._guard = ControlTokenGuard(tokenizer)
        # Kept across records: a system turn listing the same tools is encoded once.
        self._templater = ChatTemplater(tokenizer)

    def control_token_in(self, text: str) -> str | None:
        return self._guard.find(text)

    def refuse_control_tokens(self, source: str, line: int, field: str, text: str) -> None:
        self._guard.refuse(source, line, field, text)

    def render(self, record: ChatRecord, entry: str) -> Example:
        for i, message in enumerate(record.messages):
            self._check_message(record, f"messages[{i}]", message)
        for i, tool in enumerate(record.tools):
            self.refuse_control_tokens(record.source, record.line, f"tools[{i}]",
                                       json.dumps(tool, ensure_ascii=False))
        return self.render_record(record, entry)

    def render_record(self, record: ChatRecord, entry: str) -> Example:
        """Template, mask and embed a record whose texts are checked already (see `render`)."""
        source, line = record.source, record.line
        messages = [_template_message(m) for m in record.messages]
        chat = render_chat(self.tokenizer, messages, source, line, tools=record.tools, end_of_turn=self.end_of_turn,
                           templater=self._templater)
        self._guard.refuse_formed(source, line, messages, chat.text,
                                  lambda fenced: self._templater.render_text(fenced, record.tools),
                                  lambda i: f"messages[{i}].content")
        ids = chat.input_ids
        runs = mask_runs(chat.assistant_mask)
        assistant = [m for m in record.messages if m.role == "assistant"]
        if len(runs) != len(assistant):
            raise RenderError(source, line, "messages",
                              f"the chat template marks {len(runs)} assistant spans for {len(assistant)} "
                              "assistant messages; the loss policy needs one span per message")
        self._check_nothing_dropped(record, chat, runs, assistant)
        weights = chat.assistant_mask.astype(np.float32)
        trained = len(runs)
        if self.assistant_turns == "last":
            weights[:runs[-1][0]] = 0.0
            trained = 1
        images = [p for m in record.messages if not isinstance(m.content, str)
                  for p in m.content if isinstance(p, ImagePart)]
        slots = int((ids == self.image_pad_id).sum())
        if slots != len(images):
            raise RenderError(source, line, "messages",
                              f"{slots} vision slots after templating, {len(images)} images in the row")
        # The path as written (relative to the JSONL) keeps shard bytes independent of the checkout.
        media = [read_media(p.path, "image", None, None, p.written) for p in images]
        arrays = {"input_ids": ids, "target_weights": weights}
        for index, blob in enumerate(media):
            arrays[f"media_{index}"] = np.frombuffer(blob.data, dtype=np.uint8)
        return examples.build(
            examples.TOKENS, arrays, format="chat", source=source, line=line, entry=entry,
            media=[blob.header() for blob in media], turns=len(record.messages), trained_turns=trained,
            tool_calls=[[{"name": c.name, "arguments": arguments_text(c)} for c in m.tool_calls]
                        for m in assistant],
            answers=[_text_of(m.content) for m in assistant])

    def _check_message(self, record: ChatRecord, field: str, message: ChatMessage) -> None:
        refuse = self.refuse_control_tokens
        if isinstance(message.content, str):
            refuse(record.source, record.line, f"{field}.content", message.content)
        else:
            for j, part in enumerate(message.content):
                if isinstance(part, TextPart):
                    refuse(record.source, record.line, f"{field}.content[{j}].text", part.text)
            # The template writes consecutive text parts back to back (images become vision slots).
            self._guard.refuse_joined(record.source, record.line, f"{field}.content",
                                      [p.text if isinstance(p, TextPart) else None for p in message.content])
        for k, call in enumerate(message.tool_calls):
            where = f"{field}.tool_calls[{k}].function"
            refuse(record.source, record.line, f"{where}.name", call.name)
            refuse(record.source, record.line, f"{where}.arguments", arguments_text(call))

    def _check_nothing_dropped(self, record: ChatRecord, chat: ChatTokens, runs: list[tuple[int, int]],
                               assistant: Sequence[ChatMessage]) -> None:
        """Each call inside its own message's span; results and declared tools outside every span.

        Read in the rendered text through the tokens' offsets: the text their decoding gives, without
        decoding (a fast tokenizer's offsets cover the text it encoded).
        """
        text, offsets = chat.text, chat.offsets

        def text_of(start: int, stop: int) -> str:
            return text[offsets[start, 0]:offsets[stop - 1, 1]]

        for (start, stop), message in zip(runs, assistant, strict=True):
            span = text_of(start, stop)
            for call in message.tool_calls:
                if call.name not in span:
                    raise RenderError(record.source, record.line, "messages",
                                      f"the chat template dropped tool call {call.id!r} ({call.name!r})")
        outside = "".join(text_of(start, stop) for start, stop in mask_runs(~chat.assistant_mask))
        for i, message in enumerate(record.messages):
            if message.role == "tool" and _text_of(message.content) not in outside:
                raise RenderError(record.source, record.line, f"messages[{i}]",
                                  "the chat template dropped this tool message")
        for i, tool in enumerate(record.tools):
            if tool["function"]["name"] not in outside:
                raise RenderError(record.source, record.line, f"tools[{i}]",
                                  "the chat template does not render the row's tools")


def _text_of(content: str | tuple) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if isinstance(p, TextPart))


def _template_message(message: ChatMessage) -> dict:
    """The dict a chat template reads (OpenAI shape); content parts keep their order."""
    if isinstance(message.content, str):
        content: str | list = message.content
    else:
        content = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                   for p in message.content]
    out: dict = {"role": message.role, "content": content}
    if message.tool_calls:
        # A mapping goes through `tojson` (key order kept), a string form is inserted verbatim.
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name,
                          "arguments": c.arguments_json if c.arguments_form == "string" else c.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out
