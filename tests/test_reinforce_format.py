"""The `format` reward (issue 32): a completion in the shape of the gold message's kind of answer, its turn
closed within the budget, whatever its content; against hand-written completions."""

import numpy as np
import pytest

from valen_jax.reinforce.rewards import REWARDS, answer_format
from valen_jax.reinforce.rollout import Rollout, score

TEXT = {"role": "assistant", "content": "10", "tool_calls": []}
JSON = {"role": "assistant", "content": '{"unit": "km", "value": 3}', "tool_calls": []}
CALL = {"role": "assistant", "content": "", "tool_calls": [{"name": "convert", "arguments": {"km": 3}}]}
CHATML_CALL = '<tool_call>\n{"name": "convert", "arguments": {"km": 3}}\n</tool_call>'


@pytest.mark.parametrize("completion, gold, finished, expected", [
    ("10", TEXT, True, 1.0),
    ("11", TEXT, True, 1.0),  # wrong but well formed: correctness is the other rewards' business
    ("10", TEXT, False, 0.0),  # ran out of budget before closing the turn
    ("  \n", TEXT, True, 0.0),  # blank
    (CHATML_CALL, TEXT, True, 0.0),  # a call where a text answer belongs
    ('{"value": 3, "unit": "m"}', JSON, True, 1.0),  # parses as JSON (unequal: still the format)
    ('{"value": 3,', JSON, True, 0.0),
    ("three km", JSON, True, 0.0),
    (CHATML_CALL, CALL, True, 1.0),
    ('<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>', CALL, True, 1.0),
    (CHATML_CALL, CALL, False, 0.0),
    ('<tool_call>\n{"name": "convert"}\n</tool_call>', CALL, True, 0.0),  # no arguments: not a readable call
    ('<tool_call>\n{"name": "convert", "arguments": {"km": 3}\n</tool_call>', CALL, True, 0.0),  # broken JSON
    (CHATML_CALL + '\n<tool_call>\n{"name": "convert", "argu', CALL, True, 0.0),  # a call never closed
    ("I would convert 3 km", CALL, True, 0.0),  # text where a call belongs
])
def test_format_against_hand_written_completions(completion, gold, finished, expected):
    assert answer_format(completion, gold, finished) == expected
    assert REWARDS["format"]("chatml")(completion, gold, finished) == expected


def test_the_registry_calls_every_reward_with_finished_and_only_format_reads_it():
    assert REWARDS["exact"]("chatml")("10", TEXT, False) == 1.0  # an unfinished exact answer is still exact
    assert REWARDS["format"]("chatml")("10", TEXT, False) == 0.0
    with pytest.raises(ValueError, match="reward 'format': whether the completion closed its turn"):
        answer_format("10", TEXT, None)


def test_score_reads_finished_from_the_rollout():
    prompts = [{"ids": np.array([1, 2]), "positions": np.arange(2)}]
    rollout = Rollout(prompts, [TEXT], [[5, 2], [5, 6, 7]], ["10", "106"], finished=[True, False])
    totals, each = score(rollout, {"exact": 1.0, "format": 0.5}, group_size=2)
    assert each == {"exact": [1.0, 0.0], "format": [1.0, 0.0]}
    np.testing.assert_allclose(totals, [1.5, 0.0])
    unrecorded = Rollout(prompts, [TEXT], [[5, 2], [5, 6, 7]], ["10", "106"])
    assert score(unrecorded, {"exact": 1.0}, group_size=2)[1] == {"exact": [1.0, 0.0]}
    with pytest.raises(ValueError, match="reward 'format'"):
        score(unrecorded, {"format": 1.0}, group_size=2)
