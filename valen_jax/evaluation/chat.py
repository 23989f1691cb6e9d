"""Chat (seed 003) and vakforge (seed 002) evaluation: assistant-token loss and accuracy by teacher
forcing; by greedy decoding, exact match of tool calls, the comparison of each answer with its
reference assistant message, and (vakforge) entity accuracy (formulas in
`valen_jax.evaluation.metrics.chat` and `.entities`), overall and by `locale` and source (vakforge
`meta.source`; chat rows have neither: `(missing)`), entities by type too.

Every trained assistant message is decoded once, greedily, from the conversation before it,
reference messages included (teacher forcing of the context); that one generation serves every
comparison of the message:
- a message with reference tool calls (the Example meta `tool_calls`, one list per assistant
  message) is compared by its calls, read back from the rendering the template taught: ChatML
  writes each call as `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`; Llama-3 writes
  the whole message as one `{"name": …, "parameters": …}` object. A call block that is not such JSON
  is a malformed call (it matches nothing). Such a message has no text (seed 003), so it is not an
  answer in the text comparison;
- a message with text is an answer: the generated text (end-of-turn token removed, special tokens
  kept) against the meta `answers` entry, exactly and normalised;
- the entities of an agent message (meta `entities` with that `answer` index) are looked for in the
  generated text and in the arguments of the calls parsed from it.
When the converter trained only the last assistant turn (`assistant_turns="last"`), only that
message is decoded; which message an answer is follows the example's policy (`prompts.messages_of`),
and an example whose trained answers fit neither policy is refused.

Shards converted before `answers` was recorded (an evaluation cache in WORKDIR/eval_shards, or a
shard directory) hold no reference text: their tool-call messages are still decoded and compared,
their answers and entities are not; the report counts those examples under
`skipped.examples_without_reference_answers`, and a warning says to reconvert.

Image reliance (`evaluation.image_reliance`, `image_reliance_report`): the messages of records with
images are decoded again with each record's images swapped for another's; the headline is the text
answers' exact match (the tool calls' exact match where the compared messages have no text answer).
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING

import numpy as np

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline.chat_templates import template_family
from data_pipeline.shards import Example
from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.evaluation import hosts, image_reliance, prompts, tokens
from valen_jax.evaluation.metrics import shown
from valen_jax.evaluation.metrics.chat import ChatStats
from valen_jax.evaluation.metrics.entities import EntityStats, Generated, entity_found
from valen_jax.evaluation.workdir import local_batch_size
from valen_jax.run import ModelRun

if TYPE_CHECKING:
    from valen_jax.evaluation.options import Options

log = logging.getLogger(__name__)
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


def answer_prompts(example: Example, spec, eot: int) -> list[tuple[int, dict]]:
    """(k, prompt) for each trained assistant message: `k` indexes the meta's per-message lists
    (`tool_calls`, `answers`; `prompts.messages_of`: by the example's `assistant_turns`), the prompt is
    every token before the message (`prompts.Prompts.prompt`)."""
    built = prompts.Prompts(example, 0, spec, eot)
    return [(ref.message, built.prompt(ref)) for ref in built.answers]


def _message_entities(example: Example) -> dict[int, list[dict]]:
    """The agent entities of each assistant message, by its index `k`."""
    by_message: dict[int, list[dict]] = {}
    for j, entity in enumerate(contract.meta_of(example).entities or ()):
        if "answer" not in entity:
            raise ValueError(f"{contract.where(example)}: meta entities[{j}] has no 'answer' although the "
                             "Example records answers; the shard was written by a mixed converter, reconvert it")
        if entity["answer"] is not None:
            by_message.setdefault(int(entity["answer"]), []).append(entity)
    return by_message


def _jobs(index: int, example: Example, spec, eot: int) -> list[tuple]:
    """(index, example, k, reference calls, reference text or None, entities, prompt) per decoded message."""
    meta = contract.meta_of(example)
    answers = meta.answers
    entities = _message_entities(example) if answers is not None else {}
    jobs = []
    for k, prompt in answer_prompts(example, spec, eot):
        calls = meta.tool_calls[k]
        if not calls and answers is None:
            continue  # older shards: no reference text to compare with (counted by the caller)
        jobs.append((index, example, k, calls, None if calls else answers[k], entities.get(k, []), prompt))
    return jobs


def evaluate(restored: ModelRun, examples: list[Example], options: Options) -> dict:
    """The report's chat/vakforge part; `options.samples` decoded messages are listed."""
    tokenizer, spec, mesh = restored.tokenizer, restored.spec, restored.mesh
    max_new_tokens, samples = options.max_new_tokens, options.samples
    mine = hosts.local_indices(len(examples))
    local = [examples[i] for i in mine]
    local_batch = local_batch_size(options.batch_size, mesh)
    batches = hosts.batch_count(len(examples), local_batch)
    stats, entity_stats = ChatStats(), EntityStats()
    sums = tokens.token_sums(restored.params, restored.graphdef, local, spec, mesh, local_batch, batches)
    for example, (nll, correct, weight) in zip(local, sums, strict=True):
        stats.add_tokens(float(nll), float(min(correct, weight)), float(weight), breakdown_of(example))

    eot = end_of_turn_id(tokenizer)
    family = template_family(tokenizer.chat_template)
    without_reference = sum(contract.meta_of(e).answers is None for e in local)
    jobs = [job for i, example in zip(mine, local, strict=True) for job in _jobs(i, example, spec, eot)]
    # Every process decodes the same number of batches, however many messages it holds.
    decode_batches = hosts.batches_for_local(len(jobs), local_batch)
    generated = tokens.greedy(restored.params, restored.graphdef, [job[-1] for job in jobs], spec, mesh,
                              local_batch, decode_batches, max_new_tokens, eot, len(tokenizer))
    listed = []
    for job, ids in zip(jobs, generated, strict=True):
        i, example, k, calls, reference, entities, _ = job
        text = tokens.decode(tokenizer, ids, eot)
        predicted = add_message(stats, job, ids, text, family, eot)
        breakdown = breakdown_of(example)
        finished = bool(ids) and ids[-1] == eot
        found = None
        if entities:
            answer = Generated.of(text, predicted)
            entity_stats.add_message(entities, answer, breakdown)
            found = [{"type": e["type"], "text": e["text"], "normalized": e.get("normalized"),
                      "found": entity_found(e, answer)} for e in entities]
        if samples is None or len(listed) < samples:
            listed.append({"index": i, "message": k, "source": contract.where(example),
                           "reference": calls or reference, "answer": text, "finished": finished,
                           **({"entities": found} if found is not None else {})})
    metrics = hosts.sum_stats(stats).report()
    entity_report = hosts.sum_stats(entity_stats).report()
    without_reference = int(hosts.sum_array(np.asarray([without_reference]))[0])
    if without_reference:
        log.warning("%d examples were converted before reference answers were recorded (meta `answers`): "
                    "their answers and entities are not scored; reconvert them (remove WORKDIR/eval_shards "
                    "for a JSONL file)", without_reference)
    overall = metrics["overall"]
    listed = sorted((s for part in hosts.gather_json(listed) for s in part), key=lambda s: (s["index"], s["message"]))
    reliance = image_reliance_report(restored, jobs, generated, options) if options.image_reliance else None
    return {"target_tokens": int(overall["tokens"]), "loss": overall["token_loss"],
            "accuracy": overall["token_accuracy"], "tool_call_exact_match": overall["exact_match"],
            "answer_exact_match": overall["answers"]["exact_match"],
            "answer_normalised_match": overall["answers"]["normalised_match"],
            "entity_accuracy": entity_report["overall"]["accuracy"],
            "generation": {"tool_call_messages": overall["messages"], "answer_messages": overall["answers"]["messages"],
                           "unfinished_answers": overall["answers"]["unfinished"],
                           "max_new_tokens": int(max_new_tokens)},
            "skipped": {"examples_without_reference_answers": without_reference},
            "metrics": metrics, "entities": entity_report,
            "samples": listed[:samples] if samples is not None else listed,
            **({"image_reliance": reliance} if reliance is not None else {})}


def add_message(stats: ChatStats, job: tuple, ids: list[int], text: str, family: str | None, eot: int) -> list:
    """One decoded message (`_jobs`' job, its ids and text) into `stats`; returns the calls it makes."""
    _, example, _, calls, reference, _, _ = job
    predicted = parse_tool_calls(text, family)
    if calls:
        stats.add_tool_calls(calls, predicted, breakdown_of(example))
    else:
        stats.add_answer(reference, text, bool(ids) and ids[-1] == eot, breakdown_of(example))
    return predicted


def _overall(restored: ModelRun, jobs: list[tuple], generated: list[list[int]], texts: list[str]) -> dict:
    """All processes' overall chat metrics of these decoded messages."""
    stats, family = ChatStats(), template_family(restored.tokenizer.chat_template)
    eot = end_of_turn_id(restored.tokenizer)
    for job, ids, text in zip(jobs, generated, texts, strict=True):
        add_message(stats, job, ids, text, family, eot)
    return hosts.sum_stats(stats).report()["overall"]


def headline(overall: dict) -> tuple[str, float | None]:
    """The compared messages' headline: exact match of the text answers, or of the tool calls when
    there are none (chosen by the references, the same for the real and the swapped answers)."""
    if overall["answers"]["messages"] or not overall["messages"]:
        return "answer_exact_match", overall["answers"]["exact_match"]
    return "tool_call_exact_match", overall["exact_match"]


def image_reliance_report(restored: ModelRun, jobs: list[tuple], generated: list[list[int]], options: Options
                          ) -> dict | None:
    """The report's `image_reliance` (`evaluation.image_reliance`) of this process's decoded messages.

    The swap is planned over records, not messages: every message of a record carries the record's
    whole media (`prompts.prompt_before`), so two messages of one record would only swap an image for
    itself. A compared record's messages whose prompts hold a media slot all take its donor's patches
    and are counted one answer each; a message that ends before its record's first image is left out."""
    seeing = [j for j, job in enumerate(jobs) if image_reliance.sees_media(job[-1]["ids"], restored.spec)]
    first: dict[int, int] = {}  # record index → its first message that sees media
    for j in seeing:
        first.setdefault(jobs[j][0], j)
    records = list(first)
    plan = image_reliance.plan_swaps([image_reliance.layout_of(jobs[first[r]][-1]["vision"]) for r in records])
    donor = {records[a]: jobs[first[records[b]]][-1]["vision"] for a, b in plan.donors.items()}
    donor_record = {records[a]: records[b] for a, b in plan.donors.items()}
    compared = [j for j in seeing if jobs[j][0] in donor]
    if sum(image_reliance.global_counts(len(compared), len(seeing) - len(compared))) == 0:
        return None
    prompts = [{**jobs[j][-1], "vision": image_reliance.with_patches(jobs[j][-1]["vision"], donor[jobs[j][0]])}
               for j in compared]
    swapped = image_reliance.greedy(restored, prompts, options)
    eot = end_of_turn_id(restored.tokenizer)
    real_ids = [generated[j] for j in compared]
    real_texts = [tokens.decode(restored.tokenizer, ids, eot) for ids in real_ids]
    swapped_texts = [tokens.decode(restored.tokenizer, ids, eot) for ids in swapped]
    compared_jobs = [jobs[j] for j in compared]
    metric, with_images = headline(_overall(restored, compared_jobs, real_ids, real_texts))
    _, swapped_images = headline(_overall(restored, compared_jobs, swapped, swapped_texts))
    differing, differing_changed = image_reliance.differing_changes(
        [_reference(job) for job in compared_jobs], _donor_references(jobs, seeing, compared, donor_record),
        real_texts, swapped_texts)
    return image_reliance.reliance(
        changed=sum(a != b for a, b in zip(real_texts, swapped_texts, strict=True)), compared=len(compared),
        unswappable=len(seeing) - len(compared), differing=differing, differing_changed=differing_changed,
        metric=metric, with_images=with_images, swapped_images=swapped_images)


def _reference(job: tuple) -> list | str:
    """A decoded message's reference as `add_message` compares it: its tool calls, else its text."""
    _, _, _, calls, reference, _, _ = job
    return calls or reference


def _donor_references(jobs: list[tuple], seeing: list[int], compared: list[int], donor_record: dict[int, int]
                      ) -> list[list | str | None]:
    """Per compared message, the reference of the donor record's message in its place: the n-th message that
    sees media of its record is paired with the donor's n-th (by message index, a record that opens with a
    text exchange would pair its image question with the donor's greeting); None where the donor has fewer."""
    by_record: dict[int, list[int]] = {}
    for j in seeing:
        by_record.setdefault(jobs[j][0], []).append(j)
    out = []
    for j in compared:
        record = jobs[j][0]
        theirs, place = by_record[donor_record[record]], by_record[record].index(j)
        out.append(_reference(jobs[theirs[place]]) if place < len(theirs) else None)
    return out


def summary(report: dict) -> str:
    """The CLI line; a report written before answers and entities were compared lacks those parts."""
    line = (f"loss {shown(report['loss'])}, accuracy {shown(report['accuracy'])}, "
            f"tool-call exact match {shown(report['tool_call_exact_match'])}")
    if "answer_exact_match" in report:
        line += (f", answer exact/normalised match {shown(report['answer_exact_match'])}/"
                 f"{shown(report['answer_normalised_match'])}")
    if report.get("entities", {}).get("overall", {}).get("entities"):
        line += f", entity accuracy {shown(report['entity_accuracy'])}"
    return line + image_reliance.summary(report)
