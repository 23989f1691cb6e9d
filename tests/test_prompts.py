"""valen_jax.evaluation.prompts on hand-made Examples: one numbering of trained answers (answer index, the
assistant message it is under the converter's assistant_turns policy, its span), the prompt before an answer
and the prompt cut at its first atomic_decoding call, and the refusal of an example whose trained answers fit
neither policy (no guessed message)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_pipeline.primitives import AtomicCalls
from data_pipeline.shards import Example
from valen_jax.data.assemble import RowSpec
from valen_jax.evaluation import chat, prompts
from valen_jax.evaluation.prompts import AnswerError, AnswerRef

EOT = 2
SPEC = RowSpec(seq_len=64, max_patches=0, image_pad_id=999, pad_id=0, vision=None, media_kwargs={})
OPEN, CLOSE, DENSE, ATOMIC, OTHER = 50, 51, 52, 60, 61


def _example(prompt: list[int], *turns: tuple[list[int], bool], line: int = 1, **meta) -> Example:
    """`prompt` untrained, then each (assistant answer ending with EOT, trained) turn, each followed by a user
    token; `meta` added to the Example's (chat: tool_calls, trained_turns)."""
    ids, weights = list(prompt), [0.0] * len(prompt)
    for answer, trained in turns:
        ids += answer + [3]
        weights += [1.0 if trained else 0.0] * len(answer) + [0.0]
    return Example(arrays={"input_ids": np.asarray(ids, np.int32), "target_weights": np.asarray(weights, np.float32)},
                   meta={"source": "rows.jsonl", "line": line, **meta})


def _chat(turns: list[tuple[list[int], bool]], trained_turns: int, line: int = 1) -> Example:
    return _example([1, 4, 5], *turns, line=line, tool_calls=[[] for _ in turns], trained_turns=trained_turns,
                    answers=["x"] * len(turns))


def test_every_message_trained_numbers_answers_as_messages():
    example = _chat([([7, 8, EOT], True), ([9, EOT], True)], trained_turns=2)
    assert prompts.assistant_turns(example) == "all"
    assert prompts.answers(example, 4, EOT) == [AnswerRef(4, 0, 0, 3, 6), AnswerRef(4, 1, 1, 7, 9)]
    assert [k for k, _ in chat.answer_prompts(example, SPEC, EOT)] == [0, 1]


def test_the_last_message_trained_is_answer_0_and_the_last_message():
    example = _chat([([7, 8, EOT], False), ([6, EOT], False), ([9, EOT], True)], trained_turns=1)
    assert prompts.assistant_turns(example) == "last"
    assert prompts.answers(example, 0, EOT) == [AnswerRef(0, 0, 2, 10, 12)]
    (k, prompt), = chat.answer_prompts(example, SPEC, EOT)
    assert k == 2 and prompt["ids"].tolist() == example.arrays["input_ids"][:10].tolist()


def test_one_message_reads_as_every_message_and_vflash_numbers_answers_as_messages():
    single = _chat([([7, EOT], True)], trained_turns=1)
    assert prompts.assistant_turns(single) == "all"
    assert prompts.answers(single, 0, EOT) == [AnswerRef(0, 0, 0, 3, 5)]
    vflash = _example([1, 4], ([7, EOT], True), ([8, 9, EOT], True), answers=["a", "b"])
    assert prompts.assistant_turns(vflash) is None
    assert [(r.answer, r.message) for r in prompts.answers(vflash, 0, EOT)] == [(0, 0), (1, 1)]


@pytest.mark.parametrize("turns, trained_turns, message", [
    # "all" recorded, but one message carries no weight in the ids
    ([([7, EOT], True), ([9, EOT], False)], 2, "2 assistant messages"),
    # "last" recorded, but two messages carry weight
    ([([7, EOT], True), ([9, EOT], True)], 1, "assistant_turns='last'"),
    # neither policy: two of three messages trained
    ([([7, EOT], True), ([8, EOT], True), ([9, EOT], False)], 2, "neither assistant_turns='all'"),
])
def test_answers_that_fit_neither_policy_are_refused_naming_the_example(turns, trained_turns, message):
    example = _chat(turns, trained_turns, line=7)
    for build in (lambda: prompts.answers(example, 0, EOT), lambda: chat.answer_prompts(example, SPEC, EOT)):
        with pytest.raises(AnswerError, match="rows.jsonl:7") as err:
            build()
        assert message in str(err.value)


def test_the_prompt_is_every_token_before_the_answer_with_its_positions():
    example = _example([1, 4, 5], ([7, 8, EOT], True), ([9, EOT], True), answers=["a", "b"])
    built = prompts.Prompts(example, 3, SPEC, EOT)
    first, last = built.answers
    assert built.last() == last
    assert built.prompt(first)["ids"].tolist() == [1, 4, 5]
    second = built.prompt(last)
    assert second["ids"].tolist() == [1, 4, 5, 7, 8, EOT, 3]
    assert np.asarray(second["positions"]).tolist() == list(range(7))
    assert built.answer_ids(last) == [9, EOT]
    assert prompts.prompt_of(example, SPEC, EOT)["ids"].tolist() == second["ids"].tolist()
    assert prompts.prompt_of(example, SPEC, EOT, 0)["ids"].tolist() == [1, 4, 5]
    with pytest.raises(AnswerError, match="rows.jsonl:1: no trained assistant answer"):
        prompts.prompt_of(_example([1, 4], ([7, EOT], False)), SPEC, EOT)


class _Tokenizer:
    """The few tokens AtomicCalls reads: the call tags and two call bodies, one token each."""

    TEXT = {OPEN: "<tool_call>", CLOSE: "</tool_call>", DENSE: "<dense>",
            ATOMIC: json.dumps({"name": "atomic_decoding", "arguments": {"block_size": 3}}),
            OTHER: json.dumps({"name": "search", "arguments": {}})}

    def encode(self, text, add_special_tokens=False):
        return [next(i for i, t in self.TEXT.items() if t == text)]

    def decode(self, ids):
        return "".join(self.TEXT.get(int(i), "?") for i in ids)


def test_the_prompt_cut_at_the_answers_first_atomic_decoding_call():
    calls = AtomicCalls(_Tokenizer())
    example = _example([1, 4], ([7, OPEN, OTHER, CLOSE, 8, EOT], True),
                       ([9, OPEN, ATOMIC, CLOSE, 10, 11, 12, OPEN, ATOMIC, CLOSE, EOT], True), answers=["a", "b"])
    built = prompts.Prompts(example, 0, SPEC, EOT)
    other, trajectory = built.answers
    assert built.first_call(other, calls) is None and built.prompt(other, calls) is None
    offset, announcement = built.first_call(trajectory, calls)
    assert (offset, announcement.block_size) == (3, 3)
    cut = built.prompt(trajectory, calls)
    assert cut["ids"].tolist() == example.arrays["input_ids"][:trajectory.start + 4].tolist()
    assert cut["ids"].tolist()[-4:] == [9, OPEN, ATOMIC, CLOSE]
