"""Reinforcement run config (issue 32, seed 003): G sampled completions per prompt of chat rows, rewarded
against the assistant message, trained with the group-relative clipped objective (train.mode=reinforce).

    python data/rl_arith/make.py data/rl_arith/digits --max-operand 10   # the task (committed output)
    python -m valen_jax.train --config=configs/reinforce.py:tiny --workdir=/tmp/rl
    python -m valen_jax.train --config=configs/reinforce.py --workdir=runs/rl --config.rl.from_workdir=runs/sft
    python -m valen_jax.train --config=configs/reinforce.py:tiny --workdir=/tmp/rl --smoke-check

Trains on `data/rl_arith/digits/train.jsonl` (sums and differences of two or three one-digit numbers),
evaluates `answer_exact_match` on the disjoint `data/rl_arith/digits/eval.jsonl` at the end. `:sft` is the supervised run on the same rows (train.mode=ar)
that a reinforcement run starts from (`--config.rl.from_workdir=WORKDIR`); `:tiny` the smallest model
and a few rollouts, for tests. config.data.global_batch is config.rl.prompts_per_rollout (one batch of
the data stream is one rollout's prompts).
"""

import sys
from pathlib import Path

import ml_collections

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # config files are loaded by path; make their sibling `common` importable
    sys.path.insert(0, str(ROOT))
from configs import common  # noqa: E402
from valen_jax.config.schema import defaults  # noqa: E402


def _small_model(config: ml_collections.ConfigDict) -> None:
    # Small enough to train supervised and then by reinforcement on two CPU cores in minutes.
    config.model.dim = 128
    config.model.num_layers = 2
    config.model.num_heads = 4
    config.model.num_kv_heads = 2
    config.model.head_dim = 32
    config.model.mlp_dim = 256


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    parts = [part for part in variant.split(",") if part] if variant else []
    sft = "sft" in parts
    rest = ",".join(part for part in parts if part != "sft")
    data = common.data_group("chat", "data/rl_arith/digits/train.jsonl", "data/rl_arith/digits/eval.jsonl", "chat",
                             seq_len=24, max_patches=0, global_batch=64)
    config = common.base_config("reinforce", data, vision=False)
    _small_model(config)
    config.eval.max_examples = 200
    config.eval.batch_size = 200
    config.eval.max_new_tokens = 8
    config.eval.every = 0
    if sft:
        config.data.seq_len = 32  # packed supervised rows (the README's p0 was measured with these)
        config.train.steps = 250
        config.train.checkpoint_every = 250
        config.train.log_every = 50
        config.train.warmup_steps = 20
        config.train.learning_rate = 3e-3
        return common.apply_variant(config, rest, "configs/reinforce.py")
    config.train.mode = "reinforce"
    # 64 prompts × 8 completions a rollout: with a start that answers ~1 in 5 eval prompts, enough of the
    # 512 completions earn a reward for a steady gradient (16 prompts gave a handful, and no lift).
    config.rl = defaults("rl", group_size=8, prompts_per_rollout=64, inner_steps=2, max_new_tokens=5,
                         temperature=1.0, rewards={"exact": 1.0})
    config.train.steps = 200
    config.train.checkpoint_every = 40
    config.train.log_every = 2
    config.train.warmup_steps = 2
    # Adam moves every weight by about the learning rate whatever the gradient's size: at 2e-3 (the SFT
    # run's order) the noisy policy gradient of fresh prompts each rollout wore the start down (train
    # reward 0.13 -> 0.07 in 24 rollouts); 5e-4 climbs.
    config.train.learning_rate = 5e-4
    config.train.end_learning_rate_fraction = 1.0
    config = common.apply_variant(config, rest, "configs/reinforce.py")
    if "tiny" in parts:
        config.rl.prompts_per_rollout = config.data.global_batch = 4
        config.rl.group_size = 4
        config.rl.max_new_tokens = 4
        config.eval.at_end = False
        config.eval.max_examples = 8
        config.eval.batch_size = 8
    return config
