"""Rewards for reinforcement runs: a small registry chosen by name in the config.

Each reward reads the completion text and the gold answer (the row's assistant message, seed 003:
"uses the assistant message as the gold answer when the reward requires one") and returns a float
in [0, 1]. The definitions are evaluate's own (`evaluation.metrics.answer_match`,
`evaluation.metrics.chat`): one home per concept, no second copy of a metric.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

from valen_jax.evaluation.metrics.answer_match import answer_matches
from valen_jax.evaluation.metrics.chat import ToolCallError, canonical_json, normalise_call

Reward = Callable[[str, Mapping], float]


def exact(completion: str, gold: Mapping) -> float:
    return float(answer_matches(_gold_text(gold), completion)[0])


def normalised(completion: str, gold: Mapping) -> float:
    return float(answer_matches(_gold_text(gold), completion)[1])


def json_equal(completion: str, gold: Mapping) -> float:
    """1 when the completion and the gold answer parse to equal JSON values (evaluate's equality); a gold
    answer that is not JSON is the data's mistake, refused, not a reward of 0 for every completion."""
    try:
        reference = canonical_json(json.loads(_gold_text(gold)))
    except (ValueError, ToolCallError) as error:
        raise ValueError(f"reward 'json': the assistant message is not JSON ({error}): "
                         f"{_gold_text(gold)[:80]!r}") from None
    try:
        return float(canonical_json(json.loads(completion)) == reference)
    except (ValueError, ToolCallError):
        return 0.0  # an unparsable completion earns nothing


def tool_call(completion: str, gold: Mapping) -> float:
    """1 when the completion, a JSON list of calls, equals the gold message's tool_calls as a multiset."""
    refs = sorted(repr(normalise_call(c)) for c in gold.get("tool_calls") or [])
    try:
        calls = json.loads(completion)
        preds = sorted(repr(normalise_call(c)) for c in (calls if isinstance(calls, list) else [calls]))
    except (ValueError, ToolCallError):
        return 0.0
    return float(preds == refs)


def _gold_text(gold: Mapping) -> str:
    content = gold.get("content")
    if not isinstance(content, str):
        raise ValueError(f"the assistant message has no text content to use as the gold answer: {dict(gold)!r}")
    return content


REWARDS: dict[str, Reward] = {
    "exact": exact,
    "normalised": normalised,
    "json": json_equal,
    "tool_call": tool_call,
}  # issue 32's format reward (an answer in the dataset's answer format) is not built yet


def resolve(names_and_weights: Mapping[str, float]) -> list[tuple[str, Reward, float]]:
    """The configured rewards; an unknown name is one clear error naming the key."""
    out = []
    for name, weight in names_and_weights.items():
        if name not in REWARDS:
            raise ValueError(f"config.rl.rewards: unknown reward {name!r}; known: {sorted(REWARDS)}")
        out.append((name, REWARDS[name], float(weight)))
    return out


def score(rewards: Sequence[tuple[str, Reward, float]], completion: str, gold: Mapping) -> tuple[float, dict[str, float]]:
    """(weighted total, per-function values) — the per-function values are what is logged."""
    each = {name: fn(completion, gold) for name, fn, _ in rewards}
    return sum(w * each[name] for name, _, w in rewards), each
