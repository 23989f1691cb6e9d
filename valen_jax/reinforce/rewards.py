"""Rewards for reinforcement runs: a small registry chosen by name in the config.

Each reward reads the completion text and the gold answer (the row's assistant message, seed 003:
"uses the assistant message as the gold answer when the reward requires one") and returns a float
in [0, 1]. The definitions are evaluate's own (`evaluation.metrics.answer_match`,
`evaluation.metrics.chat`, `evaluation.chat.parse_tool_calls`): one home per concept, no second copy
of a metric.

The registry's rewards are called as `fn(completion, gold, finished)`: `finished` says whether the
completion ended with the end-of-turn token within config.rl.max_new_tokens (the sampler knows it;
the decoded text has the token removed). Only `format` reads it; the others are wrapped to ignore it.
`resolve` binds the chat template's family (`template_family` of the run's tokenizer) into the two
rewards that read tool calls, so a completion's calls are parsed as `evaluate` parses that family's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence

from valen_jax.evaluation.chat import parse_tool_calls
from valen_jax.evaluation.metrics.answer_match import answer_matches
from valen_jax.evaluation.metrics.chat import ToolCallError, canonical_json, match_calls, normalise_call

Reward = Callable[[str, Mapping, bool | None], float]  # (completion, gold, finished) -> value


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


def tool_call(completion: str, gold: Mapping, family: str | None = "chatml") -> float:
    """evaluate's tool-call exact match: the calls the completion makes (parsed as `evaluate` parses the
    template family's) equal the gold message's tool_calls, position by position (`match_calls`)."""
    return match_calls(gold.get("tool_calls") or [], parse_tool_calls(completion, family))[-1]


def answer_format(completion: str, gold: Mapping, finished: bool | None, family: str | None = "chatml") -> float:
    """1 when the completion has the form of an answer of the gold message's kind, whatever its content.

    "Format" of a chat answer in this stack: the model closed its turn (the end-of-turn token within
    the completion budget: `finished`), and
    - a gold message with tool calls: the completion holds at least one call and every call is a
      readable one, parsed as evaluate parses the template family's calls (`parse_tool_calls`: ChatML
      `<tool_call>` blocks, Llama 3's JSON object) with JSON that `normalise_call` accepts (a name and
      JSON arguments);
    - a gold text that is a JSON object or array: the completion parses as JSON;
    - any other gold text: the completion is not empty (blank) text and makes no tool call.
    Correctness is the other rewards' business; this one rewards closing the turn in the expected shape
    (DeepSeek-R1's format reward, read for this stack's chat answers)."""
    if finished is None:
        raise ValueError("reward 'format': whether the completion closed its turn was not recorded "
                         "(`rollout.sample` records it)")
    if not finished:
        return 0.0
    calls = gold.get("tool_calls") or []
    if calls:
        made = parse_tool_calls(completion, family)
        try:
            return float(bool(made) and all(normalise_call(c) for c in made))
        except ToolCallError:
            return 0.0
    text = _gold_text(gold).strip()
    if text[:1] in ("{", "["):
        try:
            json.loads(text)
        except ValueError:
            text = ""  # gold text that only looks like JSON: judged as plain text below
        else:
            try:
                json.loads(completion)
            except ValueError:
                return 0.0
            return 1.0
    return float(bool(completion.strip()) and not parse_tool_calls(completion, family))


def _content_only(fn: Callable[[str, Mapping], float]) -> Reward:
    def reward(completion: str, gold: Mapping, finished: bool | None) -> float:
        return fn(completion, gold)

    return functools.update_wrapper(reward, fn.func if isinstance(fn, functools.partial) else fn)


def _gold_text(gold: Mapping) -> str:
    content = gold.get("content")
    if not isinstance(content, str):
        raise ValueError(f"the assistant message has no text content to use as the gold answer: {dict(gold)!r}")
    return content


# name -> the reward given the template family (only the tool-call readers use it)
REWARDS: dict[str, Callable[[str | None], Reward]] = {
    "exact": lambda family: _content_only(exact),
    "normalised": lambda family: _content_only(normalised),
    "json": lambda family: _content_only(json_equal),
    "tool_call": lambda family: _content_only(functools.partial(tool_call, family=family)),
    "format": lambda family: functools.partial(answer_format, family=family),
}


def resolve(names_and_weights: Mapping[str, float], family: str | None = "chatml") -> list[tuple[str, Reward, float]]:
    """The configured rewards for a run whose chat template is of `family`; an unknown name is one
    clear error naming the key."""
    out = []
    for name, weight in names_and_weights.items():
        if name not in REWARDS:
            raise ValueError(f"config.rl.rewards: unknown reward {name!r}; known: {sorted(REWARDS)}")
        out.append((name, REWARDS[name](family), float(weight)))
    return out


def score(rewards: Sequence[tuple[str, Reward, float]], completion: str, gold: Mapping,
          finished: bool) -> tuple[float, dict[str, float]]:
    """(weighted total, per-function values) — the per-function values are what is logged."""
    each = {name: fn(completion, gold, finished) for name, fn, _ in rewards}
    return sum(w * each[name] for name, _, w in rewards), each
