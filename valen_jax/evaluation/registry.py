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

from valen_jax.evaluation import chat, valen, vflash


@dataclass(frozen=True)
class Options:
    """What a caller may choose about one evaluation; every evaluator takes all of it and reads
    what concerns its kind (`mode` is Valen's, the decoding budget is the token kinds')."""

    batch_size: int
    max_new_tokens: int
    mode: str | None = None  # Valen sequence mode; None: the checkpoint's data.valen_mode
    samples: int | None = 8  # decoded answers listed in the report; None: all
    # Answer again with each record's images swapped for another's (`image_reliance`): one more decoding
    # of the image records; evaluation during training, which reports no answers, leaves it off.
    image_reliance: bool = True


@dataclass(frozen=True)
class Evaluator:
    evaluate: Callable  # (Restored, list[Example], Options) -> dict, the report's kind-specific part
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
        raise ValueError(f"{where}: no evaluation defined for {family!r} data; evaluated: "
                         f"{', '.join(sorted(EVALUATORS))}") from None
