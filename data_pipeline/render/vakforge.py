"""Vakforge conversation → chat Example: the turn-based text adapter (seed 002, "Adapters").

A conversation becomes a chat row and goes through `ChatRenderer`, so its Example has the arrays
and meta of a chat Example (format `vakforge`): `system_prompt` → system message; `tools` →
row-level tools; user/agent spoken turns → user/assistant messages; agent `tool_call` turns →
assistant `tool_calls` (consecutive calls, issued in parallel, become one message); `tool` turns →
tool messages answering their call (content as written if a string, else its JSON, keys in order).
Audio is not embedded: this adapter trains the text side (cascaded STT→LLM→TTS); duplex adapters
read the recording.

Overlapping turns (seed 002, "turns[].overlap": "turn-based adapters drop or merge such turns and
log how many"), `overlap=`:
- `"merge"`: every spoken turn is kept in start order (an interjection of the other speaker is
  appended after the turn it overlaps), and consecutive spoken turns of one speaker become one
  message, texts joined by a space.
- `"drop"`: every overlapping spoken turn is dropped; nothing is joined.
Meta `overlaps` counts `turns` (overlapping turns seen), `merged` (turns joined into the message
before) and `dropped`; `skipped.overlapping_turns` repeats the dropped count. convert sums both
into manifest.json's `counts`.

Meta for evaluation breakdowns (seed 002: eval breaks down by locale and by source): `id`,
`locale`, `language`, `data_source` (meta.source: real | synthetic | public), `domain`,
`scenario`, `split`, and `entities` of the kept turns, with `message` (index in the rendered
conversation), `answer` (for an agent's entity, the index of its assistant message among the
assistant messages, as in meta `answers` and `tool_calls`; null for a user's) and offsets into that
message's text (shifted when turns were joined).

`split=` (convert `--split`) and the dataset's `manifest_hash`: see
`data_pipeline.formats.vakforge_items`, which reads the conversations.

Control tokens in the system prompt, turn texts, tool declarations, arguments or results are
refused with the turn and field, as for chat rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from data_pipeline import examples
from data_pipeline.formats.chat import ChatMessage, ChatRecord, ToolCall
from data_pipeline.formats.vakforge import VakforgeConversation
from data_pipeline.formats.vakforge_items import VakforgeItem
from data_pipeline.render.chat import ChatRenderer
from data_pipeline.shards import Example

OVERLAP_POLICIES = ("merge", "drop")


@dataclass
class _Message:
    role: str
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    answers: str | None = None  # tool message: the call id
    name: str | None = None
    turns: list[int] = field(default_factory=list)


class VakforgeRenderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, overlap: str = "merge", assistant_turns: str = "all"):
        if overlap not in OVERLAP_POLICIES:
            raise ValueError(f"overlap={overlap!r}: choose one of {', '.join(OVERLAP_POLICIES)}")
        self.overlap = overlap
        self.chat = ChatRenderer(tokenizer, assistant_turns)

    def render(self, item: VakforgeItem, entry: str) -> Example:
        conv = item.conversation
        self._check_texts(item)
        messages, entities, overlaps = self._messages(conv)
        for m in messages:
            if len(m.turns) > 1 and not m.calls:  # spoken turns merged into one message: check the joined text
                self.chat.refuse_control_tokens(item.source, item.line,
                                                f"id={conv.id}: turns[{m.turns[0]}..{m.turns[-1]}].text", m.text)
        chat_messages = []
        if conv.system_prompt:
            chat_messages.append(ChatMessage("system", conv.system_prompt))
        offset = len(chat_messages)
        for m in messages:
            chat_messages.append(ChatMessage(m.role, m.text, tuple(m.calls), m.answers, m.name))
        tools = tuple({"type": "function", "function": {
            "name": tool.name, **({"description": tool.description} if tool.description is not None else {}),
            "parameters": tool.parameters}} for tool in conv.tools)
        record = ChatRecord(item.source, item.line, tuple(chat_messages), tools)
        example = self.chat.render_record(record, entry)
        answer_of = {k: sum(m.role == "assistant" for m in messages[:k]) for k, m in enumerate(messages)
                     if m.role == "assistant"}
        for entity in entities:
            entity["answer"] = answer_of.get(entity["message"])
            entity["message"] += offset
        return examples.extend(
            example, examples.TOKENS, format="vakforge", id=conv.id, locale=conv.locale,
            language=conv.language.primary, data_source=conv.meta.source, domain=conv.domain,
            scenario=conv.scenario, split=item.split, entities=entities, overlaps=overlaps,
            skipped={"overlapping_turns": overlaps["dropped"]} if overlaps["dropped"] else {})

    def _messages(self, conv: VakforgeConversation) -> tuple[list[_Message], list[dict], dict[str, int]]:
        messages: list[_Message] = []
        entities: list[dict] = []
        overlaps = {"turns": 0, "merged": 0, "dropped": 0}
        calls: dict[str, str] = {}  # call id -> tool name, for the tool message's name
        for i, turn in enumerate(conv.turns):
            last = messages[-1] if messages else None
            if turn.tool_call is not None:
                call = turn.tool_call
                calls[call.id] = call.name
                # OpenAI order: a string-free object keeps its key order through `tojson`.
                tool_call = ToolCall(call.id, call.name, dict(call.arguments), "object")
                if last is not None and last.role == "assistant" and last.calls:
                    last.calls.append(tool_call)  # issued in parallel: one message, several calls
                    last.turns.append(i)
                else:
                    messages.append(_Message("assistant", calls=[tool_call], turns=[i]))
                continue
            if turn.tool_result is not None:
                content = turn.tool_result.content
                text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
                messages.append(_Message("tool", text, answers=turn.tool_result.id,
                                         name=calls.get(turn.tool_result.id), turns=[i]))
                continue
            role = "user" if turn.speaker == "user" else "assistant"
            text = turn.text or ""
            if turn.overlap:
                overlaps["turns"] += 1
                if self.overlap == "drop":
                    overlaps["dropped"] += 1
                    continue
            shift = 0
            if self.overlap == "merge" and last is not None and last.role == role and not last.calls \
                    and last.answers is None:
                shift = len(last.text) + 1
                last.text = f"{last.text} {text}"
                last.turns.append(i)
                overlaps["merged"] += 1
            else:
                messages.append(_Message(role, text, turns=[i]))
            for entity in turn.entities or ():
                found = entity.model_dump()
                for key in ("start_char", "end_char"):
                    if found[key] is not None:
                        found[key] += shift
                entities.append({"turn": i, "message": len(messages) - 1, "speaker": turn.speaker, **found})
        return messages, entities, overlaps

    def _check_texts(self, item: VakforgeItem) -> None:
        conv, refuse = item.conversation, self.chat.refuse_control_tokens

        def check(where: str, text: str) -> None:
            refuse(item.source, item.line, f"id={conv.id}: {where}", text)

        if conv.system_prompt:
            check("system_prompt", conv.system_prompt)
        for i, tool in enumerate(conv.tools):
            check(f"tools[{i}]", tool.model_dump_json())
        for i, turn in enumerate(conv.turns):
            if turn.text is not None:
                check(f"turns[{i}].text", turn.text)
            if turn.tool_call is not None:
                check(f"turns[{i}].tool_call", json.dumps(turn.tool_call.model_dump(), ensure_ascii=False))
            if turn.tool_result is not None:
                check(f"turns[{i}].tool_result.content", json.dumps(turn.tool_result.content, ensure_ascii=False))
