"""Valen scored-question training config (seed 000): a scalar head scores each candidate branch;
soft labels train the softmax over a question's branches.

    python -m valen_jax.train --config=configs/valen.py --workdir=runs/valen-smoke
    python -m valen_jax.train --config=configs/valen.py:tiny --workdir=/tmp/t --config.data.valen_mode=shared_state

`data.valen_mode` picks `question` (the state once, one branch per candidate, branches isolated
by the attention mask) or `shared_state` (every candidate in one sequence); `loss.loss_reduction`
picks `state_mean` (seed default) or `question_mean`. Variants as in configs/common.py; `hf` starts
from an HF checkpoint (directory or hub name): a VLM (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) is imported
whole, vision tower included; a text model gives the decoder and no vision tower (its rows must be
text: media rows are refused, naming PATH:LINE). Own files: the four keys of configs/common.py:
    --config=configs/valen.py:hf --config.model.init_from=PATH --config.data.tokenizer=PATH

Row limits (seed 000): a Valen row is one record, never packed, so `data.packing` other than
`none`, `loss.z_loss` > 0 and `loss.weights.tokens` > 0 are refused at start-up; `data.overlong=skip`
drops records whose row exceeds `seq_len`, `max_questions`, `max_candidates` or `max_patches`. The
whole training set is checked once at start-up and the smallest limits that fit it are logged
(valen_jax/data/valen_fit.py).
"""

import sys
from pathlib import Path

import ml_collections

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # config files are loaded by path; make their sibling `common` importable
    sys.path.insert(0, str(ROOT))
from configs import common  # noqa: E402

BRANCHES_ONLY = {"tokens": 0.0, "branches": 1.0, "drafter": 0.0}


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    # Train on the 6 smoke records (text, image and video); evaluate on 4 held-out records of other
    # group_ids (seed 003: train and eval kept apart; the run checks it before compiling).
    data = common.data_group("valen", "data/smoke/valen/train.jsonl", "data/smoke/valen/eval.jsonl", "valen",
                             seq_len=256, max_patches=256, global_batch=4)
    data.max_questions = 4
    data.max_candidates = 8
    config = common.base_config("valen", data, vision=True, loss_weights=BRANCHES_ONLY)
    config.media_kwargs.max_frames = 4
    config.train.steps = 60
    config.train.checkpoint_every = 30
    config.train.log_every = 10
    config.train.learning_rate = 1e-3
    config.eval.every = 0
    return common.apply_variant(config, variant, "configs/valen.py")
