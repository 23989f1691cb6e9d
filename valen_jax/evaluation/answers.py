"""Generated answers for VFlash, chat and vakforge data: one answer line per trained assistant answer.

The prompt of an answer is every token before it, reference turns included (what evaluation decodes
from: `evaluation.prompts`), so a record with three trained assistant
messages gives three lines. Lines come in data order (record, then answer) and hold:

    {"index": 4, "source": "data/smoke/vflash/eval.jsonl:5", "id": null, "answer": 0,
     "text": "<ref>box</ref><objects><box><55><734><250><938></box></objects>",
     "finish_reason": "stop", "generated_tokens": 17, ...}

`index` is the record's 0-based position in the data, `source` its file and line, `id` the record's own
id (a VFlash record's `id`, a vakforge conversation's id; null where the record has none: chat rows have
no id), `answer` the k-th trained assistant answer of the record (chat
converted with assistant_turns=last trains only the last message: it is answer 0). `finish_reason` is
"stop" when the end-of-turn token ended the answer (counted in `generated_tokens`, not written in
`text`), "length" when the token budget did. Per family:
- vflash (seed 004): `primitives`, each {"kind", "label", "tokens", "coordinates", "units"} with the
  number tokens dequantised to the seed's ranges (`data_pipeline.primitives.coordinates`: fractions of the
  image, metres in the camera frame, ego metres and radians, dense metres for the data's scale `s`),
  `atomic_decoding` (each call's block_size, count and the primitives it covers) and `parse_error`
  (null, or why the text is not a primitive answer; the primitives are then empty);
- chat (seed 003) and vakforge (seed 002): `tool_calls`, read back as the template writes them
  (`evaluation.chat.parse_tool_calls`): dicts, or the raw text of an unreadable call.

Across processes the answers are split in contiguous blocks (`host_block`), so the k-th answer of the
data keeps its sampling stream whatever the number of processes (the engine draws answer j's tokens
from the stream of `first_index + j`), and the lines are gathered on every process in data order.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline.chat_templates import template_family
from data_pipeline.primitives import PrimitiveError, coordinates, parse_answer
from data_pipeline.shards import Example
from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.decoding.engine import generate_ids
from valen_jax.decoding.sampling import Sampling
from valen_jax.evaluation import hosts, prompts
from valen_jax.evaluation.chat import parse_tool_calls
from valen_jax.evaluation.workdir import local_batch_size
from valen_jax.run import ModelRun

GENERATED_FAMILIES = ("vflash", "chat", "vakforge")
GREEDY = Sampling()  # temperature 0: argmax, no draws
# What a dequantised waypoint's numbers are (seed 004, "Physical Primitives").
UNITS = {"point": "image fraction (x, y)", "box": "image fraction (x, y) per corner",
         "objects_none": "none", "drive": "ego frame: x m, y m, heading rad",
         "dense": "m, relative to the first query point"}


def _units(kind: str) -> str:
    if kind in UNITS:
        return UNITS[kind]
    return "image fraction (u, v)" if kind.endswith("_2d") else "camera frame m (x, y, z)"


def answer_counts(examples: list[Example], end_of_turn: int) -> list[int]:
    """Trained assistant answers per example (`prompts.answers`: from the shard ids, no media read)."""
    return [len(prompts.answers(e, i, end_of_turn)) for i, e in enumerate(examples)]


def host_block(count: int, process_index: int | None = None, process_count: int | None = None) -> range:
    """The contiguous block of `count` answers this process generates: ceil(count / processes) each,
    the last ones shorter (so `hosts.batch_count` gives every process enough batches)."""
    index = jax.process_index() if process_index is None else process_index
    processes = jax.process_count() if process_count is None else process_count
    size = -(-count // processes)
    return range(min(index * size, count), min((index + 1) * size, count))


def prompts_for(examples: list[Example], jobs: list[tuple[int, int]], spec, end_of_turn: int) -> list[dict]:
    """The prompt of each (example index, answer index) job (`prompts.Prompts`), each example's media
    expanded once."""
    built: dict[int, prompts.Prompts] = {}
    out = []
    for index, answer in jobs:
        if index not in built:
            built[index] = prompts.Prompts(examples[index], index, spec, end_of_turn)
        out.append(built[index].prompt(built[index].answers[answer]))
    return out


def vflash_fields(text: str, dense_scale: float | None) -> dict:
    """The primitives of a generated VFlash answer with dequantised coordinates, its atomic_decoding
    calls, and the parse error (null when it parses)."""
    try:
        primitives, calls = parse_answer(text)
    except PrimitiveError as error:
        return {"primitives": [], "atomic_decoding": [], "parse_error": str(error)}
    listed = []
    for primitive in primitives:
        item = {"kind": primitive.kind, "label": primitive.label, "tokens": list(primitive.values),
                "coordinates": None, "units": _units(primitive.kind)}
        if primitive.kind == "dense" and dense_scale is None:
            # No scale, no metres (seed 004: "a per-dataset scale s"); never a guessed default.
            item["error"] = "the data states no dense_scale, so dense tokens have no metres"
        else:
            scale = {} if dense_scale is None else {"dense_scale": float(dense_scale)}
            item["coordinates"] = coordinates(primitive, **scale).tolist()
        listed.append(item)
    return {"primitives": listed,
            "atomic_decoding": [{"block_size": c.block_size, "count": c.count, "covers": list(c.covers)}
                                for c in calls],
            "parse_error": None}


def record_id(example: Example) -> str | int | None:
    """The id the record wrote: a VFlash record's `id`, a vakforge conversation's id; None where it has none."""
    meta = contract.meta_of(example)
    return meta.id if meta.id is not None else meta.record_id


def answer_line(example: Example, index: int, answer: int, ids: list[int], *, family: str, tokenizer,
                stop_ids, chat_family: str | None) -> dict:
    """The output line of one generated answer (module docstring)."""
    stopped = bool(ids) and ids[-1] in stop_ids
    text = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
    meta = contract.meta_of(example)
    line = {"index": index, "source": contract.where(example), "id": record_id(example), "answer": answer, "text": text,
            "finish_reason": "stop" if stopped else "length", "generated_tokens": len(ids)}
    if family == "vflash":
        line.update(vflash_fields(text, meta.dense_scale))
    else:
        line["tool_calls"] = parse_tool_calls(text, chat_family)
    return line


class NotGenerated(ValueError):
    """Data whose records have no assistant answers to generate (Valen questions, prepared rows)."""


def refuse_family(family: str, where: str) -> None:
    """Generation applies to records with assistant answers; say what to use for the others."""
    if family == "valen":
        raise NotGenerated(f"{where}: Valen data is scored, not generated: each question is answered with its "
                         "candidates' probabilities by the score head; use python -m valen_jax.predict "
                         "--workdir=W --data=FILE --output=answers.jsonl")
    if family not in GENERATED_FAMILIES:
        raise NotGenerated(f"{where}: {family!r} data holds no prompts to generate from (seed 003: prepared rows "
                         f"are token rows for training); generation reads {', '.join(GENERATED_FAMILIES)} data")


def generate_answers(restored: ModelRun, examples: list[Example], family: str, *, max_new_tokens: int,
                     sampling: Sampling = GREEDY, seed: int = 0, batch_size: int | None = None) -> list[dict]:
    """Every trained assistant answer of `examples` (the whole data, the same list on every process)
    generated from the turns before it; the lines in data order, on every process. Call inside
    `jax.set_mesh(restored.mesh)`."""
    refuse_family(family, contract.where(examples[0]) if examples else "data")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    tokenizer, spec, mesh = restored.tokenizer, restored.spec, restored.mesh
    eot = end_of_turn_id(tokenizer)
    jobs = [(i, k) for i, n in enumerate(answer_counts(examples, eot)) for k in range(n)]
    block = host_block(len(jobs))
    mine = [jobs[j] for j in block]
    local_batch = local_batch_size(int(batch_size or restored.config.eval.batch_size), mesh)
    generated = generate_ids(restored.params, restored.graphdef, prompts_for(examples, mine, spec, eot),
                             max_new_tokens=max_new_tokens, stop_ids=(eot,), vocab=len(tokenizer),
                             sampling=sampling, seed=seed, mesh=mesh, local_batch=local_batch,
                             batches=hosts.batch_count(len(jobs), local_batch), first_index=block.start)
    chat_family = template_family(tokenizer.chat_template)
    own = [answer_line(examples[i], i, k, list(ids), family=family, tokenizer=tokenizer, stop_ids=(eot,),
                       chat_family=chat_family) for (i, k), ids in zip(mine, generated, strict=True)]
    lines = [line for part in hosts.gather_json(own) for line in part]  # process order = data order
    return sorted(lines, key=lambda line: (line["index"], line["answer"]))


def write_answers(lines: list[dict], path: str | Path) -> None:
    """answers.jsonl (one JSON line per answer, in data order), written by process 0 (`predict`, `generate`)."""
    if jax.process_index() != 0:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for line in lines:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
