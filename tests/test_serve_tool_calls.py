"""Issue 54, failure 3: served tool calls in OpenAI's shapes (`serving.tool_calls`).

The split is fed as the server feeds it: the text of a real tokenizer's tokens, one token at a time
through `detokenize.IncrementalText` (the smoke ChatML tokenizer, byte-level BPE like Qwen2.5's, and a
byte-level tokenizer with Llama 3's control tokens), and the stream's deltas are assembled the way the
`openai` client does (arguments concatenated per `index`). The stream must agree with the non-streamed
message, carry no markup in `content`, and give `function.arguments` as a JSON string."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.test_render_chat import llama_tokenizer
from valen_jax.serving.detokenize import IncrementalText
from valen_jax.serving.tool_calls import ToolCallSplit, split_message

SMOKE_TOKENIZER = Path(__file__).resolve().parents[1] / "data/tokenizer"

QWEN_TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
                  '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}\n</tool_call>')
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Wellington"}}'


@pytest.fixture(scope="module")
def chatml():
    return AutoTokenizer.from_pretrained(str(SMOKE_TOKENIZER))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(llama_tokenizer(tmp_path_factory.mktemp("llama"))))


def streamed(tokenizer, text: str, family: str) -> list[dict]:
    """The deltas the server streams for `text` generated token by token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, split, deltas = IncrementalText(tokenizer), ToolCallSplit(family), []
    for n in range(1, len(ids) + 1):
        deltas += split.feed(pieces.add(ids[:n]))
    return deltas + split.feed(pieces.finish(ids), final=True)


def assembled(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What the openai client's stream accumulation makes of the deltas: content, and calls by index."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
            call["id"] = piece.get("id") or call["id"]
            call["type"] = piece.get("type") or call["type"]
            call["function"]["name"] += piece["function"].get("name") or ""
            call["function"]["arguments"] += piece["function"].get("arguments") or ""
    return content, [calls[k] for k in sorted(calls)]


def without_ids(calls: list[dict]) -> list[dict]:
    return [{k: v for k, v in call.items() if k != "id"} for call in calls]


def test_qwen_calls_stream_as_tool_call_deltas_without_markup(chatml):
    deltas = streamed(chatml, QWEN_TWO_CALLS, "chatml")
    assert all("<tool_call>" not in d.get("content", "") and "</" not in d.get("content", "") for d in deltas)
    content, calls = assembled(deltas)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert all(isinstance(c["function"]["arguments"], str) and c["type"] == "function" for c in calls)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo", "unit": "C"},
                                                                        {"zone": "Europe/Oslo"}]
    assert list(json.loads(calls[0]["function"]["arguments"])) == ["city", "unit"]  # the model's key order
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    # The non-streamed message is the same split.
    whole, whole_calls = split_message(QWEN_TWO_CALLS, "chatml")
    assert whole == content and without_ids(whole_calls) == without_ids(calls)


def test_qwen_calls_only_give_null_content(chatml):
    text = QWEN_TWO_CALLS[len("Let me look.\n"):]
    assert assembled(streamed(chatml, text, "chatml"))[0] == ""
    content, calls = split_message(text, "chatml")
    assert content is None and len(calls) == 2


def test_llama3_call_is_the_whole_message(llama):
    deltas = streamed(llama, LLAMA_CALL, "llama3")
    content, calls = assembled(deltas)
    assert content == "" and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Wellington"}
    whole, whole_calls = split_message(LLAMA_CALL, "llama3")
    assert whole is None and without_ids(whole_calls) == without_ids(calls)


@pytest.mark.parametrize(("text", "family"), [
    ("It is windy in Wellington.", "chatml"),
    ("It is windy in Wellington.", "llama3"),
    ("A <tool_call> that never closes", "chatml"),  # finish_reason length mid-call: text, not a call
    ('<tool_call>\n{"name": broken}\n</tool_call> and text', "chatml"),  # not JSON: text, markup and all
    ("ends with <tool_ca", "chatml"),  # held back as a possible opening, then sent at the end
    ("{not a call}", "llama3"),
    ("  spaced text  ", "chatml"),
])
def test_text_that_is_not_a_call_is_content_exactly(chatml, llama, text, family):
    tokenizer = llama if family == "llama3" else chatml
    deltas = streamed(tokenizer, text, family)
    assert assembled(deltas) == (text, [])
    assert split_message(text, family) == (text, [])
