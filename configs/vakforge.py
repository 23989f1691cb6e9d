"""Vakforge training config (seed 002): the turn-based text adapter (cascaded STT→LLM→TTS), so the
model is text-only; conversations of splits.json's `train` split train, `dev` evaluates.

    python -m valen_jax.train --config=configs/vakforge.py --workdir=runs/vakforge-smoke
    python -m valen_jax.train --config=configs/vakforge.py:tiny --workdir=/tmp/t --config.train.steps=4

Reads `data/smoke/vakforge/vakforge.jsonl` (beside its splits.json); overlapping turns are
merged (converter option `overlap`). Variants after `:` (see configs/common.py): none = the CPU
smoke run; `tiny` = the smallest model, for tests; `hf` = the decoder from an HF checkpoint:
    --config=configs/vakforge.py:hf --config.model.init_from=PATH --config.data.tokenizer=PATH
"""

import sys
from pathlib import Path

import ml_collections

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # config files are loaded by path; make their sibling `common` importable
    sys.path.insert(0, str(ROOT))
from configs import common  # noqa: E402

VAKFORGE = "data/smoke/vakforge/vakforge.jsonl"


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    # The smoke conversations reach ~990 tokens; audio is not embedded, so no vision patches.
    data = common.data_group("vakforge", VAKFORGE, VAKFORGE, "vakforge", seq_len=1024, max_patches=0,
                             global_batch=8, train_options={"split": "train", "overlap": "merge"},
                             eval_options={"split": "dev", "overlap": "merge"})
    config = common.base_config("vakforge", data, vision=False)
    return common.apply_variant(config, variant, "configs/vakforge.py")
