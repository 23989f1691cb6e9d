"""The public announcement API of `data_pipeline.primitives` (seed 004, "Physical Primitives"): what an
`atomic_decoding` call announces, read from a tool-call body, and the refusals the seed's rules imply."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.formats.vflash import read_vflash
from data_pipeline.primitives import (
    Announcement,
    AtomicCalls,
    BlockError,
    PrimitiveError,
    parse_announcement,
    parse_answer,
    rendered_blocks,
)
from data_pipeline.render.vflash import VFlashRenderer
from data_pipeline.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def body(arguments: str, **extra: str) -> str:
    keys = "".join(f',"{k}":{v}' for k, v in extra.items())
    return f'{{"name":"atomic_decoding","arguments":{arguments}{keys}}}'


# -- parse_announcement ------------------------------------------------------------------------------


def test_seed_calls_announce_their_block_size_and_count():
    # The calls of seed 004's examples: robot 3D (no count), robot 2D (count 4), driving.
    assert parse_announcement(body('{"block_size":32}')) == Announcement(32, None)
    assert parse_announcement(body('{"block_size":10,"count":4}')) == Announcement(10, 4)
    assert parse_announcement(body('{"block_size":26}')) == Announcement(26)


def test_text_and_parsed_json_read_alike():
    call = {"name": "atomic_decoding", "arguments": {"block_size": 8, "count": 2}}
    assert parse_announcement(call) == parse_announcement(body('{"block_size":8,"count":2}')) == Announcement(8, 2)


@pytest.mark.parametrize("call", [
    '{"name":"search","arguments":{"q":"<5>"}}',  # another tool stays text
    '{"name":"atomic_decoding","arguments":{"block_size":5}',  # not JSON
    '["atomic_decoding"]',  # not an object
    '{"arguments":{"block_size":5}}',  # no name
    '{"name":7,"arguments":{"block_size":5}}',
    '"atomic_decoding"',
    "",
])
def test_no_atomic_decoding_call_announces_nothing(call):
    assert parse_announcement(call) is None


@pytest.mark.parametrize("call, message", [
    (body('{"block_size":0}'), "atomic_decoding block_size must be an integer >= 1, got 0"),
    (body('{"block_size":-3}'), "atomic_decoding block_size must be an integer >= 1, got -3"),
    (body('{"block_size":true}'), "atomic_decoding block_size must be an integer >= 1, got true"),
    (body('{"block_size":5.0}'), "atomic_decoding block_size must be an integer >= 1, got 5.0"),
    (body('{"block_size":"32"}'), 'atomic_decoding block_size must be an integer >= 1, got "32"'),
    (body("{}"), "atomic_decoding block_size must be an integer >= 1, got null"),
    (body('{"count":4}'), "atomic_decoding block_size must be an integer >= 1, got null"),
    (body('{"block_size":5,"count":0}'), "atomic_decoding count must be an integer >= 1, got 0"),
    (body('{"block_size":5,"count":null}'), "atomic_decoding count must be an integer >= 1, got null"),
    (body('{"block_size":5,"mode":"x"}'), "atomic_decoding arguments has unknown keys ['mode']; allowed: block_size, count"),
    (body('{"block_size":5}', id_='"c1"'), "atomic_decoding call has unknown keys ['id_']"),
    ('{"name":"atomic_decoding"}', 'atomic_decoding call needs an "arguments" object'),
    ('{"name":"atomic_decoding","arguments":[32]}', 'atomic_decoding call needs an "arguments" object'),
])
def test_arguments_against_the_seed_are_refused_at_the_offset(call, message):
    with pytest.raises(PrimitiveError) as err:
        parse_announcement(call, offset=17)
    assert err.value.reason == message and err.value.offset == 17


def test_the_answer_grammar_reads_calls_through_parse_announcement():
    # The same arguments, the same refusal, offset at the call's `<tool_call>` within the answer.
    answer = "<action>go</action><tool_call>" + body('{"block_size":0}') + "</tool_call>"
    with pytest.raises(PrimitiveError) as err:
        parse_answer(answer + "<robot_single><1><2><3></robot>")
    assert err.value.offset == len("<action>go</action>")
    assert err.value.reason == "atomic_decoding block_size must be an integer >= 1, got 0"
    _, calls = parse_answer("<tool_call>" + body('{"block_size":5}') + "</tool_call><drive><1><2><3></drive>")
    assert (calls[0].block_size, calls[0].count) == (5, None)


def test_blocks_count_dense_trajectories_and_nothing_else():
    # Seed 004: for dense motion `count` gives the number of trajectories, one block each.
    assert Announcement(11, 3).blocks(dense=True) == 3
    assert Announcement(11).blocks(dense=True) == 1
    # A robot or driving count is waypoints, not blocks; a dual-arm pair is one block.
    assert Announcement(10, 4).blocks(dense=False) == 1
    assert Announcement(16).blocks(dense=False) == 1


# -- AtomicCalls: announcements and their blocks in token ids ----------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / "data" / "tokenizer")


@pytest.fixture(scope="module")
def calls(tokenizer):
    return AtomicCalls(tokenizer)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def tool_call(block_size: int, count: int | None = None) -> str:
    arguments = f'{{"block_size":{block_size}' + (f',"count":{count}' if count is not None else "") + "}"
    return f"<tool_call>{body(arguments)}</tool_call>"


ROBOT_2D = "<robot_single_2d><612><540><560><548><498><552><431><550></robot>"  # P = 4: 2P + 2 = 10
DENSE = "<dense><1><2><3><4><5><6></dense>"  # F = 2: 3F + 2 = 8 per trajectory


def test_call_ends_index_the_calls_an_answer_completes(tokenizer, calls):
    answer = ids(tokenizer, "<action>Pull.</action>" + tool_call(10, 4) + ROBOT_2D
                 + '<tool_call>{"name":"search","arguments":{}}</tool_call>' + tool_call(8, 2) + DENSE + DENSE)
    ends = calls.call_ends(answer)
    assert [a for _, a in ends] == [Announcement(10, 4), Announcement(8, 2)]
    assert all(answer[j] == calls.close_id for j, _ in ends)
    assert calls.announced(answer[:ends[0][0] + 1]) == Announcement(10, 4)
    assert calls.call_ends(ids(tokenizer, "no call here" + ROBOT_2D)) == []


def test_spans_start_after_the_call_and_cover_block_size_tokens(tokenizer, calls):
    prompt = ids(tokenizer, "Plan the arm." + tool_call(10, 4))
    output = ids(tokenizer, ROBOT_2D + " done")
    # A prompt ending with the call: the block is the output's first block_size tokens, the seed's atom.
    assert calls.announced_spans(prompt, output) == [(0, 10, Announcement(10, 4))]
    assert tokenizer.decode(output[:10]) == ROBOT_2D
    # A call written in the output: its block starts at the token after `</tool_call>`.
    head = ids(tokenizer, "ok " + tool_call(10))
    assert calls.announced_spans(ids(tokenizer, "Plan."), head + output) == [
        (len(head), len(head) + 10, Announcement(10))]


def test_dense_count_announces_count_blocks_back_to_back(tokenizer, calls):
    output = ids(tokenizer, DENSE + DENSE + DENSE)
    assert calls.announced_spans(ids(tokenizer, tool_call(8, 3)), output) == [(0, 24, Announcement(8, 3))]
    # Without count, one block; a count that opens no <dense> counts waypoints, not blocks.
    assert calls.announced_spans(ids(tokenizer, tool_call(8)), output) == [(0, 8, Announcement(8))]
    assert calls.announced_spans(ids(tokenizer, tool_call(10, 4)), ids(tokenizer, ROBOT_2D * 2)) == [
        (0, 10, Announcement(10, 4))]


def test_a_call_inside_a_block_announces_nothing(tokenizer, calls):
    inner = ids(tokenizer, tool_call(3))
    output = inner + ids(tokenizer, "ab") + ids(tokenizer, tool_call(4)) + ids(tokenizer, "<drive><1><2></drive>")
    # The prompt's call announces a block longer than `inner`: the call closing inside it is text.
    size = len(inner) + 2
    spans = calls.announced_spans(ids(tokenizer, tool_call(size)), output)
    assert [(s, a.block_size) for s, _, a in spans] == [(0, size), (len(output) - 4, 4)]


def test_spans_may_run_past_an_output_that_stopped_early(tokenizer, calls):
    prompt = ids(tokenizer, tool_call(10))
    assert calls.announced_spans(prompt, ids(tokenizer, "<robot_single_2d><1>")) == [(0, 10, Announcement(10))]
    # A call completed by the output's last token: its block starts where the output ends.
    output = ids(tokenizer, "go " + tool_call(26))
    assert calls.announced_spans([], output) == [(len(output), len(output) + 26, Announcement(26))]
    assert calls.announced_spans([], []) == [] and calls.announced_spans(prompt[:-1], []) == []


def test_generated_arguments_against_the_seed_are_refused_quoting_the_call(tokenizer, calls):
    with pytest.raises(ValueError, match=r"generated atomic_decoding call .*block_size must be an integer >= 1"):
        calls.announced_spans(ids(tokenizer, tool_call(0)), [])
    with pytest.raises(ValueError, match=r"count must be an integer >= 1"):
        calls.call_ends(ids(tokenizer, tool_call(5, 0)))
    # Malformed JSON or another tool in generated text is text: nothing announced, no error.
    assert calls.announced(ids(tokenizer, '<tool_call>{"name":"atomic_decoding"</tool_call>')) is None


def test_a_tokenizer_without_single_primitive_tokens_is_refused():
    class Split:
        def encode(self, text, add_special_tokens=False):
            return list(range(len(text)))

    with pytest.raises(ValueError, match=r"<tool_call> is 11 tokens, not one; add the primitive tokens"):
        AtomicCalls(Split())


# -- rendered_blocks: the blocks of a rendered example -----------------------------------------------


def test_rendered_blocks_cut_each_call_into_its_blocks():
    # A point (no call), a block of 4, a dual-arm pair of 3 + 3 (one call, block_size 6), a dense call
    # of two trajectories of 2 tokens: one block each.
    spans = [(0, 1, 3), (4, 4, 8), (4, 9, 12), (4, 12, 15), (5, 16, 18), (5, 18, 20)]
    blocks = [(-1, 0, 0), (0, 4, 0), (1, 6, 0), (1, 6, 0), (2, 2, 2), (2, 2, 2)]
    assert rendered_blocks(spans, blocks) == [(4, 8), (9, 15), (16, 18), (18, 20)]
    assert rendered_blocks(np.zeros((0, 3), np.int32), np.zeros((0, 3), np.int32)) == []


@pytest.mark.parametrize("spans, blocks, message", [
    ([(4, 4, 8)], [(0, 5, 0)], "atomic_decoding call 0 announces block_size=5, but its primitives span 4 tokens"),
    ([(4, 4, 8)], [(0, 3, 0)], "atomic_decoding call 0 announces block_size=3, but its primitive spans 4 tokens"),
    # A pair whose right arm does not start where the left one ended leaves the block short.
    ([(4, 4, 7), (5, 8, 11)], [(0, 6, 0), (0, 6, 0)],
     "atomic_decoding call 0 announces block_size=6, but its primitives span 3 tokens"),
    # A block still open when the next call's primitive begins.
    ([(4, 4, 7), (4, 7, 10)], [(0, 6, 0), (1, 3, 0)],
     "atomic_decoding call 0 announces block_size=6, but its primitives span 3 tokens"),
])
def test_rendered_blocks_refuse_primitives_that_miss_the_announced_size(spans, blocks, message):
    with pytest.raises(BlockError) as err:
        rendered_blocks(spans, blocks)
    assert str(err.value) == message


@pytest.mark.parametrize("answer", [
    "<action>Pull the drawer open.</action>" + tool_call(32)
    + "<robot_single><521><489><61><520><488><64><518><487><67><517><485><70><516><483><73><515><480><76>"
      "<513><478><78><512><475><80><510><473><83><509><470><85></robot>",  # seed 004's robot 3D answer
    tool_call(10, 4) + ROBOT_2D,
    tool_call(26) + "<drive><62><500><500><86><500><500><110><501><501><134><501><501><158><502><502><181>"
                    "<503><502><205><504><503><228><505><503></drive>",
    tool_call(12) + "<robot_left_2d><1><2><3><4></robot><robot_right_2d><5><6><7><8></robot>",  # 4P + 4
    tool_call(8, 2) + DENSE + DENSE,
    "<point><218><365></point> then " + tool_call(10) + ROBOT_2D + " and " + tool_call(8) + DENSE,
])
def test_training_and_decoding_find_the_same_blocks_in_a_rendered_answer(tokenizer, calls, tmp_path, answer):
    row = {"conversations": [{"from": "human", "value": "Move."}, {"from": "gpt", "value": answer}]}
    (tmp_path / "a.jsonl").write_text(json.dumps(row) + "\n")
    (record,) = read_vflash(tmp_path / "a.jsonl", dense_scale=2.0)
    example = VFlashRenderer(tokenizer).render(record, "entry")
    training = rendered_blocks(example.arrays["primitive_spans"], example.arrays["primitive_blocks"])
    tokens = example.arrays["input_ids"].tolist()
    decoding = []  # each announcement's span cut into its blocks
    for start, stop, announcement in calls.announced_spans([], tokens):
        decoding += [(b, b + announcement.block_size) for b in range(start, stop, announcement.block_size)]
    assert training and training == decoding
