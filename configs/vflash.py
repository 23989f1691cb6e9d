"""VFlash training config (seed 004): primitives answered autoregressively (`ar` mode).

    python -m valen_jax.train --config=configs/vflash.py --workdir=runs/vflash-smoke
    python -m valen_jax.train --config=configs/vflash.py:tiny --workdir=/tmp/t --config.train.steps=4

Trains on the recipe `data/smoke/vflash/recipe.json` and evaluates on `eval.jsonl`. Variants
after `:` (see configs/common.py): none = the CPU smoke run; `tiny` = the smallest model and a
few steps, for tests; `hf` = start from an HF checkpoint (directory or hub name). A VLM (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL) is imported whole, vision tower included; a text model gives the decoder and
the vision tower starts fresh from config.model.vision:
    --config=configs/vflash.py:hf --config.model.init_from=PATH --config.data.tokenizer=PATH
"""

import sys
from pathlib import Path

import ml_collections

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # config files are loaded by path; make their sibling `common` importable
    sys.path.insert(0, str(ROOT))
from configs import common  # noqa: E402


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    # Vision patches per row (before merging): 2 images of 8×8 patches fit.
    data = common.data_group("recipe", "data/smoke/vflash/recipe.json", "data/smoke/vflash/eval.jsonl", "vflash",
                             seq_len=192, max_patches=128)
    config = common.base_config("vflash", data, vision=True)
    return common.apply_variant(config, variant, "configs/vflash.py")
