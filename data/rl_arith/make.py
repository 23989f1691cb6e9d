"""The arithmetic task of issue 32's evidence: two- and three-number sums and differences of small
integers with exact answers, in chat format, with a train and a disjoint eval split.

    python data/rl_arith/make.py OUT_DIR [--train 2000] [--eval 200] [--seed 0] [--max-operand 50]
    python data/rl_arith/make.py data/rl_arith/digits --max-operand 10   # configs/reinforce.py's task

Deterministic (one numpy generator from --seed); a problem's text identifies it, and no eval
problem appears in train. The assistant message is the bare answer, so `exact` is the reward.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def problem(rng: np.random.Generator, max_operand: int = 50) -> tuple[str, str]:
    count = int(rng.integers(2, 4))  # two or three numbers
    numbers = [int(n) for n in rng.integers(0, max_operand, size=count)]
    ops = [str(rng.choice(["+", "-"])) for _ in range(count - 1)]
    text = str(numbers[0]) + "".join(f"{op}{n}" for op, n in zip(ops, numbers[1:], strict=True))
    value = numbers[0] + sum(n if op == "+" else -n for op, n in zip(ops, numbers[1:], strict=True))
    return text, str(value)


def make(train: int, eval_: int, seed: int, max_operand: int = 50) -> tuple[list[dict], list[dict]]:
    rng = np.random.default_rng(seed)
    seen: dict[str, str] = {}
    while len(seen) < train + eval_:
        text, answer = problem(rng, max_operand)
        seen.setdefault(text, answer)
    items = list(seen.items())
    rows = [{"messages": [{"role": "user", "content": f"{t}="}, {"role": "assistant", "content": a}]}
            for t, a in items]
    return rows[eval_:], rows[:eval_]  # disjoint: each problem text once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    # Operands in [0, max-operand): 10 gives one-digit operands, a task a tiny model learns partly from
    # supervision and reinforcement then sharpens (the README's figures).
    parser.add_argument("--max-operand", type=int, default=50)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(("train", "eval"), make(args.train, args.eval, args.seed, args.max_operand), strict=True):
        with (args.out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{args.out / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
