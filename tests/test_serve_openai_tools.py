"""Issue 54, failure 3: the `openai` client's tool-calling loop against a real server on 127.0.0.1.

The smoke chat workdir (ChatML, Qwen2.5's call markup) is served for real (FastAPI, uvicorn, the route,
the detokeniser, the tool-call split); only its decode engine is `tests.serve_server.ScriptedEngine`,
which answers with the markup a model trained on tool calls writes (a 4-step tiny model writes none).
Non-streamed, `function.arguments` must be a JSON string (`json.loads` in client code), `content` null,
`finish_reason` "tool_calls"; streamed, the client's stream helper must assemble the same calls, and no
chunk's `content` may hold markup. The loop sends the tool's result back with the assistant turn as the
client returned it, and the template must render that turn's arguments as the object the model wrote.
Chat log-probabilities (`logprobs`, `top_logprobs`) are checked here too, on a scripted text answer:
scored by the real model (an offline forward agrees within 1e-4), streamed and not alike."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from tests.serve_server import ScriptedEngine, Served
from tests.smoke_workdirs import smoke_workdir
from tests.test_serve_logprobs import offline

CALLS = ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "time", "arguments": {"zone": "CET"}}\n</tool_call>')
ANSWER = "2C at noon."
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
         for name in ("weather", "time")]
BUDGET = 100  # the scripted calls fit (a finish reason "length" would be a failure) in the 512-token context
QUESTION = [{"role": "user", "content": "Oslo?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    workdir = smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")
    served = Served(workdir, slots=2, max_queue=8)
    service = served.service
    service.engine.stop()
    tokenizer = service.tokenizer
    # A trained model calls the tools, then answers from their results (a question about Wellington at once).
    service.engine = ScriptedEngine(service, lambda request: ANSWER if any(
        cue in tokenizer.decode(request.ids) for cue in ("<tool_response>", "Wellington?")) else CALLS)
    yield served
    served.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


def test_non_streamed_calls_have_string_arguments(served, client):
    answer = client.chat.completions.create(model=served.service.name, messages=QUESTION, tools=TOOLS, max_tokens=BUDGET)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["weather", "time"]
    assert all(isinstance(c.function.arguments, str) and c.type == "function" for c in calls)
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo", "unit": "C"}
    assert json.loads(calls[1].function.arguments) == {"zone": "CET"}
    assert len({c.id for c in calls}) == 2


def test_streamed_calls_equal_non_streamed(served, client):
    model = served.service.name
    plain = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=BUDGET).choices[0]
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=BUDGET, stream=True))
    assert not any("tool_call" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or ())]
    assert [d.index for d in deltas] == [0, 1] and all(d.id and d.type == "function" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(model=model, messages=QUESTION, tools=TOOLS, max_tokens=BUDGET) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content

    def shape(calls):
        return [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert shape(final.message.tool_calls) == shape(plain.message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calling_loop(served, client, stream):
    model, messages = served.service.name, list(QUESTION)
    if stream:
        with client.chat.completions.stream(model=model, messages=messages, tools=TOOLS, max_tokens=BUDGET) as events:
            message = events.get_final_completion().choices[0].message
    else:
        message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=BUDGET).choices[0].message
    results = {"weather": lambda city, unit: f"2{unit} in {city}", "time": lambda zone: f"12:00 {zone}"}
    messages.append(message.model_dump(exclude_none=True))  # the assistant turn as the client holds it
    for call in message.tool_calls:
        result = results[call.function.name](**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    engine = served.service.engine
    seen = len(engine.prompts)
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8).choices[0]
    assert final.finish_reason == "stop" and final.message.content == ANSWER and not final.message.tool_calls
    # The assistant turn sent back (arguments as strings) rendered as the model wrote it, results included.
    prompt = served.service.tokenizer.decode(engine.prompts[seen])
    assert CALLS + "<|im_end|>" in prompt, prompt
    assert "<tool_response>\n2C in Oslo\n</tool_response>" in prompt


def test_chat_logprobs_stream_and_not(served, client):
    ask = dict(model=served.service.name, messages=[{"role": "user", "content": "Wellington?"}], max_tokens=BUDGET,
               logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**ask).choices[0]
    entries = plain.logprobs.content
    assert plain.message.content == ANSWER == "".join(e.token for e in entries)  # the end of turn is not content
    assert b"".join(bytes(e.bytes) for e in entries).decode() == ANSWER
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)
    tokenizer = served.service.tokenizer
    prompt, answer = served.service.engine.prompts[-1], tokenizer.encode(ANSWER, add_special_tokens=False)
    want = offline(served, prompt + answer)[len(prompt) - 1:]
    np.testing.assert_allclose([e.logprob for e in entries], want[np.arange(len(answer)), answer], atol=1e-4)
    np.testing.assert_allclose([[t.logprob for t in e.top_logprobs] for e in entries],
                               -np.sort(-want, axis=-1)[:, :2], atol=1e-4)
    chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    streamed = [e for c in chunks if c.logprobs is not None for e in c.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    refused = client.chat.completions.with_raw_response
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        refused.create(**dict(ask, logprobs=False))
