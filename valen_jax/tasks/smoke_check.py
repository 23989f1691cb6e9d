"""Seed 003's smoke check of a reinforcement run: a few prompts end to end (render, sample, reward, one
update, a checkpoint written), the findings printed, and the run's workdir discarded.

    python -m valen_jax.train --config=configs/reinforce.py:tiny --workdir=/tmp/rl --smoke-check

The check trains in a temporary workdir (the given one is never written): one rollout of at most
`SMOKE_PROMPTS` prompts, one optimizer update, no evaluation. Refused, before any device is claimed, for
prepared rows ("An evaluation, a reinforcement run and a smoke check read prompts, which prepared rows do
not hold") and for a run that is not a reinforcement run (there is nothing to sample).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from valen_jax.errors import ConfigError
from valen_jax.reinforce.refusals import check_not_prepared
from valen_jax.tasks import reinforce
from valen_jax.tasks.modes import open_task, preflight
from valen_jax.training import loop

SMOKE_PROMPTS = 2


def smoke_config(config):
    """The run shrunk to one rollout of a few prompts and one update, nothing evaluated."""
    check_not_prepared(config, "a smoke check")
    if config.train.mode != reinforce.MODE:
        raise ConfigError(f"config.train.mode={config.train.mode!r}: a smoke check samples and rewards completions "
                          "of a reinforcement run (train.mode=reinforce)")
    smoke = config.copy_and_resolve_references()
    prompts = min(SMOKE_PROMPTS, int(config.rl.prompts_per_rollout))
    smoke.rl.prompts_per_rollout = smoke.data.global_batch = prompts
    smoke.rl.inner_steps = 1
    smoke.train.steps = smoke.train.checkpoint_every = smoke.train.log_every = 1
    smoke.train.warmup_steps = 0
    smoke.eval.every, smoke.eval.at_end = 0, False
    return smoke


def smoke_check(config) -> dict:
    """Run the smoke check of `config`; its findings (also what `format_findings` prints)."""
    smoke = smoke_config(config)
    workdir = Path(tempfile.mkdtemp(prefix="valen-smoke-check-"))
    try:
        result = loop.run(smoke, workdir / "run", open_task, preflight)
        records = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
        checkpoint_written = Path(result["checkpoint"]).is_dir()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    first = records[0]
    return {"prompts": int(smoke.rl.prompts_per_rollout), "completions_per_prompt": int(smoke.rl.group_size),
            "rewards": {k: v for k, v in first.items() if k.startswith("reward/")},
            "completion_length": first["completion_length/mean"], "loss": first["loss"],
            "zero_variance_groups": first["zero_variance_groups"], "checkpoint_written": checkpoint_written,
            "checkpoint_discarded": not workdir.exists(), "samples": result["rollout_samples"]}


def format_findings(findings: dict) -> str:
    lines = [f"smoke check: {findings['prompts']} prompts × {findings['completions_per_prompt']} completions "
             f"sampled, rewarded and trained one update (loss {findings['loss']:.4f})",
             *(f"  {name}: {value:.4f}" for name, value in sorted(findings["rewards"].items())),
             f"  completion length: {findings['completion_length']:.1f} tokens; groups with zero reward variance: "
             f"{findings['zero_variance_groups']:.2f}",
             f"  checkpoint written: {findings['checkpoint_written']}, discarded: {findings['checkpoint_discarded']}"]
    lines += [f"  sample: gold {s['gold']!r} completion {s['completion']!r} reward {s['reward']:.2f}"
              for s in findings["samples"]]
    return "\n".join(lines)
