"""Prepared token rows training config (seed 003, "Prepared token rows"): rows that are already
token ids with a loss mask, trained as given (no chat template, no loss policy).

    python -m valen_jax.train --config=configs/prepared.py --workdir=runs/prepared-smoke
    python -m valen_jax.train --config=configs/prepared.py:tiny --workdir=/tmp/t --config.train.steps=4

Trains on `data/smoke/prepared/train.zip` and validates on `eval.zip` (made from the chat smoke
set by data/make_prepared_smoke.py). Before any device is claimed the run is refused when the
rows were prepared with another tokenizer (digests; repository and commit where the base model
names them), when the longest row exceeds `data.seq_len`, or when only one of the two sets is
prepared (valen_jax/data/prepared_checks.py). There is no end-of-run evaluation report: an
evaluation reads prompts, which prepared rows do not hold (seed 003); `eval.every` gives the
validation loss. Variants after `:` (see configs/common.py): none = the CPU smoke run; `tiny` =
the smallest model, for tests; `hf` = the decoder from an HF checkpoint, whose tokenizer must be
the one the rows were prepared with:
    --config=configs/prepared.py:hf --config.model.init_from=PATH --config.data.tokenizer=PATH \\
        --config.data.train=ROWS.zip --config.data.eval=ROWS.zip
"""

import sys
from pathlib import Path

import ml_collections

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # config files are loaded by path; make their sibling `common` importable
    sys.path.insert(0, str(ROOT))
from configs import common  # noqa: E402


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    # The smoke rows reach 470 tokens (tool declarations in the system turn); no media, no patches.
    data = common.data_group("prepared", "data/smoke/prepared/train.zip", "data/smoke/prepared/eval.zip",
                             "prepared", seq_len=512, max_patches=0, global_batch=8)
    # Made from the chat smoke rows, whose eval repeats a training row (see configs/chat.py): recorded overlap.
    data.allow_overlap = True
    config = common.base_config("prepared", data, vision=False)
    config = common.apply_variant(config, variant, "configs/prepared.py")
    config.eval.at_end = False  # no prompts to evaluate (see the docstring); validation loss via eval.every
    return config
