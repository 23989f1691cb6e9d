"""The trained answers of an Example and the prompts before them: one numbering for every caller
(evaluation, `generate`/`predict`, `regenerate`, the speculative evaluation and benchmark).

- An answer is the weighted tokens up to and including an end-of-turn token (`answer_spans`).
- `AnswerRef`: the `example`-th Example of the data, its `answer`-th trained answer (0-based, in
  order), the assistant `message` it is (the index into the meta's per-message lists `tool_calls` and
  `answers`), and its [start, stop) span in the Example's own ids (`input_ids`).
- `answers(example, index, end_of_turn)`: the list of them, from the shard ids alone (no media read).
- `Prompts(example, index, spec, end_of_turn)`: the example's media expanded once; `prompt(ref)` is
  every expanded token before the answer, their positions and the example's vision inputs (what
  `tokens.greedy` and `decoding.generate_ids` continue), `prompt(ref, calls)` the same cut one past
  the reference answer's first `atomic_decoding` call (`data_pipeline.primitives.AtomicCalls`).

Answers and messages (`messages_of`). Chat and vakforge Examples record one `tool_calls` entry per
assistant message and `trained_turns`, the assistant messages the converter's loss policy
(`assistant_turns`, `data_pipeline.render.chat`) gave weight: "all" trains every message, so
`trained_turns` equals the messages and answer k is message k; "last" trains the final one only
(`trained_turns` 1), so the one answer is the last message. Any other count, or trained answers in
the ids that are not `trained_turns`, is refused naming the example (a shard from another renderer;
never a guess). VFlash Examples have no per-message lists: answer k is message k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline.primitives import Announcement, AtomicCalls
from data_pipeline.shards import Example
from valen_jax.data.assemble import ExpandedExample, RowSpec, expand_media_slots, vision_arrays
from valen_jax.errors import EvaluationError


class AnswerError(EvaluationError):
    """An Example whose trained answers do not match what its meta says was trained (a user error: the
    data, one line at every command's boundary; still a ValueError)."""


@dataclass(frozen=True)
class AnswerRef:
    example: int  # index into the data's examples
    answer: int  # the k-th trained answer of the example
    message: int  # the assistant message it is: index into meta `tool_calls` / `answers`
    start: int  # [start, stop): its tokens in the example's `input_ids`, end-of-turn included
    stop: int


def answer_spans(ids: np.ndarray, weights: np.ndarray, end_of_turn: int) -> list[tuple[int, int]]:
    """[start, stop) of each trained assistant answer, in order.

    An answer is the weighted tokens up to and including its end-of-turn token (render_chat makes
    every assistant span end with it). Weight-0 tokens inside an answer (VFlash coordinates that
    `atom_loss_masks` removes) do not split it: only an end-of-turn closes an answer.
    """
    spans, start = [], None
    for t in np.flatnonzero(weights > 0):
        if start is None:
            start = int(t)
        if ids[t] == end_of_turn:
            spans.append((start, int(t) + 1))
            start = None
    return spans


def assistant_turns(example: Example) -> str | None:
    """The loss policy the example was converted with ("all" or "last"), read from its meta; None for
    an Example without per-message lists (VFlash). One assistant message reads as "all" (both
    policies train it)."""
    meta = contract.meta_of(example)
    if meta.tool_calls is None:
        return None
    messages, trained = len(meta.tool_calls), meta.trained_turns
    if trained == messages:
        return "all"
    if trained == 1:
        return "last"
    raise AnswerError(f"{contract.where(example)}: meta trained_turns={trained!r} for {messages} assistant "
                      "messages: neither assistant_turns='all' (every message) nor 'last' (one); reconvert it")


def messages_of(example: Example, count: int) -> list[int]:
    """The assistant message of each of the example's `count` trained answers (module docstring)."""
    policy = assistant_turns(example)
    if policy is None:
        return list(range(count))
    messages = len(contract.meta_of(example).tool_calls)
    expected = messages if policy == "all" else 1
    if count != expected:
        raise AnswerError(f"{contract.where(example)}: {count} trained answers in the ids, but the example was "
                          f"converted with assistant_turns={policy!r} over {messages} assistant messages "
                          f"(meta trained_turns={contract.meta_of(example).trained_turns}); reconvert it")
    return list(range(messages)) if policy == "all" else [messages - 1]


def answers(example: Example, index: int, end_of_turn: int) -> list[AnswerRef]:
    """The trained answers of `example`, the `index`-th of the data, in order. From its shard ids: a
    media slot carries no weight and no end-of-turn, so expanding the slots keeps the answers."""
    spans = answer_spans(example.arrays["input_ids"], example.arrays["target_weights"], end_of_turn)
    return [AnswerRef(index, k, message, start, stop)
            for k, ((start, stop), message) in enumerate(zip(spans, messages_of(example, len(spans)), strict=True))]


def prompt_before(expanded: ExpandedExample, start: int, spec: RowSpec, where: str) -> dict:
    """The prompt `greedy` continues: the expanded ids before `start`, their positions (those of the whole
    sequence, as HF computes them for the prompt) and the example's vision inputs."""
    return {"ids": expanded.ids[:start], "positions": expanded.positions(spec)[:start],
            "vision": vision_arrays(expanded.media, spec, where)}


class Prompts:
    """The prompts before the trained answers of one example (`answers`), its media expanded once."""

    def __init__(self, example: Example, index: int, spec: RowSpec, end_of_turn: int):
        self.example, self.spec, self.where = example, spec, contract.where(example)
        self.answers = answers(example, index, end_of_turn)
        self.expanded = expand_media_slots(example, spec)
        self.spans = answer_spans(self.expanded.ids, self.expanded.weights, end_of_turn)
        if len(self.spans) != len(self.answers):  # expansion adds weightless media tokens only
            raise AnswerError(f"{self.where}: {len(self.answers)} trained answers in the shard ids, "
                              f"{len(self.spans)} after expanding its media")

    def last(self) -> AnswerRef:
        if not self.answers:
            raise AnswerError(f"{self.where}: no trained assistant answer to decode")
        return self.answers[-1]

    def answer_ids(self, ref: AnswerRef) -> list[int]:
        """The reference answer's expanded ids, end-of-turn included."""
        start, stop = self.spans[ref.answer]
        return [int(t) for t in self.expanded.ids[start:stop]]

    def first_call(self, ref: AnswerRef, calls: AtomicCalls) -> tuple[int, Announcement] | None:
        """(offset in the answer of the `</tool_call>` closing its first `atomic_decoding` call, what it
        announces), or None for an answer that announces no block."""
        ends = calls.call_ends(self.answer_ids(ref))
        return ends[0] if ends else None

    def prompt(self, ref: AnswerRef, calls: AtomicCalls | None = None) -> dict | None:
        """The prompt before the answer; with `calls`, through its first `atomic_decoding` call (None when it
        announces no block)."""
        start = self.spans[ref.answer][0]
        if calls is not None:
            found = self.first_call(ref, calls)
            if found is None:
                return None
            start += found[0] + 1
        return prompt_before(self.expanded, start, self.spec, self.where)


def prompt_of(example: Example, spec: RowSpec, end_of_turn: int, answer: int = -1) -> dict:
    """The prompt before the `answer`-th trained answer of `example` (default: its last)."""
    prompts = Prompts(example, 0, spec, end_of_turn)
    prompts.last()  # refuses an example without one
    return prompts.prompt(prompts.answers[answer])
