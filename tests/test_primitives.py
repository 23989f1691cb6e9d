"""The seed 004 answer grammar: each rule with a passing and a failing answer."""

from __future__ import annotations

import pytest

from data_pipeline.primitives import (
    AtomicCall,
    Primitive,
    PrimitiveError,
    coordinate_count,
    expected_block_size,
    parse_answer,
)

# Answers copied from seed 004 ("Physical Primitives" and "Data Format").
SEED_ROBOT_3D = (
    "<action>Pull the drawer open.</action>"
    '<tool_call>{"name":"atomic_decoding","arguments":{"block_size":32}}</tool_call>'
    "<robot_single><521><489><61><520><488><64><518><487><67><517><485><70><516><483><73><515><480><76>"
    "<513><478><78><512><475><80><510><473><83><509><470><85></robot>"
)
SEED_ROBOT_2D = (
    '<tool_call>{"name":"atomic_decoding","arguments":{"block_size":10,"count":4}}</tool_call>'
    "<robot_single_2d><612><540><560><548><498><552><431><550></robot>"
)
SEED_DRIVE = (
    '<tool_call>{"name":"atomic_decoding","arguments":{"block_size":26}}</tool_call>'
    "<drive><62><500><500><86><500><500><110><501><501><134><501><501><158><502><502><181><503><502>"
    "<205><504><503><228><505><503></drive>"
)
SEED_BOXES = "<ref>cup</ref><objects><box><102><340><218><505></box><box><640><322><731><480></box></objects>"
SEED_NO_BOX = "<ref>dog</ref><objects>None</objects>"
SEED_POINT = "<point><218><365></point>"


def call(block_size: int, count: int | None = None) -> str:
    args = f'"block_size":{block_size}' + (f',"count":{count}' if count is not None else "")
    return f'<tool_call>{{"name":"atomic_decoding","arguments":{{{args}}}}}</tool_call>'


def nums(*values: int) -> str:
    return "".join(f"<{v}>" for v in values)


def error_of(text: str) -> PrimitiveError:
    with pytest.raises(PrimitiveError) as info:
        parse_answer(text)
    return info.value


# -- the seed's own examples -----------------------------------------------------------------------


def test_seed_robot_3d_ten_waypoints_block_32():
    prims, calls = parse_answer(SEED_ROBOT_3D)
    assert [p.kind for p in prims] == ["robot_single"]
    assert prims[0].waypoints == 10 and prims[0].values[:3] == (521, 489, 61)
    assert calls == [
        AtomicCall(SEED_ROBOT_3D.index("<tool_call>"), SEED_ROBOT_3D.index("<robot_single>"), 32, None, (0,))
    ]
    assert expected_block_size(prims) == 32


def test_seed_robot_2d_block_10_count_4():
    prims, calls = parse_answer(SEED_ROBOT_2D)
    assert prims[0].kind == "robot_single_2d" and prims[0].waypoints == 4
    assert (calls[0].block_size, calls[0].count) == (10, 4)


def test_seed_driving_block_26():
    prims, calls = parse_answer(SEED_DRIVE)
    assert prims[0].kind == "drive" and prims[0].waypoints == 8
    assert calls[0].block_size == 26


def test_seed_boxes_no_box_and_point():
    boxes, _ = parse_answer(SEED_BOXES)
    assert [(p.kind, p.label, p.values) for p in boxes] == [
        ("box", "cup", (102, 340, 218, 505)),
        ("box", "cup", (640, 322, 731, 480)),
    ]
    none, _ = parse_answer(SEED_NO_BOX)
    assert none == [Primitive("objects_none", SEED_NO_BOX.index("<objects>"), len(SEED_NO_BOX), (), "dog")]
    point, calls = parse_answer(SEED_POINT)
    assert point == [Primitive("point", 0, len(SEED_POINT), (218, 365))] and calls == []


def test_offsets_span_start_tag_to_end_tag():
    text = "The cup is here: " + SEED_POINT + " and more."
    (p,), _ = parse_answer(text)
    assert text[p.start : p.end] == SEED_POINT
    boxes, _ = parse_answer(SEED_BOXES)
    assert SEED_BOXES[boxes[1].start : boxes[1].end] == "<box><640><322><731><480></box>"


# -- number tokens ----------------------------------------------------------------------------------


def test_number_token_range_edges_pass():
    (p,), _ = parse_answer("<point><0><1000></point>")
    assert p.values == (0, 1000)


@pytest.mark.parametrize("token", ["<1001>", "<007>", "<-5>", "<+5>", "<1.5>"])
def test_malformed_number_tokens_refused(token):
    err = error_of(f"<point><5>{token}</point>")
    assert "not a number token" in str(err) and err.offset == len("<point><5>")


def test_stray_number_outside_primitive_refused():
    err = error_of("The answer is <5>.")
    assert err.offset == 14 and "outside a primitive" in str(err)
    assert str(err).startswith("at char 14: ")


# -- point and box ------------------------------------------------------------------------------------


def test_point_needs_exactly_two_numbers():
    assert "needs 2 numbers" in str(error_of("<point><1><2><3></point>"))


def test_box_needs_four_numbers_and_ordered_corners():
    assert "needs 4 numbers" in str(error_of("<ref>a</ref><objects><box><1><2><3></box></objects>"))
    assert "x1 < x2" in str(error_of("<ref>a</ref><objects><box><5><1><5><9></box></objects>"))
    assert "y1 < y2" in str(error_of("<ref>a</ref><objects><box><1><9><5><9></box></objects>"))


def test_box_only_inside_objects_after_ref():
    assert "outside <objects>" in str(error_of("<box><1><2><3><4></box>"))
    assert "must follow a <ref>" in str(error_of("<objects><box><1><2><3><4></box></objects>"))
    assert "followed by <objects>" in str(error_of("<ref>cup</ref> is here <objects>None</objects>"))
    assert "empty label" in str(error_of("<ref> </ref><objects>None</objects>"))


def test_whitespace_between_ref_and_objects_passes():
    prims, _ = parse_answer("<ref>cup</ref> <objects><box><1><2><3><4></box></objects>")
    assert prims[0].label == "cup"


def test_objects_content_rules():
    assert "holds no box" in str(error_of("<ref>a</ref><objects></objects>"))
    assert "inside <objects>" in str(error_of("<ref>a</ref><objects> None </objects>"))
    assert "inside <objects>" in str(error_of("<ref>a</ref><objects><point><1><2></point></objects>"))
    assert "not closed" in str(error_of("<ref>a</ref><objects><box><1><2><3><4></box>"))


# -- robot, driving, dense shapes and closing tags --------------------------------------------------


def test_robot_2d_needs_pairs():
    parse_answer(call(4) + "<robot_single_2d><1><2></robot>")
    assert "(u, v) pairs" in str(error_of(call(5) + "<robot_single_2d><1><2><3></robot>"))


def test_robot_3d_drive_dense_need_triples():
    parse_answer(call(5) + "<robot_single><1><2><3></robot>")
    for kind, closer in (("robot_single", "robot"), ("drive", "drive"), ("dense", "dense")):
        assert "triples" in str(error_of(call(6) + f"<{kind}><1><2><3><4></{closer}>"))
    assert "triples" in str(error_of(call(2) + "<drive></drive>"))


def test_closing_tags():
    assert "robot atoms close with </robot>" in str(
        error_of(call(5) + "<robot_single><1><2><3></robot_single>")
    )
    assert "expected a number token or </robot>" in str(error_of(call(5) + "<robot_single><1><2><3></drive>"))
    assert "not closed by </robot>" in str(error_of(call(5) + "<robot_single><1><2><3>"))
    assert "closes nothing" in str(error_of("done</robot>"))
    assert "closes nothing" in str(error_of("done</point>"))


def test_no_nesting_or_text_inside_atoms():
    assert "inside <robot_single>" in str(
        error_of(call(5) + "<robot_single><1><point><1><2></point></robot>")
    )
    assert "only number tokens" in str(error_of("<point><1> <2></point>"))


def test_unknown_tags_are_plain_text():
    prims, _ = parse_answer("<b>Look</b> at <image>: " + SEED_POINT + " </foo>")
    assert [p.kind for p in prims] == ["point"]


# -- dual arm -----------------------------------------------------------------------------------------


def test_dual_arm_2d_and_3d_pass():
    prims, calls = parse_answer(
        call(12, 2) + "<robot_left_2d><1><2><3><4></robot> <robot_right_2d><5><6><7><8></robot>"
    )
    assert [p.kind for p in prims] == ["robot_left_2d", "robot_right_2d"] and calls[0].covers == (0, 1)
    prims, calls = parse_answer(call(10) + "<robot_left><1><2><3></robot><robot_right><4><5><6></robot>")
    assert calls[0].block_size == expected_block_size(prims) == 10


def test_dual_arm_pairing_refused():
    assert "followed directly by a <robot_right_2d>" in str(
        error_of(call(8) + "<robot_left_2d><1><2></robot>")
    )
    assert "followed directly by a <robot_right_2d>" in str(
        error_of(call(8) + "<robot_left_2d><1><2></robot> x <robot_right_2d><3><4></robot>")
    )
    assert "followed directly by a <robot_right>" in str(
        error_of(call(10) + "<robot_left><1><2><3></robot><robot_right_2d><3><4></robot>")
    )
    assert "waypoints but the left arm has 1" in str(
        error_of(call(10) + "<robot_left_2d><1><2></robot><robot_right_2d><3><4><5><6></robot>")
    )
    assert "without a left-arm atom" in str(error_of(call(4) + "<robot_right_2d><1><2></robot>"))
    assert "without a left-arm atom" in str(error_of("<robot_right_2d><1><2></robot>"))


# -- atomic_decoding -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name":"atomic_decoding","arguments":{"block_size":5}', "not valid JSON"),
        ('{"name":"atomic_decoding","arguments":{"block_size":0}}', "block_size must be an integer >= 1"),
        ('{"name":"atomic_decoding","arguments":{"block_size":true}}', "block_size must be an integer >= 1"),
        ('{"name":"atomic_decoding","arguments":{"block_size":5.0}}', "block_size must be an integer >= 1"),
        ('{"name":"atomic_decoding","arguments":{}}', "block_size must be an integer >= 1"),
        (
            '{"name":"atomic_decoding","arguments":{"block_size":5,"count":0}}',
            "count must be an integer >= 1",
        ),
        ('{"name":"atomic_decoding","arguments":{"block_size":5,"mode":"x"}}', "unknown keys ['mode']"),
        ('{"name":"atomic_decoding"}', '"arguments" object'),
        ('["atomic_decoding"]', 'string "name"'),
    ],
)
def test_atomic_decoding_json_refused(body, message):
    err = error_of(f"<tool_call>{body}</tool_call><robot_single><1><2><3></robot>")
    assert message in str(err)


def test_block_size_and_count_must_match():
    assert "needs block_size=10" in str(
        error_of(call(9) + "<robot_single_2d><1><2><3><4><5><6><7><8></robot>")
    )
    assert "count=3" in str(error_of(call(10, 3) + "<robot_single_2d><1><2><3><4><5><6><7><8></robot>"))
    assert "count=2" in str(error_of(call(5, 2) + "<drive><1><2><3></drive>"))


def test_call_and_trajectory_must_meet():
    assert "not preceded by an atomic_decoding call" in str(error_of("<robot_single><1><2><3></robot>"))
    assert "only whitespace between" in str(error_of(call(5) + " then <robot_single><1><2><3></robot>"))
    assert "must be followed by a robot" in str(error_of(call(4) + SEED_POINT))
    assert "must be followed by a robot" in str(error_of("<action>wait</action>" + call(4)))
    prims, calls = parse_answer(call(5) + "\n<robot_single><1><2><3></robot>")
    assert len(calls) == 1


def test_other_tool_calls_stay_text():
    text = '<tool_call>{"name":"search","arguments":{"q":"<5>"}}</tool_call>' + SEED_POINT
    prims, calls = parse_answer(text)
    assert [p.kind for p in prims] == ["point"] and calls == []
    assert "not closed" in str(error_of('<tool_call>{"name":"search"}'))


# -- dense motion --------------------------------------------------------------------------------------


def test_dense_count_covers_consecutive_trajectories():
    text = call(8, 2) + "<dense><1><2><3><4><5><6></dense> <dense><7><8><9><1><2><3></dense>"
    prims, calls = parse_answer(text)
    assert calls[0].covers == (0, 1) and coordinate_count(prims) == [6, 6]
    prims, calls = parse_answer(call(5) + "<dense><1><2><3></dense>")
    assert calls[0].count is None and calls[0].covers == (0,)


def test_dense_count_and_frames_refused():
    assert "future frames" in str(
        error_of(call(8, 2) + "<dense><1><2><3><4><5><6></dense><dense><1><2><3></dense>")
    )
    assert "count=3 but 2" in str(error_of(call(5, 3) + "<dense><1><2><3></dense><dense><1><2><3></dense>"))
    assert "not preceded" in str(error_of(call(5) + "<dense><1><2><3></dense><dense><1><2><3></dense>"))
    assert "needs block_size=5" in str(
        error_of(call(10, 2) + "<dense><1><2><3></dense><dense><1><2><3></dense>")
    )


# -- action and helpers -------------------------------------------------------------------------------


def test_action_is_plain_text():
    prims, _ = parse_answer("<action>Pick the cup (x < y).</action>" + SEED_POINT)
    assert len(prims) == 1
    assert "<action> holds plain text" in str(error_of("<action>go " + SEED_POINT + "</action>"))
    assert "not closed by </action>" in str(error_of("<action>go"))


def test_coordinate_count_skips_objects_none():
    prims, _ = parse_answer(SEED_NO_BOX + " " + SEED_BOXES + " " + SEED_POINT)
    assert [p.kind for p in prims] == ["objects_none", "box", "box", "point"]
    assert coordinate_count(prims) == [4, 4, 2]


def test_plain_text_answer_has_no_primitives():
    assert parse_answer("Nothing to point at.") == ([], [])
