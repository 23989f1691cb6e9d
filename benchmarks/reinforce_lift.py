"""Issue 32's evidence: a tiny model trained supervised on the one-digit arithmetic task to an eval
`answer_exact_match` p0, then a reinforcement run from that workdir, and the eval figure it reaches.

    .venv/bin/python benchmarks/reinforce_lift.py --out runs/rl-lift        # ≈ 25 min on 2 shared CPU cores
    .venv/bin/python benchmarks/reinforce_lift.py --out /tmp/l --sft-steps 20 --rl-steps 4   # the script works

Both runs are `python -m valen_jax.train` on `configs/reinforce.py` (`:sft`, train.mode=ar; then the
reinforcement run with `--config.rl.from_workdir`), on `data/rl_arith/digits` (made by
`data/rl_arith/make.py data/rl_arith/digits --max-operand 10`, train and eval disjoint); p0 and p1 are
the `answer_exact_match` of their end-of-run evaluation reports (greedy decoding of all 200 eval
prompts through `evaluate`'s code). Prints the reward curve (mean reward of the sampled completions,
per tenth of the run). Last line: `p0=X p1=Y lift=Z`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/reinforce.py"


def train(workdir: Path, variant: str, *overrides: str) -> dict:
    command = [sys.executable, "-m", "valen_jax.train", f"--config={CONFIG}{variant}", f"--workdir={workdir}",
               *overrides]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    reports = sorted((workdir / "eval").glob("report-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return json.loads(reports[-1].read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sft-steps", type=int, default=250)
    parser.add_argument("--rl-steps", type=int, default=200)
    parser.add_argument("rl_overrides", nargs="*", help="more --config.… overrides of the reinforcement run")
    args = parser.parse_args()
    sft, rl = args.out / "sft", args.out / "rl"
    p0 = train(sft, ":sft", f"--config.train.steps={args.sft_steps}",
               f"--config.train.checkpoint_every={args.sft_steps}")["answer_exact_match"]
    print(f"supervised: eval answer_exact_match p0={p0:.3f}", flush=True)
    p1 = train(rl, "", f"--config.rl.from_workdir={sft}", f"--config.train.steps={args.rl_steps}",
               f"--config.train.checkpoint_every={args.rl_steps}", *args.rl_overrides)["answer_exact_match"]
    records = [json.loads(line) for line in (rl / "metrics.jsonl").read_text().splitlines()]
    tenth = max(len(records) // 10, 1)
    for start in range(0, len(records), tenth):
        part = records[start:start + tenth]
        mean = sum(r["reward/mean"] for r in part) / len(part)
        print(f"rollouts {part[0]['step']}-{part[-1]['step']}: reward/mean {mean:.3f}", flush=True)
    print(f"p0={p0:.3f} p1={p1:.3f} lift={p1 - p0:.3f}")


if __name__ == "__main__":
    main()
