"""VFlash training config (seed 004): the autoregressive target (`ar` mode), then its drafter (`vflash`).

    python -m valen_jax.train --config=configs/vflash.py --workdir=runs/vflash-smoke
    python -m valen_jax.train --config=configs/vflash.py:tiny --workdir=/tmp/t --config.train.steps=4
    python -m valen_jax.train --config=configs/vflash.py:tiny,drafter --workdir=/tmp/d --config.model.target_from=/tmp/t

Trains on `data/smoke/scenes/recipe.json` (the smoke recipe `data/smoke/vflash/recipe.json` plus 400
generated one-disc scenes) and evaluates on `data/smoke/scenes/eval_recipe.json` (the smoke `eval.jsonl`
and 16 held-out scenes); `tiny` and `hf` take the smoke recipe and `eval.jsonl` alone. Variants
after `:` (see configs/common.py): none = the CPU smoke run; `tiny` = the smallest model and a
few steps, for tests; `hf` = start from an HF checkpoint (directory or hub name). A VLM (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL) is imported whole, vision tower included; VFlash rows hold images, so a text
checkpoint is refused (seed 003: the base must accept images). Your own records (the four keys;
configs/common.py says more; `data.format` is `recipe`, so a VFlash JSONL also sets it to `vflash`):
    python -m valen_jax.train --config=configs/vflash.py:hf,lora --workdir=runs/mine \
        --config.model.init_from=PATH --config.data.tokenizer=PATH \
        --config.data.train=own_train.jsonl --config.data.format=vflash --config.data.eval=own_eval.jsonl
`drafter`, alone or after another variant (`:drafter`, `:tiny,drafter`): train.mode=vflash, a block
drafter (valen_jax/models/drafter.py) trained against the frozen target of an ar workdir, which
`--config.model.target_from=WORKDIR` must name; `tiny,drafter` takes blocks of 8 tokens and 16 anchors
per row.
"""

import sys
from pathlib import Path

import ml_collections

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # config files are loaded by path; make their sibling `common` importable
    sys.path.insert(0, str(ROOT))
from configs import common  # noqa: E402
from valen_jax.config.schema import defaults  # noqa: E402


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    # Vision patches per row (before merging): 2 images of 8×8 patches fit.
    data = common.data_group("recipe", "data/smoke/vflash/recipe.json", "data/smoke/vflash/eval.jsonl", "vflash",
                             seq_len=192, max_patches=128)
    config = common.base_config("vflash", data, vision=True)
    parts = [part for part in variant.split(",") if part] if variant else []
    drafter = "drafter" in parts
    rest = [part for part in parts if part != "drafter"]
    sizes = [part for part in rest if part not in common.ADAPTER_VARIANTS]
    if len(sizes) > 1 or parts.count("drafter") > 1:
        raise ValueError(f"configs/vflash.py: variant {variant!r}: at most one of tiny, hf, then optionally drafter")
    config = common.apply_variant(config, ",".join(rest), "configs/vflash.py")
    if not sizes:
        learns_to_look(config)
    return with_drafter(config, tiny=sizes == ["tiny"]) if drafter else config


def learns_to_look(config: ml_collections.ConfigDict) -> None:
    """The from-scratch smoke model's data and recipe for reading small objects in its image (issue 25;
    README "Localising small objects from scratch"). At 3e-3 with tied embeddings, Adam grows one shared direction
    in the embedding (its top singular value 1.5 -> 44 in 250 steps: every unused row gets a full-size step
    from a tiny softmax gradient) and in the MLPs, until the residual stream at the answer is a constant of
    norm ~700 beside an image-dependent part of 1e-3, and the decoder answers the training prior for good.
    A 1e-3 rate with an untied head keeps that residual at ~35 and lets the image through; coordinate rows
    with a Fourier code of their value and Gaussian coordinate targets (annealed 25 -> 3 tokens) let a
    hidden direction name a place, where one-hot targets over random rows train each of the 1001 values
    from the few records that hold it. The `tiny` and `hf` variants keep their own settings."""
    config.train.learning_rate = 1e-3
    # The bundled recipe plus 400 generated scenes (`data/smoke/scenes`: one disc in one of nine places)
    # and their 16 held-out ones beside the smoke eval set. The 96 smoke records alone cannot teach a
    # fresh model to ground a named object among others: it memorises them (README, issue 25). The
    # scenes are a task a model this size learns in a few hundred steps, so the run's report shows
    # whether it looks.
    config.data.train = str(common.ROOT / "data/smoke/scenes/recipe.json")
    config.data.eval = str(common.ROOT / "data/smoke/scenes/eval_recipe.json")
    config.data.eval_format = "recipe"
    config.train.steps = 600
    config.model.tie_embeddings = False
    config.model.coordinate_embeddings = "fourier"
    # The tower at the decoder's rate (the schema's 0.1 is for towers without standardise_pixels, ours before
    # issue 55 and the imported ones): with each image's pixels standardised the tower's gradients are no longer
    # the near rank-one background push that made the full rate collapse its tokens (issue 25), and at a tenth
    # a fresh tower could not learn where a radius-3 ball sits inside its 16-px token in 1,500 steps (issue 55's
    # clutter scenes: point accuracy 0.25 at 0.1, 1.00 at 1.0; benchmarks/vision_learning.py).
    config.train.vision_lr_multiplier = 1.0
    config.loss.coordinate_sigma = 25.0
    config.loss.coordinate_sigma_final = 3.0


def with_drafter(config: ml_collections.ConfigDict, tiny: bool) -> ml_collections.ConfigDict:
    """Seed 004's `vflash` training mode: the drafter alone trains; the target comes from model.target_from."""
    config.train.mode = "vflash"
    config.model.target_from = ml_collections.config_dict.placeholder(str)
    config.model.drafter = defaults("drafter")  # a fresh group: the drafter's defaults, whatever came before
    config.loss.weights = {"tokens": 0.0, "branches": 0.0, "drafter": 1.0}
    # Evaluating a drafter means speculative decoding (issue 16's second half), not the target's metrics.
    config.eval.every = 0
    config.eval.at_end = False
    if tiny:
        config.model.drafter.block_size = 8
        config.model.drafter.anchors_per_row = 16
        config.model.drafter.position_decay = 4.0  # DFlash's value for blocks of 8
    return config
