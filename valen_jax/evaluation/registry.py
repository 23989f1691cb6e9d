"""The one table of evaluators, keyed by the family of records the data holds (the `family` of its
format in `data_pipeline.format_registry`: `vflash` for both vflash and recipe shards).

Each family's module defines `evaluate(restored, examples, options) -> dict` (its part of the
report) and `summary(report) -> str` (the line the CLI prints); `evaluate.run` and
`evaluate.summary` look the family up here instead of branching on it. Adding an evaluated family
adds one row; a family without a row (prepared token rows) is refused with the list of those with one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from valen_jax.errors import EvaluationError
from valen_jax.evaluation import chat, valen, vflash
from valen_jax.evaluation.options import Options  # noqa: F401  (its home is the leaf; still importable from here)


@dataclass(frozen=True)
class Evaluator:
    evaluate: Callable  # (ModelRun, list[Example], Options) -> dict, the report's kind-specific part
    summary: Callable[[dict], str]  # one line for the CLI, from the finished report
    # Valen questions are scored by the model's scalar head, which only a Valen run trains.
    needs_score_head: bool = False


EVALUATORS: dict[str, Evaluator] = {
    "valen": Evaluator(valen.evaluate, valen.summary, needs_score_head=True),
    "vflash": Evaluator(vflash.evaluate, vflash.summary),
    "chat": Evaluator(chat.evaluate, chat.summary),
    "vakforge": Evaluator(chat.evaluate, chat.summary),  # chat rows with locale/source breakdowns
}


def evaluator_for(family: str, where: str = "data") -> Evaluator:
    """The evaluator of `family` records; `where` (the data path) goes into the error."""
    try:
        return EVALUATORS[family]
    except KeyError:
        raise EvaluationError(f"{where}: no evaluation defined for {family!r} data; evaluated: "
                         f"{', '.join(sorted(EVALUATORS))}") from None
