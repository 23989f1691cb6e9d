"""Reader and validator of chat-format JSONL (seed 003, "Format", "Conversations and tool calls", "Images").

Each line is one conversation: `messages` (system, user, assistant and tool messages) and an
optional row-level `tools` list. `read_chat` checks every line, collects every problem and raises
one `FormatError`. The nine refusals of seed 003 each have their own message (see `_Line.order`).

Decisions where the seed leaves room:
- Top-level keys are `messages` and `tools`; message keys are `role`, `content`, `tool_calls`
  (assistant only), `tool_call_id` (tool only, required there) and `name`. Unknown keys are refused.
- `content` is a string or a non-empty list of `{"type":"text","text"}` / `{"type":"image","path"}`
  parts. An assistant message carrying tool_calls may leave content out or write it as `null`
  (OpenAI style); it reads as "". Any non-empty text counts as text for the tool_calls+text refusal.
- A call's `arguments` is a JSON object or a string holding one (OpenAI style). Both keep the key
  order as written; the string form also keeps its exact text, so rendering can reproduce it.
- Image paths are relative to the JSONL file (seed 003, "Images"): absolute paths, URLs, and paths
  that leave the JSONL's folder by `..` or a symlink are refused (`allow_absolute_media` admits
  local ones, `media_paths`). With `check_media`, each image is decoded as the training loader
  decodes it (`media_decode`), so a file that is not an image is a problem of its line (issue 54).
- Checks beyond the nine that would make rendering ambiguous: call ids unique within a message, a
  call answered once, a tool message's `name` equal to the function it answers, and when a row
  declares `tools`, every call names a declared function (a row without `tools` may still call).
- A row is multi-turn when it has more than one assistant message (more than one trained turn,
  which is what a loss policy chooses between).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from data_pipeline.formats.errors import RECORD_FIELD, LineProblems, ProblemLog, describe, member
from data_pipeline.formats.jsonl import iter_jsonl_objects, loads_strict
from data_pipeline.formats.media_decode import image_problem
from data_pipeline.formats.media_paths import DatasetFolder, is_absolute

ROLES = ("system", "user", "assistant", "tool")
RECORD_KEYS = frozenset({"messages", "tools"})
MESSAGE_KEYS = {
    "system": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset({"role", "content", "name", "tool_calls"}),
    "tool": frozenset({"role", "content", "name", "tool_call_id"}),
}
PART_KEYS = {"text": frozenset({"type", "text"}), "image": frozenset({"type", "path"})}
FUNCTION_KEYS = frozenset({"name", "description", "parameters"})
FUNCTION_SHAPE = "name, description, parameters"


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    path: Path  # resolved absolute path
    written: str  # the path as the JSONL writes it, relative to the JSONL file


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict  # key order as written
    arguments_form: str  # "object" | "string"
    arguments_json: str | None = None  # the exact string when arguments_form == "string"


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | tuple[TextPart | ImagePart, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ChatRecord:
    source: str
    line: int
    messages: tuple[ChatMessage, ...]
    tools: tuple[dict, ...] = ()  # each {"type": "function", "function": {...}} as written


@dataclass(frozen=True)
class ChatDiagnostics:
    """Seed 003: counts a dataset reports; none of them is a finding."""

    rows: int
    multi_turn_rows: int
    tool_calls: int
    rows_declaring_tools: int

    def summary(self) -> str:
        return (
            f"{self.multi_turn_rows} multi-turn, {self.tool_calls} tool calls, "
            f"{self.rows_declaring_tools} rows declaring tools"
        )


def read_chat(path: str | Path, check_media: bool = True, allow_absolute_media: bool = False) -> list[ChatRecord]:
    """Every record of one chat JSONL file, or a FormatError listing every problem.

    `allow_absolute_media`: admit absolute image paths and paths leaving the JSONL's folder
    (`media_paths`); refused by default."""
    path = Path(path)
    source = str(path)
    problems = ProblemLog(source)  # lines come in order, so the problems do too
    folder = DatasetFolder(path.parent, allow_absolute_media)
    records = []
    for number, obj in iter_jsonl_objects(path, source, problems):
        line = _Line(source, number, folder, check_media)
        record = line.record(obj)
        problems.extend(line.problems)
        if record is not None and not line.problems:
            records.append(record)
    problems.raise_if_any()
    return records


def chat_diagnostics(records: list[ChatRecord]) -> ChatDiagnostics:
    return ChatDiagnostics(
        rows=len(records),
        multi_turn_rows=sum(sum(m.role == "assistant" for m in r.messages) > 1 for r in records),
        tool_calls=sum(len(m.tool_calls) for r in records for m in r.messages),
        rows_declaring_tools=sum(bool(r.tools) for r in records),
    )


class _Line(LineProblems):
    """The checks of one JSONL line; `problems` holds what it found."""

    def __init__(self, source: str, line: int, folder: DatasetFolder, check_media: bool):
        super().__init__(source, line)
        self.folder, self.check_media = folder, check_media

    def record(self, obj: object) -> ChatRecord | None:
        if not isinstance(obj, dict):
            self.problem(RECORD_FIELD, f"a record must be a JSON object, got {type(obj).__name__}")
            return None
        for key in sorted(set(obj) - RECORD_KEYS):
            self.problem(member("", key), "unknown key; a chat record has messages and tools")
        tools, declared = self.tools(obj.get("tools", []))
        raw = obj.get("messages")
        if not isinstance(raw, list) or not raw:
            self.problem("messages", "required: a non-empty list of messages")
            return None
        messages = [self.message(f"messages[{i}]", m) for i, m in enumerate(raw)]
        if any(m is None for m in messages):
            return None  # the order rules need every role; a bad role or shape is reported already
        self.order(messages, declared)
        return ChatRecord(self.source, self.line, tuple(messages), tools)

    # -- shapes ----------------------------------------------------------------------------------

    def tools(self, tools: object) -> tuple[tuple[dict, ...], set[str] | None]:
        if not isinstance(tools, list):
            self.problem("tools", 'must be a list of {"type": "function", "function": {...}}')
            return (), None
        names: set[str] = set()
        for i, tool in enumerate(tools):
            field = f"tools[{i}]"
            function = tool.get("function") if isinstance(tool, dict) else None
            if not (
                isinstance(function, dict)
                and set(tool) == {"type", "function"}
                and tool["type"] == "function"
            ):
                self.problem(field, f'must be {{"type": "function", "function": {{{FUNCTION_SHAPE}}}}}')
                continue
            for key in sorted(set(function) - FUNCTION_KEYS):
                self.problem(
                    member(f"{field}.function", key), f"unknown key; a function has {FUNCTION_SHAPE}"
                )
            name = function.get("name")
            if not _nonempty_str(name):
                self.problem(f"{field}.function.name", "required: a non-empty string")
            elif name in names:
                self.problem(f"{field}.function.name", f"{describe(name)} is declared twice")
            else:
                names.add(name)
            if "description" in function and not isinstance(function["description"], str):
                self.problem(f"{field}.function.description", "must be a string")
            if "parameters" in function:
                self.parameters(f"{field}.function.parameters", function["parameters"])
        # An empty list declares nothing; calls in such a row are then not checked against it.
        return tuple(tools), (names if tools else None)

    def parameters(self, field: str, schema: object) -> None:
        if not isinstance(schema, dict):
            self.problem(field, "must be a JSON Schema object")
            return
        problem = _schema_problem(json.dumps(schema))
        if problem is not None:
            self.problem(field, problem)

    def message(self, field: str, msg: object) -> ChatMessage | None:
        if not isinstance(msg, dict):
            self.problem(field, 'a message must be an object {"role": …, "content": …}')
            return None
        role = msg.get("role")
        if role not in ROLES:
            # Seed 003 refusal: a role other than system, user, assistant and tool.
            self.problem(f"{field}.role", f"{describe(role)} is not a role; roles are {', '.join(ROLES)}")
            return None
        before = len(self.problems)
        for key in sorted(set(msg) - MESSAGE_KEYS[role]):
            allowed = ", ".join(sorted(MESSAGE_KEYS[role]))
            self.problem(member(field, key), f"unknown key for {_a(role)} message; allowed: {allowed}")
        name = msg.get("name")
        if "name" in msg and not _nonempty_str(name):
            self.problem(f"{field}.name", "must be a non-empty string")
        calls = (
            self.tool_calls(field, msg["tool_calls"]) if "tool_calls" in MESSAGE_KEYS[role] & set(msg) else ()
        )
        tool_call_id = msg.get("tool_call_id")
        if role == "tool" and not _nonempty_str(tool_call_id):
            self.problem(f"{field}.tool_call_id", "required: the id of the call this tool message answers")
        content = msg.get("content")
        if content is None and role == "assistant" and calls:
            content = ""  # OpenAI writes null content beside tool_calls
        content = self.content(f"{field}.content", content, role)
        if len(self.problems) > before or content is None or calls is None:
            return None
        if calls and _has_text(content):
            # Seed 003 refusal: a template renders the calls, their results, then the text, so the
            # text moves after the results and its tokens cannot be attributed to this message.
            self.problem(
                f"{field}.content",
                "an assistant message carrying tool_calls also has text; a chat template renders the "
                "text after the tool results, so put it in a separate assistant message before the call",
            )
        return ChatMessage(role, content, calls, tool_call_id, name)

    def content(self, field: str, content: object, role: str) -> str | tuple | None:
        if isinstance(content, str):
            return content
        if not isinstance(content, list) or not content:
            self.problem(field, "required: a string or a non-empty list of text and image parts")
            return None
        parts: list[TextPart | ImagePart] = []
        for j, part in enumerate(content):
            pfield = f"{field}[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str) or kind not in PART_KEYS:
                self.problem(pfield, 'a part is {"type": "text", "text": …} or {"type": "image", "path": …}')
                continue
            for key in sorted(set(part) - PART_KEYS[kind]):
                self.problem(member(pfield, key), f"unknown key for a {kind} part")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    self.problem(f"{pfield}.text", "required: a string")
                else:
                    parts.append(TextPart(part["text"]))
                continue
            if role != "user":
                # Seed 003 refusal: only user messages carry images.
                self.problem(pfield, f"an image part in {_a(role)} message; only user messages carry images")
                continue
            image = self.image(f"{pfield}.path", part.get("path"))
            if image is not None:
                parts.append(image)
        return tuple(parts) if len(parts) == len(content) else None

    def image(self, field: str, value: object) -> ImagePart | None:
        if not _nonempty_str(value):
            self.problem(field, "required: a path relative to the JSONL file")
            return None
        if "://" in value:
            self.problem(field, f"{describe(value)} is a URL; images are local files")
            return None
        if is_absolute(value) and not self.folder.allow_outside:
            self.problem(
                field,
                f"{describe(value)} is absolute; seed 003 writes image paths relative to the JSONL file",
            )
            return None
        refusal = self.folder.refusal(value)  # `..` or a symlink leaving the JSONL's folder
        if refusal is not None:
            self.problem(field, refusal)
            return None
        path = Path(self.folder.path(value)).resolve()
        if self.check_media and not path.is_file():
            self.problem(field, f"file not found: {path}" if not path.exists() else f"not a file: {path}")
            return None
        if self.check_media:
            # Decoded as the loader will (issue 54): a bad image stops here, not at the first batch.
            why = image_problem(path)
            if why is not None:
                self.problem(field, why)
                return None
        return ImagePart(path, value)

    def tool_calls(self, field: str, calls: object) -> tuple[ToolCall, ...] | None:
        if not isinstance(calls, list) or not calls:
            self.problem(f"{field}.tool_calls", "must be a non-empty list; leave tool_calls out for no calls")
            return None
        found: list[ToolCall] = []
        ids: set[str] = set()
        for k, call in enumerate(calls):
            cfield = f"{field}.tool_calls[{k}]"
            if not (
                isinstance(call, dict)
                and set(call) == {"id", "type", "function"}
                and call["type"] == "function"
            ):
                self.problem(cfield, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
                continue
            function = call["function"]
            if not isinstance(function, dict) or set(function) != {"name", "arguments"}:
                self.problem(f"{cfield}.function", "must be an object with exactly name and arguments")
                continue
            ok = True
            if not _nonempty_str(call["id"]):
                self.problem(f"{cfield}.id", "required: a non-empty string")
                ok = False
            elif call["id"] in ids:
                self.problem(f"{cfield}.id", f"{describe(call['id'])} names two calls of this message")
                ok = False
            else:
                ids.add(call["id"])
            if not _nonempty_str(function["name"]):
                self.problem(f"{cfield}.function.name", "required: a non-empty string")
                ok = False
            arguments = self.arguments(f"{cfield}.function.arguments", function["arguments"])
            if ok and arguments is not None:
                found.append(ToolCall(call["id"], function["name"], *arguments))
        return tuple(found) if len(found) == len(calls) else None

    def arguments(self, field: str, value: object) -> tuple[dict, str, str | None] | None:
        if isinstance(value, dict):
            return value, "object", None
        if isinstance(value, str):
            try:
                parsed = loads_strict(value)
            except ValueError as err:
                self.problem(field, f"a string that is not JSON ({err}); write {{}} for no arguments")
                return None
            if isinstance(parsed, dict):
                return parsed, "string", value
        self.problem(field, "must be a JSON object, or a string holding one")
        return None

    # -- the order of messages (seed 003, "Conversations and tool calls") ------------------------

    def order(self, messages: list[ChatMessage], declared: set[str] | None) -> None:
        roles = [m.role for m in messages]
        missing = [r for r in ("user", "assistant") if r not in roles]
        if missing:
            self.problem(
                "messages",
                f"no {' and no '.join(missing)} message; a row needs a user and an assistant message",
            )
        if roles[-1] != "assistant" and "assistant" in roles:
            self.problem(
                "messages", f"the row ends with {_a(roles[-1])} message; a row ends with an assistant message"
            )
        for i, role in enumerate(roles):
            if role == "system" and i > 0:
                self.problem(f"messages[{i}].role", "a system message must be the first message of the row")
        # The calls that the current run of tool messages answers, with where they were made.
        caller: int | None = None
        answered: set[str] = set()
        for i, msg in enumerate(messages):
            if msg.role == "tool":
                self.answer(i, msg, messages, caller, answered)
                continue
            self.unanswered(messages, caller, answered)
            caller = i if msg.tool_calls else None
            answered = set()
            for k, call in enumerate(msg.tool_calls):
                if declared is not None and call.name not in declared:
                    self.problem(
                        f"messages[{i}].tool_calls[{k}].function.name",
                        f"{describe(call.name)} is not among the row's tools ({', '.join(map(describe, sorted(declared)))})",
                    )
        self.unanswered(messages, caller, answered)

    def answer(self, i: int, msg: ChatMessage, messages: list, caller: int | None, answered: set) -> None:
        if caller is None:
            self.problem(
                f"messages[{i}]", "a tool message must follow an assistant message carrying tool_calls"
            )
            return
        calls = {c.id: c for c in messages[caller].tool_calls}
        field = f"messages[{i}].tool_call_id"
        if msg.tool_call_id not in calls:
            self.problem(
                field,
                f"{describe(msg.tool_call_id)} was not called by the preceding assistant message "
                f"messages[{caller}] (it called {', '.join(map(describe, calls))})",
            )
        elif msg.tool_call_id in answered:
            self.problem(field, f"{describe(msg.tool_call_id)} is answered twice")
        else:
            answered.add(msg.tool_call_id)
            call_name = calls[msg.tool_call_id].name
            if msg.name is not None and msg.name != call_name:
                self.problem(
                    f"messages[{i}].name",
                    f"{describe(msg.name)}, but call {describe(msg.tool_call_id)} is {describe(call_name)}",
                )

    def unanswered(self, messages: list, caller: int | None, answered: set) -> None:
        if caller is None:
            return
        for k, call in enumerate(messages[caller].tool_calls):
            if call.id not in answered:
                self.problem(
                    f"messages[{caller}].tool_calls[{k}]",
                    f"call {describe(call.id)} ({describe(call.name)}) is answered by no following tool message",
                )


@functools.lru_cache(maxsize=4096)
def _schema_problem(text: str) -> str | None:
    """Why the JSON Schema `text` is invalid, or None.

    Keyed by the schema's JSON text: rows repeat the same few tool schemas, and checking one against
    the meta-schema costs milliseconds (most of reading a tool-calling file before this cache).
    """
    schema = json.loads(text)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as err:
        where = "/".join(str(p) for p in err.path)
        return f"not a valid JSON Schema{' at ' + where if where else ''}: {err.message}"
    except RecursionError:
        # jsonschema recurses per level, deeper than the JSON parser needed: a problem, not a traceback.
        return "nested too deeply to check against the JSON Schema meta-schema"
    return None


def _a(role: str) -> str:
    return f"an {role}" if role == "assistant" else f"a {role}"


def _nonempty_str(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _has_text(content: str | tuple) -> bool:
    if isinstance(content, str):
        return bool(content)
    return any(isinstance(p, TextPart) and p.text for p in content)
