"""The `config.rl` group of a reinforcement run: its checks, the rollout seeds and the rollout metrics.

The group's keys and defaults are the schema's (`valen_jax.config.schema._rl`, validated with every
config); `check_run` refuses a bad value with one line naming the key, before anything claims a device.
Rollout seeds are a pure function of (seed, step, row), so a resumed run — which restores its step
— draws the same completions as an uninterrupted one without saving any sampler state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ml_collections
import numpy as np

from valen_jax.config.schema import defaults as schema_defaults
from valen_jax.errors import ConfigError
from valen_jax.reinforce.rewards import REWARDS

GRADER = "grader"  # the model-grader reward's name in config.rl.rewards


def defaults() -> ml_collections.ConfigDict:
    """A fresh config.rl group with the schema's defaults."""
    return schema_defaults("rl")


def check(rl) -> None:
    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"config.rl.{key}={rl[key]!r}: {why}")

    for key in ("group_size", "prompts_per_rollout", "inner_steps", "max_new_tokens", "gold_bytes",
                "grader_max_new_tokens"):
        need(isinstance(rl[key], int) and rl[key] >= 1, key, "must be an integer >= 1")
    need(rl.group_size >= 2, "group_size", "group-relative advantages need at least 2 completions per prompt")
    need(0.0 < rl.clip_epsilon < 1.0, "clip_epsilon", "must lie in (0, 1)")
    need(rl.kl_coef >= 0.0, "kl_coef", "must be >= 0")
    need(rl.temperature > 0.0, "temperature", "sampling needs a temperature > 0 (0 would draw G equal completions)")
    need(0.0 < rl.top_p <= 1.0, "top_p", "must lie in (0, 1] (1 turns it off)")
    need(hasattr(rl.rewards, "items") and len(rl.rewards) > 0, "rewards", "name at least one reward")
    for name, weight in rl.rewards.items():
        if name not in REWARDS and name != GRADER:
            raise ConfigError(f"config.rl.rewards.{name}: unknown reward; known: {sorted(REWARDS) + [GRADER]}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"config.rl.rewards.{name}={weight!r}: a weight is a number")
    if GRADER in rl.rewards:
        need(bool(str(rl.grader_instructions).strip()), "grader_instructions",
             "the grader reward needs graderInstructions")


def check_run(config) -> None:
    """`check(config.rl)` and how it fits the rest of the config: the data stream's batch is one rollout's
    prompts, and a prompt and its completion are one training row of config.data.seq_len tokens."""
    rl = config.rl
    check(rl)
    if int(config.data.global_batch) != int(rl.prompts_per_rollout):
        raise ConfigError(f"config.data.global_batch={config.data.global_batch} must equal config.rl."
                          f"prompts_per_rollout={rl.prompts_per_rollout}: each batch of the data stream is one "
                          "rollout's prompts")
    if int(rl.max_new_tokens) >= int(config.data.seq_len):
        raise ConfigError(f"config.rl.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt in "
                          f"config.data.seq_len={config.data.seq_len} (a prompt and its completion are one row)")
    if int(config.train.grad_accum_steps) != 1:
        raise ConfigError(f"config.train.grad_accum_steps={config.train.grad_accum_steps}: a reinforcement run "
                          "updates on whole rollout batches (set 1; lower rl.prompts_per_rollout for memory)")


def rollout_seed(seed: int, step: int) -> int:
    """The decode engine's seed for rollout `step` (a row's stream then folds in its completion index)."""
    return int(rollout_seeds(seed, step, 1)[0])


def rollout_seeds(seed: int, step: int, count: int) -> np.ndarray:
    """One uint32 sampling seed per completion of rollout `step`, independent of host and history."""
    return np.random.default_rng([seed, step]).integers(0, 2**32, size=count, dtype=np.uint32)


def rollout_metrics(per_function: Mapping[str, Sequence[float]], totals: Sequence[float], advantages,
                    lengths: Sequence[int], group_size: int) -> dict[str, float]:
    """Reward mean/std per function, advantage statistics, completion length and the fraction of
    groups whose rewards have zero variance (they give no gradient)."""
    out = {}
    for name, values in per_function.items():
        v = np.asarray(values, np.float64)
        out[f"reward/{name}/mean"], out[f"reward/{name}/std"] = float(v.mean()), float(v.std())
    t = np.asarray(totals, np.float64)
    a = np.asarray(advantages, np.float64)
    out.update({"reward/mean": float(t.mean()), "reward/std": float(t.std()),
                "advantage/mean": float(a.mean()), "advantage/std": float(a.std()),
                "advantage/abs_max": float(np.abs(a).max()),
                "completion_length/mean": float(np.mean(lengths)),
                "zero_variance_groups": float((t.reshape(-1, group_size).std(axis=1) == 0).mean())})
    return out
