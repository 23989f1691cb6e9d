"""Prepared token rows → Examples, stored as given (seed 003, "Prepared token rows").

"A run trains these rows as given. It does not render a chat template and does not apply a loss
policy": `input_ids` are kept as they are (int32) and `target_weights` is `loss_mask` as float32.
Meta: `format: prepared`, `source` (`ZIP/member`), `line` (the 1-based row of that file), `entry`.
The rows come checked from `data_pipeline.formats.prepared_load` (what is checked: see there).
"""

from __future__ import annotations

import numpy as np
from transformers import PreTrainedTokenizerBase

from data_pipeline import examples
from data_pipeline.formats.prepared_load import PreparedRow
from data_pipeline.shards import Example


class PreparedRenderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        # Nothing is rendered: the tokenizer is only the run's, recorded in the manifest by convert.
        self.tokenizer = tokenizer

    def render(self, row: PreparedRow, entry: str) -> Example:
        arrays = {"input_ids": row.input_ids.astype(np.int32),
                  "target_weights": row.loss_mask.astype(np.float32)}
        return examples.build(examples.TOKENS, arrays, format="prepared", source=row.source, line=row.line,
                              entry=entry)
