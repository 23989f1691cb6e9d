"""Chat JSONL training config (seed 003): conversations with tool calls and images, trained on
every assistant turn (converter option `assistant_turns`).

    python -m valen_jax.train --config=configs/chat.py --workdir=runs/chat-smoke
    python -m valen_jax.train --config=configs/chat.py:tiny --workdir=/tmp/t --config.train.steps=4

Trains on `data/smoke/chat/train.jsonl`, evaluates on `data/smoke/chat/eval.jsonl`. Variants
after `:` (see configs/common.py): none = the CPU smoke run; `tiny` = the smallest model, for
tests; `hf` = start from an HF checkpoint (directory or hub name). A VLM (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL) is imported whole, vision tower included; a text model (Qwen2, Qwen3, Llama) gives the
decoder and no vision tower, so its rows must be text (image rows are refused, naming PATH:LINE).
`--config.model.vision=None` trains a text model from scratch.

Your own conversations, from a hub checkpoint (the four keys; configs/common.py says more):
    python -m valen_jax.train --config=configs/chat.py:hf,lora --workdir=runs/mine \
        --config.model.init_from=PATH --config.data.tokenizer=PATH \
        --config.data.train=own_train.jsonl --config.data.eval=own_eval.jsonl
"""

import sys
from pathlib import Path

import ml_collections

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # config files are loaded by path; make their sibling `common` importable
    sys.path.insert(0, str(ROOT))
from configs import common  # noqa: E402


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    data = common.data_group("chat", "data/smoke/chat/train.jsonl", "data/smoke/chat/eval.jsonl", "chat",
                             seq_len=512, max_patches=128, train_options={"assistant_turns": "all"},
                             eval_options={"assistant_turns": "all"})
    # The generated smoke eval.jsonl repeats two training rows (train.jsonl:6 and :32, one with its image):
    # known overlap, trained anyway and recorded (valen_jax/data/separation.py) until data/make_chat_smoke.py
    # draws eval rows apart from train's.
    data.allow_overlap = True
    config = common.base_config("chat", data, vision=True)
    return common.apply_variant(config, variant, "configs/chat.py")
