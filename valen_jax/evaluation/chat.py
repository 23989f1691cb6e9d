"""Chat (seed 003) and vakforge (seed 002) evaluation: assistant-token loss and accuracy by teacher
forcing, and exact match of tool calls by greedy decoding (formulas in `valen_jax.evaluation.metrics.chat`),
overall and by `locale` and source (vakforge `meta.source`; chat rows have neither: `(missing)`).

Tool calls: every trained assistant message that holds tool calls (the Example meta `tool_calls`,
one list per assistant message) is decoded greedily from the conversation before it, reference
messages included (teacher forcing of the context), and the calls are read back from the rendering
the template taught: ChatML writes each call as `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`;
Llama-3 writes the whole message as one `{"name": …, "parameters": …}` object. A call block that is
not such JSON is a malformed call (it matches nothing). When the converter trained only the last
assistant turn (`assistant_turns="last"`), only that message is decoded.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline.chat_templates import template_family
from data_pipeline.shards import Example
from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.data.assemble import expand_media_slots
from valen_jax.evaluation import hosts, tokens
from valen_jax.evaluation.metrics import shown
from valen_jax.evaluation.metrics.chat import ChatStats
from valen_jax.evaluation.workdir import Restored, local_batch_size

if TYPE_CHECKING:
    from valen_jax.evaluation.registry import Options

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def parse_tool_calls(text: str, family: str | None = "chatml") -> list:
    """The calls a generated assistant message makes: dicts, or the raw text of an unreadable call."""
    if family == "llama3":
        stripped = text.strip()
        if not stripped.startswith("{"):
            return []
        try:
            body = json.loads(stripped)
        except ValueError:
            return [stripped]
        if isinstance(body, dict) and "parameters" in body:
            body = {"name": body.get("name"), "arguments": body["parameters"]}
        return [body]
    calls: list = []
    for match in _CALL.finditer(text):
        try:
            calls.append(json.loads(match.group(1)))
        except ValueError:
            calls.append(match.group(1))
    tail = text[text.rfind(_CLOSE) + len(_CLOSE):] if calls else text
    if _OPEN in tail:  # an opened call that generation never closed
        calls.append(tail[tail.index(_OPEN):])
    return calls


def breakdown_of(example: Example) -> dict[str, str | None]:
    meta = contract.meta_of(example)
    return {"locale": meta.locale, "source": meta.data_source}


def _tool_call_prompts(example: Example, spec, eot: int) -> list[tuple[list, dict]]:
    """(reference calls, prompt) for each trained assistant message with tool calls."""
    per_message = contract.meta_of(example).tool_calls or []
    expanded = expand_media_slots(example, spec)
    spans = tokens.answer_spans(expanded.ids, expanded.weights, eot)
    if len(spans) == len(per_message):
        pairs = list(zip(per_message, spans, strict=True))
    elif per_message and spans:  # only the last assistant turn was trained
        pairs = [(per_message[-1], spans[-1])]
    else:
        pairs = []
    return [(calls, tokens.prompt_before(expanded, start, spec, contract.where(example)))
            for calls, (start, _) in pairs if calls]


def evaluate(restored: Restored, examples: list[Example], options: Options) -> dict:
    """The report's chat/vakforge part; `options.samples` decoded tool-call messages are listed."""
    tokenizer, spec, mesh = restored.tokenizer, restored.spec, restored.mesh
    max_new_tokens, samples = options.max_new_tokens, options.samples
    mine = hosts.local_indices(len(examples))
    local = [examples[i] for i in mine]
    local_batch = local_batch_size(options.batch_size, mesh)
    batches = hosts.batch_count(len(examples), local_batch)
    stats = ChatStats()
    sums = tokens.token_sums(restored.params, restored.graphdef, local, spec, mesh, local_batch, batches)
    for example, (nll, correct, weight) in zip(local, sums, strict=True):
        stats.add_tokens(float(nll), float(min(correct, weight)), float(weight), breakdown_of(example))

    eot = end_of_turn_id(tokenizer)
    family = template_family(tokenizer.chat_template)
    jobs = [(i, example, calls, prompt) for i, example in zip(mine, local, strict=True)
            for calls, prompt in _tool_call_prompts(example, spec, eot)]
    # Every process decodes the same number of batches, however many tool-call messages it holds.
    counts = hosts.gather_json(len(jobs))
    decode_batches = -(-max(counts) // local_batch) if max(counts) else 0
    generated = tokens.greedy(restored.params, restored.graphdef, [p for *_, p in jobs], spec, mesh,
                                   local_batch, decode_batches, max_new_tokens, eot, len(tokenizer))
    listed = []
    for (i, example, calls, _), ids in zip(jobs, generated, strict=True):
        text = tokens.decode(tokenizer, ids, eot)
        predicted = parse_tool_calls(text, family)
        stats.add_tool_calls(calls, predicted, breakdown_of(example))
        if samples is None or len(listed) < samples:
            listed.append({"index": i, "source": contract.where(example),
                           "reference": calls, "answer": text})
    metrics = hosts.sum_stats(stats).report()
    overall = metrics["overall"]
    listed = sorted((s for part in hosts.gather_json(listed) for s in part), key=lambda s: s["index"])
    return {"target_tokens": int(overall["tokens"]), "loss": overall["token_loss"],
            "accuracy": overall["token_accuracy"], "tool_call_exact_match": overall["exact_match"],
            "generation": {"tool_call_messages": overall["messages"], "max_new_tokens": int(max_new_tokens)},
            "metrics": metrics, "samples": listed[:samples] if samples is not None else listed}


def summary(report: dict) -> str:
    return (f"loss {shown(report['loss'])}, accuracy {shown(report['accuracy'])}, "
            f"tool-call exact match {shown(report['tool_call_exact_match'])}")
