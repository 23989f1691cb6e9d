"""The quantise/dequantise pair and the coordinate ranges of seed 004."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from data_pipeline.primitives import RANGES, coordinates, dequantise, parse_answer, quantise, ranges

AXES = sorted({r for axes in RANGES.values() for r in axes}) + [(-3.0, 3.0)]


@st.composite
def value_in_range(draw):
    lo, hi = draw(st.sampled_from(AXES))
    return lo, hi, draw(st.floats(lo, hi, allow_nan=False))


@given(value_in_range())
def test_roundtrip_within_half_a_step(case):
    lo, hi, x = case
    k = quantise(x, lo, hi)
    assert 0 <= k <= 1000
    assert abs(dequantise(k, lo, hi) - x) <= (hi - lo) / 2000 * (1 + 1e-9)


@given(st.sampled_from(AXES), st.floats(-1e4, 1e4), st.floats(-1e4, 1e4))
def test_monotonic(axis, a, b):
    lo, hi = axis
    a, b = min(a, b), max(a, b)
    assert quantise(a, lo, hi) <= quantise(b, lo, hi)


@given(st.integers(0, 999))
def test_exact_halves_round_up_image_units(k):
    # k + 0.5 is exact in binary on the (0, 1000) range.
    assert quantise(k + 0.5, 0.0, 1000.0) == k + 1
    assert quantise(k + 0.49999, 0.0, 1000.0) == k


@given(st.integers(0, 999))
def test_written_halves_round_up_in_metres(k):
    # −5 + (k + 0.5)·0.01 as written (e.g. −4.995) is a decimal half of the robot range; float
    # arithmetic lands a hair either side of it, the exact scaling does not.
    x = round(-5 + (k + 0.5) / 100, 3)
    assert quantise(x, -5.0, 5.0) == k + 1


def test_known_values():
    assert quantise(-4.995, -5, 5) == 1
    assert quantise(0.0, -5, 5) == 500
    assert quantise(-10.0, -10, 250) == 0 and quantise(250.0, -10, 250) == 1000
    assert quantise(0.0, -math.pi, math.pi) == 500
    assert quantise(11.0, 0, 10) == 1000 and quantise(-1e9, 0, 10) == 0  # clipped
    assert dequantise(500, -5, 5) == 0.0
    assert dequantise(61, 0, 10) == pytest.approx(0.61)
    np.testing.assert_allclose(dequantise(np.array([0, 500, 1000]), -2.0, 2.0), [-2.0, 0.0, 2.0])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_refused(bad):
    with pytest.raises(ValueError):
        quantise(bad, 0, 1)


def test_bad_ranges_and_tokens_refused():
    with pytest.raises(ValueError):
        quantise(0.5, 1, 1)
    with pytest.raises(ValueError):
        dequantise(1001, 0, 1)
    with pytest.raises(ValueError):
        dequantise(2.5, 0, 1)
    with pytest.raises(ValueError):
        ranges("dense", dense_scale=0.0)
    with pytest.raises(ValueError):
        ranges("circle")


def test_dense_formula_matches_seed():
    # seed 004: (k − 500) · s / 500 metres
    for s in (2.0, 0.5):
        for k in (0, 137, 500, 999, 1000):
            lo, hi = ranges("dense", s)[0]
            assert dequantise(k, lo, hi) == pytest.approx((k - 500) * s / 500)


def _prim(text, i=0):
    return parse_answer(text)[0][i]


def test_coordinates_per_kind():
    np.testing.assert_allclose(coordinates(_prim("<point><218><365></point>")), [[0.218, 0.365]])
    box = _prim("<ref>cup</ref><objects><box><102><340><218><505></box></objects>")
    np.testing.assert_allclose(coordinates(box), [[0.102, 0.340], [0.218, 0.505]])
    assert coordinates(_prim("<ref>dog</ref><objects>None</objects>")).shape == (0, 2)
    r2 = _prim('<tool_call>{"name":"atomic_decoding","arguments":{"block_size":6}}</tool_call>'
               "<robot_single_2d><612><540><560><548></robot>")
    np.testing.assert_allclose(coordinates(r2), [[0.612, 0.540], [0.560, 0.548]])
    r3 = _prim('<tool_call>{"name":"atomic_decoding","arguments":{"block_size":5}}</tool_call>'
               "<robot_single><521><489><61></robot>")
    np.testing.assert_allclose(coordinates(r3), [[0.21, -0.11, 0.61]], atol=1e-12)
    drive = _prim('<tool_call>{"name":"atomic_decoding","arguments":{"block_size":5}}</tool_call>'
                  "<drive><62><500><1000></drive>")
    np.testing.assert_allclose(coordinates(drive), [[-10 + 62 * 0.26, 0.0, math.pi]], atol=1e-12)
    dense = _prim('<tool_call>{"name":"atomic_decoding","arguments":{"block_size":8}}</tool_call>'
                  "<dense><500><750><0><250><500><1000></dense>")
    np.testing.assert_allclose(coordinates(dense), [[0, 1, -2], [-1, 0, 2]], atol=1e-12)
    np.testing.assert_allclose(coordinates(dense, dense_scale=4.0), [[0, 2, -4], [-2, 0, 4]], atol=1e-12)


def test_dual_arm_atoms_each_give_coordinates():
    left, right = parse_answer(
        '<tool_call>{"name":"atomic_decoding","arguments":{"block_size":8}}</tool_call>'
        "<robot_left_2d><100><200></robot><robot_right_2d><300><400></robot>"
    )[0]
    np.testing.assert_allclose(coordinates(left), [[0.1, 0.2]])
    np.testing.assert_allclose(coordinates(right), [[0.3, 0.4]])
