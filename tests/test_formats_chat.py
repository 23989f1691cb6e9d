"""Chat JSONL reader (seed 003, "Format", "Conversations and tool calls", "Images").

Each of the nine refusals of seed 003 has a passing and a failing row; then the shapes, the
arguments' key order, media paths and the diagnostics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipeline.formats.chat import (
    ChatDiagnostics,
    ChatMessage,
    ImagePart,
    TextPart,
    ToolCall,
    chat_diagnostics,
    read_chat,
)
from data_pipeline.formats.errors import FormatError, Problem

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Look up the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def sys_(text: str = "You are a weather assistant.") -> dict:
    return {"role": "system", "content": text}


def user(content: object = "What is the weather in Wellington?") -> dict:
    return {"role": "user", "content": content}


def assistant(content: object = "It is 18C and windy in Wellington.", **extra: object) -> dict:
    return {"role": "assistant", "content": content, **extra}


def call(id_: str = "call_1", name: str = "get_weather", arguments: object = None) -> dict:
    args = {"city": "Wellington"} if arguments is None else arguments
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}


def calling(*calls: dict) -> dict:
    return assistant("", tool_calls=list(calls or [call()]))


def tool(id_: str = "call_1", content: str = "18C and windy", **extra: object) -> dict:
    return {"role": "tool", "tool_call_id": id_, "content": content, **extra}


def row(*messages: dict, **extra: object) -> dict:
    return {**extra, "messages": list(messages)}


SEED_TOOL_ROW = row(sys_(), user(), calling(), tool(name="get_weather"), assistant(), tools=[WEATHER_TOOL])


def write(path: Path, *rows: object) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def problems_of(path: Path, **kwargs) -> list[Problem]:
    with pytest.raises(FormatError) as info:
        read_chat(path, **kwargs)
    return list(info.value.problems)


def only_problem(tmp_path: Path, record: object, **kwargs) -> Problem:
    (problem,) = problems_of(write(tmp_path / "bad.jsonl", record), **kwargs)
    return problem


def reads(tmp_path: Path, *records: object, **kwargs) -> list:
    return read_chat(write(tmp_path / "good.jsonl", *records), **kwargs)


# -- the seed's own examples ------------------------------------------------------------------------


def test_seed_rows_read(tmp_path, make_png):
    make_png("images/invoice-1042.png")
    invoice = row(
        {"role": "system", "content": "Extract the invoice total as JSON."},
        user(
            [
                {"type": "text", "text": "Read this invoice."},
                {"type": "image", "path": "images/invoice-1042.png"},
            ]
        ),
        assistant('{"total":1290}'),
    )
    plain, tooled, image = reads(tmp_path, row(sys_(), user(), assistant()), SEED_TOOL_ROW, invoice)
    assert (
        plain.line == 1
        and plain.tools == ()
        and [m.role for m in plain.messages]
        == [
            "system",
            "user",
            "assistant",
        ]
    )
    assert tooled.tools == (WEATHER_TOOL,)
    assert tooled.messages[2] == ChatMessage(
        "assistant", "", (ToolCall("call_1", "get_weather", {"city": "Wellington"}, "object"),)
    )
    assert tooled.messages[3] == ChatMessage("tool", "18C and windy", (), "call_1", "get_weather")
    assert image.messages[1].content == (
        TextPart("Read this invoice."),
        ImagePart((tmp_path / "images/invoice-1042.png").resolve(), "images/invoice-1042.png"),
    )


def test_system_message_is_optional(tmp_path):
    (rec,) = reads(tmp_path, row(user(), assistant()))
    assert [m.role for m in rec.messages] == ["user", "assistant"]


# -- the nine refusals, each with a row that passes -----------------------------------------------


def test_refuses_a_row_not_ending_with_an_assistant_message(tmp_path):
    reads(tmp_path, row(user(), assistant(), user("and tomorrow?"), assistant("Rain.")))
    problem = only_problem(tmp_path, row(user(), assistant(), user("and tomorrow?")))
    assert (problem.line, problem.field) == (1, "messages")
    assert problem.message == "the row ends with a user message; a row ends with an assistant message"


@pytest.mark.parametrize(
    ("messages", "missing"),
    [([sys_(), assistant()], "no user message"), ([sys_(), user()], "no assistant message")],
)
def test_refuses_a_row_without_user_or_assistant(tmp_path, messages, missing):
    reads(tmp_path, row(sys_(), user(), assistant()))
    problem = only_problem(tmp_path, row(*messages))
    assert (problem.line, problem.field) == (1, "messages")
    assert problem.message == f"{missing}; a row needs a user and an assistant message"


def test_a_row_with_neither_names_both(tmp_path):
    problem = only_problem(tmp_path, row(sys_()))
    assert problem.message.startswith("no user and no assistant message;")


@pytest.mark.parametrize("role", ["bot", "developer", "function", "Assistant", None, 3])
def test_refuses_a_role_other_than_the_four(tmp_path, role):
    for good in ("system", "user", "assistant", "tool"):
        assert good in {m.role for m in reads(tmp_path, SEED_TOOL_ROW)[0].messages}
    problem = only_problem(tmp_path, row(user(), {"role": role, "content": "x"}, assistant()))
    assert (problem.line, problem.field) == (1, "messages[1].role")
    assert problem.message.endswith("is not a role; roles are system, user, assistant, tool")


def test_refuses_a_system_message_not_at_the_head(tmp_path):
    reads(tmp_path, row(sys_(), user(), assistant()))
    problem = only_problem(tmp_path, row(user(), sys_(), assistant()))
    assert (problem.field, problem.message) == (
        "messages[1].role",
        "a system message must be the first message of the row",
    )
    problems = problems_of(write(tmp_path / "two.jsonl", row(sys_(), sys_("again"), user(), assistant())))
    assert [p.field for p in problems] == ["messages[1].role"]


@pytest.mark.parametrize(
    "messages",
    [
        [user(), tool(), assistant()],  # no assistant message before it at all
        [user(), assistant("Let me look."), tool(), assistant()],  # an assistant message without calls
        [user(), calling(), tool(), user("and?"), tool(), assistant()],  # the run of tool messages ended
    ],
)
def test_refuses_a_tool_message_following_no_calling_assistant(tmp_path, messages):
    reads(tmp_path, SEED_TOOL_ROW)
    problems = problems_of(write(tmp_path / "bad.jsonl", row(*messages)))
    assert [(p.field, p.message) for p in problems] == [
        (
            f"messages[{len(messages) - 2}]",
            "a tool message must follow an assistant message carrying tool_calls",
        )
    ]


def test_refuses_a_tool_call_id_the_preceding_assistant_did_not_call(tmp_path):
    reads(tmp_path, row(user(), calling(call("a"), call("b")), tool("b"), tool("a"), assistant()))
    problems = problems_of(write(tmp_path / "bad.jsonl", row(user(), calling(), tool("call_2"), assistant())))
    assert [(p.field, p.message) for p in problems] == [
        (
            "messages[2].tool_call_id",
            '"call_2" was not called by the preceding assistant message messages[1] (it called "call_1")',
        ),
        (
            "messages[1].tool_calls[0]",
            'call "call_1" ("get_weather") is answered by no following tool message',
        ),
    ]


def test_an_id_called_by_an_earlier_assistant_message_does_not_count(tmp_path):
    rec = row(user(), calling(call("a")), tool("a"), calling(call("b")), tool("a"), tool("b"), assistant())
    problems = problems_of(write(tmp_path / "bad.jsonl", rec))
    assert [p.field for p in problems] == ["messages[4].tool_call_id"]


@pytest.mark.parametrize(
    "messages",
    [
        [user(), calling(call("a"), call("b")), tool("a"), assistant()],  # one of two answered
        [user(), calling(call("b")), user("never mind"), assistant()],  # a user message instead
        [user(), calling(call("b"))],  # the row ends with the call
    ],
)
def test_refuses_a_tool_call_no_following_tool_message_answers(tmp_path, messages):
    reads(tmp_path, row(user(), calling(call("a"), call("b")), tool("a"), tool("b"), assistant()))
    (problem,) = problems_of(write(tmp_path / "bad.jsonl", row(*messages)))
    k = 1 if len(messages[1]["tool_calls"]) == 2 else 0
    assert (problem.field, problem.message) == (
        f"messages[1].tool_calls[{k}]",
        'call "b" ("get_weather") is answered by no following tool message',
    )


@pytest.mark.parametrize("content", ["Let me check.", " ", [{"type": "text", "text": "Let me check."}]])
def test_refuses_an_assistant_message_with_tool_calls_and_text(tmp_path, content):
    # The seed's fix: the text in its own assistant message before the call.
    reads(tmp_path, row(user(), assistant("Let me check."), calling(), tool(), assistant()))
    problem = only_problem(
        tmp_path, row(user(), assistant(content, tool_calls=[call()]), tool(), assistant())
    )
    assert problem.field == "messages[1].content"
    assert "carrying tool_calls also has text" in problem.message
    assert problem.message.endswith("put it in a separate assistant message before the call")


@pytest.mark.parametrize("content", ["", None, [{"type": "text", "text": ""}]])
def test_tool_calls_with_empty_or_null_content_pass(tmp_path, content):
    msg = (
        {"role": "assistant", "tool_calls": [call()]}
        if content is None
        else assistant(content, tool_calls=[call()])
    )
    (rec,) = reads(tmp_path, row(user(), msg, tool(), assistant()))
    assert rec.messages[1].tool_calls[0].id == "call_1"


@pytest.mark.parametrize("role", ["system", "assistant", "tool"])
def test_refuses_an_image_part_outside_a_user_message(tmp_path, make_png, role):
    make_png("a.png")
    image = [{"type": "image", "path": "a.png"}]
    reads(tmp_path, row(user(image), assistant()))
    messages = {
        "system": [{"role": "system", "content": image}, user(), assistant()],
        "assistant": [user(), assistant(image)],
        "tool": [user(), calling(), tool(content=image), assistant()],
    }[role]
    if role == "tool":
        messages[2]["content"] = image
    position = {"system": 0, "assistant": 1, "tool": 2}[role]
    problem = only_problem(tmp_path, row(*messages))
    assert (problem.field, problem.message) == (
        f"messages[{position}].content[0]",
        f"an image part in {'an' if role == 'assistant' else 'a'} {role} message; only user messages carry images",
    )


# -- shapes -----------------------------------------------------------------------------------------


def test_arguments_keep_their_order_and_form(tmp_path):
    as_object = call("a", arguments={"zeta": 1, "alpha": {"y": 2, "b": 3}, "mid": [1]})
    text = '{"zeta": 1,  "alpha": {"y": 2, "b": 3}}'
    as_string = call("b", arguments=text)
    (rec,) = reads(tmp_path, row(user(), calling(as_object, as_string), tool("a"), tool("b"), assistant()))
    first, second = rec.messages[1].tool_calls
    assert list(first.arguments) == ["zeta", "alpha", "mid"] and list(first.arguments["alpha"]) == ["y", "b"]
    assert (first.arguments_form, first.arguments_json) == ("object", None)
    assert list(second.arguments) == ["zeta", "alpha"]
    assert (second.arguments_form, second.arguments_json) == ("string", text)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ("", "a string that is not JSON"),
        ("{'city': 'x'}", "a string that is not JSON"),
        ('{"a": 1, "a": 2}', "duplicate key"),
        ("[1, 2]", "must be a JSON object, or a string holding one"),
        (["city"], "must be a JSON object, or a string holding one"),
        (None, "must be a JSON object, or a string holding one"),
    ],
)
def test_refuses_bad_arguments(tmp_path, arguments, message):
    bad = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    problem = only_problem(tmp_path, row(user(), calling(bad), tool(), assistant()))
    assert problem.field == "messages[1].tool_calls[0].function.arguments"
    assert message in problem.message


@pytest.mark.parametrize(
    ("bad_call", "field"),
    [
        ({"id": "call_1", "function": {"name": "f", "arguments": {}}}, "messages[1].tool_calls[0]"),
        ({**call(), "type": "code"}, "messages[1].tool_calls[0]"),
        ({**call(), "index": 0}, "messages[1].tool_calls[0]"),
        ({**call(), "function": {"name": "f"}}, "messages[1].tool_calls[0].function"),
        ({**call(), "id": ""}, "messages[1].tool_calls[0].id"),
        (call(name=""), "messages[1].tool_calls[0].function.name"),
        ("call_1", "messages[1].tool_calls[0]"),
    ],
)
def test_refuses_a_misshapen_tool_call(tmp_path, bad_call, field):
    problem = only_problem(tmp_path, row(user(), assistant("", tool_calls=[bad_call]), tool(), assistant()))
    assert problem.field == field


def test_refuses_empty_tool_calls_and_repeated_ids(tmp_path):
    path = write(
        tmp_path / "bad.jsonl",
        row(user(), assistant("", tool_calls=[]), assistant()),
        row(user(), calling(call("a"), call("a")), tool("a"), assistant()),
        row(user(), calling(), tool(), tool(), assistant()),
    )
    assert [(p.line, p.field, p.message) for p in problems_of(path)] == [
        (1, "messages[1].tool_calls", "must be a non-empty list; leave tool_calls out for no calls"),
        (2, "messages[1].tool_calls[1].id", '"a" names two calls of this message'),
        (3, "messages[3].tool_call_id", '"call_1" is answered twice'),
    ]


def test_tool_message_shape(tmp_path):
    path = write(
        tmp_path / "bad.jsonl",
        row(user(), calling(), {"role": "tool", "content": "18C"}, assistant()),
        row(user(), calling(), tool(name="get_time"), assistant()),
        row(user(), assistant(), {**tool(), "tool_calls": [call()]}, assistant()),
        row({**user(), "tool_call_id": "x"}, assistant()),
    )
    assert [(p.line, p.field) for p in problems_of(path)] == [
        (1, "messages[2].tool_call_id"),
        (2, "messages[2].name"),
        (3, "messages[2].tool_calls"),
        (4, "messages[0].tool_call_id"),
    ]


def test_tools_declarations(tmp_path):
    reads(tmp_path, row(user(), calling(call(name="lookup")), tool(), assistant()))  # no tools: any name
    reads(tmp_path, row(user(), assistant(), tools=[]))
    no_params = {"type": "function", "function": {"name": "now"}}
    reads(tmp_path, row(user(), assistant(), tools=[no_params]))
    path = write(
        tmp_path / "bad.jsonl",
        row(user(), assistant(), tools={"get_weather": {}}),
        row(user(), assistant(), tools=[{"type": "function", "name": "get_weather"}]),
        row(user(), assistant(), tools=[WEATHER_TOOL, WEATHER_TOOL]),
        row(
            user(),
            assistant(),
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
        ),
        row(
            user(),
            assistant(),
            tools=[{"type": "function", "function": {"name": "f", "parameters": "object"}}],
        ),
        row(user(), assistant(), tools=[{"type": "function", "function": {"name": "f", "strict": True}}]),
        row(user(), calling(call(name="get_time")), tool(), assistant(), tools=[WEATHER_TOOL]),
    )
    assert [(p.line, p.field) for p in problems_of(path)] == [
        (1, "tools"),
        (2, "tools[0]"),
        (3, "tools[1].function.name"),
        (4, "tools[0].function.parameters"),
        (5, "tools[0].function.parameters"),
        (6, "tools[0].function.strict"),
        (7, "messages[1].tool_calls[0].function.name"),
    ]


def test_tool_schemas_are_checked_once_each_and_deep_ones_are_a_problem(tmp_path):
    """The meta-schema check is cached by schema text; one too deep for jsonschema is a problem, not a crash."""
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    deep: dict = {"type": "object"}
    for _ in range(120):
        deep = {"type": "object", "properties": {"a": deep}}
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    path = write(tmp_path / "bad.jsonl", *[row(user(), assistant(), tools=[bad])] * 3,
                 row(user(), assistant(), tools=[deep_tool]))
    found = problems_of(path)
    assert [(p.line, p.field) for p in found] == [(n, "tools[0].function.parameters") for n in (1, 2, 3, 4)]
    assert found[0].message == found[2].message and "not a valid JSON Schema" in found[0].message
    assert "nested too deeply" in found[3].message


def test_record_and_message_shapes(tmp_path):
    path = write(
        tmp_path / "bad.jsonl",
        "[1, 2]",
        row(user(), assistant(), id="r1"),
        {"messages": []},
        {"conversations": []},
        row(user(None), assistant()),
        row(user([]), assistant()),
        row(user([{"type": "audio", "path": "a.wav"}]), assistant()),
        row(user([{"type": "text", "text": "x", "lang": "en"}]), assistant()),
        row(user(), assistant(None)),
        row("hello", assistant()),
        row({**user(), "name": ""}, assistant()),
        "{not json",
    )
    assert [(p.line, p.field) for p in problems_of(path)] == [
        (1, "record"),
        (2, "id"),
        (3, "messages"),
        (4, "conversations"),
        (4, "messages"),
        (5, "messages[0].content"),
        (6, "messages[0].content"),
        (7, "messages[0].content[0]"),
        (8, "messages[0].content[0].lang"),
        (9, "messages[1].content"),
        (10, "messages[0]"),
        (11, "messages[0].name"),
        (12, "record"),
    ]


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert [p.field for p in problems_of(tmp_path / "empty.jsonl")] == ["file"]
    assert [p.message for p in problems_of(tmp_path / "none.jsonl")] == ["no such file"]


# -- images -----------------------------------------------------------------------------------------


def image_row(path: str) -> dict:
    return row(
        user([{"type": "image", "path": path}, {"type": "text", "text": "What is this?"}]), assistant()
    )


def test_image_paths_are_relative_to_the_jsonl(tmp_path, make_png, monkeypatch):
    make_png("data/images/a.png")
    (tmp_path / "data").mkdir(exist_ok=True)
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    (rec,) = read_chat(write(tmp_path / "data" / "x.jsonl", image_row("images/a.png")))
    assert rec.messages[0].content[0] == ImagePart((tmp_path / "data/images/a.png").resolve(), "images/a.png")


def test_missing_image_is_refused_unless_media_checks_are_off(tmp_path):
    problem = only_problem(tmp_path, image_row("images/gone.png"))
    assert problem.field == "messages[0].content[0].path"
    assert problem.message.startswith("file not found: ")
    (rec,) = reads(tmp_path, image_row("images/gone.png"), check_media=False)
    assert rec.messages[0].content[0].written == "images/gone.png"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("https://example.com/a.png", "is a URL; images are local files"),
        ("s3://bucket/a.png", "is a URL; images are local files"),
        ("/abs/a.png", "is absolute; seed 003 writes image paths relative to the JSONL file"),
        ("C:\\imgs\\a.png", "is absolute; seed 003 writes image paths relative to the JSONL file"),
        ("", "required: a path relative to the JSONL file"),
    ],
)
def test_refuses_urls_and_absolute_image_paths(tmp_path, path, message):
    problem = only_problem(tmp_path, image_row(path), check_media=False)
    assert problem.field == "messages[0].content[0].path"
    assert problem.message.endswith(message)


def test_an_image_path_naming_a_folder_is_refused(tmp_path):
    (tmp_path / "images").mkdir()
    assert only_problem(tmp_path, image_row("images")).message.startswith("not a file: ")


# -- diagnostics ------------------------------------------------------------------------------------


def test_diagnostics_count_multi_turn_rows_tool_calls_and_declared_tools(tmp_path):
    records = reads(
        tmp_path,
        row(user(), assistant()),
        row(user(), assistant(), user("more?"), assistant()),  # multi-turn
        SEED_TOOL_ROW,  # multi-turn (two assistant messages), one call, declares tools
        row(user(), calling(call("a"), call("b")), tool("a"), tool("b"), assistant(), tools=[WEATHER_TOOL]),
        row(user(), assistant(), tools=[]),  # an empty list declares nothing
    )
    found = chat_diagnostics(records)
    assert found == ChatDiagnostics(rows=5, multi_turn_rows=3, tool_calls=3, rows_declaring_tools=2)
    assert found.summary() == "3 multi-turn, 3 tool calls, 2 rows declaring tools"
    assert chat_diagnostics([]) == ChatDiagnostics(0, 0, 0, 0)


def test_problems_of_many_lines_come_in_line_order(tmp_path):
    path = write(tmp_path / "bad.jsonl", row(user()), row(user(), assistant()), "{", row(assistant()))
    assert [p.line for p in problems_of(path)] == [1, 3, 4]


# -- the bad-input corpus: each file with the exact problem lines it must give -----------------------

BAD_INPUTS = Path(__file__).parent / "bad_inputs" / "chat"
EXPECTED = json.loads((BAD_INPUTS / "expected.json").read_text(encoding="utf-8"))


def test_bad_input_corpus_lists_every_file():
    assert sorted(EXPECTED) == sorted(p.name for p in BAD_INPUTS.glob("*.jsonl"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input(name, monkeypatch):
    monkeypatch.chdir(BAD_INPUTS)  # problems name the path as given: the bare file name
    with pytest.raises(FormatError) as info:
        read_chat(Path(name))
    assert [str(p) for p in info.value.problems] == EXPECTED[name]


def test_validate_cli_prints_the_diagnostics(tmp_path, capsys, monkeypatch):
    from data_pipeline.validate import main

    monkeypatch.chdir(tmp_path)
    write(tmp_path / "good.jsonl", row(user(), assistant()), SEED_TOOL_ROW)
    write(tmp_path / "bad.jsonl", row(user(), calling()))
    assert main(["--format=chat", "good.jsonl"]) == 0
    assert capsys.readouterr().out == (
        "good.jsonl: 2 records OK; 1 multi-turn, 1 tool calls, 1 rows declaring tools\n"
    )
    assert main(["--format=chat", "good.jsonl", "bad.jsonl"]) == 1
    captured = capsys.readouterr()
    assert captured.err == (
        'bad.jsonl:1: messages[1].tool_calls[0]: call "call_1" ("get_weather") is answered by no '
        "following tool message\n"
    )
