"""What a caller may choose about one evaluation (`Options`), in a leaf of `evaluation`.

Every evaluator takes it (`registry.EVALUATORS`), and the registry imports the evaluators: the
options live here so the evaluators (chat, valen, vflash, image_reliance, speculative) and the
registry read them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


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
