"""A model used as a grader (seed 003: `graderInstructions`; "Graders receive text").

The grader is any `generate(conversations) -> answers` over chat messages: in a run, another
workdir's (or the policy's reference's) decode engine, which renders them with its own chat
template; in tests, a scripted function. Each completion becomes one conversation: the system
message is `graderInstructions`, the user message holds the prompt, the completion and the gold
answer. The score is the first number in the grader's answer, which must lie in [0, 1]; an answer
with none scores 0 and is counted (`unparsed`), so a grader that stops answering shows in the
metrics rather than silently rewarding nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _text(messages: Sequence[Mapping]) -> str:
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages)


def grader_conversation(instructions: str, prompt: Sequence[Mapping], completion: str, gold: Mapping) -> list[dict]:
    user = (f"Prompt:\n{_text(prompt)}\n\nCompletion:\n{completion}\n\n"
            f"Gold answer:\n{gold.get('content')}\n\nScore (a number from 0 to 1):")
    return [{"role": "system", "content": instructions}, {"role": "user", "content": user}]


def parse_score(answer: str) -> float | None:
    match = _NUMBER.search(answer)
    if match is None:
        return None
    value = float(match.group())
    return value if 0.0 <= value <= 1.0 else None


def grade(generate: Callable[[list[list[dict]]], list[str]], instructions: str,
          items: Sequence[tuple[Sequence[Mapping], str, Mapping]]) -> tuple[list[float], int]:
    """Scores of (prompt, completion, gold) items in one batched call; (scores, unparsed count)."""
    if not instructions.strip():
        raise ValueError("config.rl.grader_instructions is empty: a model grader needs graderInstructions")
    answers = generate([grader_conversation(instructions, p, c, g) for p, c, g in items])
    if len(answers) != len(items):
        raise ValueError(f"the grader answered {len(answers)} of {len(items)} conversations")
    parsed = [parse_score(a) for a in answers]
    return [0.0 if s is None else s for s in parsed], sum(s is None for s in parsed)
