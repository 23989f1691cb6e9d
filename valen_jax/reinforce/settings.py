"""The `config.rl` group of a reinforcement run, its checks, the rollout seeds and the rollout metrics.

Not yet wired into config_schema or a `train.mode`: `defaults()` is what the group will hold, and
`check` refuses a bad value with one line naming the key, before anything claims a device.
Rollout seeds are a pure function of (seed, step, row), so a resumed run — which restores its step
— draws the same completions as an uninterrupted one without saving any sampler state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ml_collections
import numpy as np

from valen_jax.errors import ConfigError
from valen_jax.reinforce.rewards import REWARDS


def defaults() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({
        "group_size": 8,          # G completions per prompt
        "prompts_per_rollout": 8,  # prompts sampled per rollout batch
        "inner_steps": 2,         # optimizer steps per rollout batch (old log-probs from rollout time)
        "clip_epsilon": 0.2,
        "kl_coef": 0.0,           # > 0 keeps a frozen reference (the starting checkpoint)
        "scale_by_std": True,     # GRPO's advantage scaling; False is Dr.GRPO's
        "max_new_tokens": 16,
        "temperature": 1.0,
        "seed": 0,
        "rewards": {"exact": 1.0},  # name -> explicit weight
        "grader_instructions": "",
    })


def check(rl) -> None:
    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"config.rl.{key}={rl[key]!r}: {why}")

    for key in ("group_size", "prompts_per_rollout", "inner_steps", "max_new_tokens"):
        need(isinstance(rl[key], int) and rl[key] >= 1, key, "must be an integer >= 1")
    need(rl.group_size >= 2, "group_size", "group-relative advantages need at least 2 completions per prompt")
    need(0.0 < rl.clip_epsilon < 1.0, "clip_epsilon", "must lie in (0, 1)")
    need(rl.kl_coef >= 0.0, "kl_coef", "must be >= 0")
    need(rl.temperature > 0.0, "temperature", "sampling needs a temperature > 0 (0 would draw G equal completions)")
    need(hasattr(rl.rewards, "items") and len(rl.rewards) > 0, "rewards", "name at least one reward")
    for name, weight in rl.rewards.items():
        if name not in REWARDS and name != "grader":
            raise ConfigError(f"config.rl.rewards.{name}: unknown reward; known: {sorted(REWARDS) + ['grader']}")
        if not isinstance(weight, (int, float)):
            raise ConfigError(f"config.rl.rewards.{name}={weight!r}: a weight is a number")
    if "grader" in rl.rewards:
        need(bool(str(rl.grader_instructions).strip()), "grader_instructions",
             "the grader reward needs graderInstructions")


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
