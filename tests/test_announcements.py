"""The public announcement API of `data_pipeline.primitives` (seed 004, "Physical Primitives"): what an
`atomic_decoding` call announces, read from a tool-call body, and the refusals the seed's rules imply."""

from __future__ import annotations

import pytest

from data_pipeline.primitives import Announcement, PrimitiveError, parse_announcement, parse_answer


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
