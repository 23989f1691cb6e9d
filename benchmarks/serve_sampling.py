"""Serving requests that each bring their own sampling: the slot engine of `python -m valen_jax.serve`
(`serving.slots.SlotEngine`, no HTTP) on rounds of `--slots` requests admitted together, each with another
temperature (half of them with top-p 0.9), against a round of greedy requests on the same prompt.

    .venv/bin/python benchmarks/serve_sampling.py                      # trains configs/chat.py:tiny for 4 steps first
    .venv/bin/python benchmarks/serve_sampling.py --workdir=runs/chat-smoke [--rounds=3] [--new-tokens=32]

The engine is warmed as the server warms it (`SlotEngine.warm`: every prefill and the greedy decode, then
in a background thread the sampled kinds' programs and those of several choices), and the rounds start once
that background compile has ended (`--no-background-warm-up`: the greedy warm-up only, as before it).
Each round's numbers differ from every earlier round's (temperature 0.5 + 0.1 i + 0.01 round), as
clients' numbers do. A slot's temperature, top-k and top-p are arrays of the decode program, one
program per kind of sampling (`sampling.SamplingKind`), so without the background compile only the first
sampled round compiles (its kinds: temperature alone, and with top-p; its first-token choice for 8 choices of
one prompt; the copies of that prompt's rows); before (one program per distinct `Sampling`, commit 507b903)
every round compiled `--slots` new decode and choose programs, each stalling every slot, and each sync ran
the model once per distinct sampling among the slots.

Printed: the greedy round's seconds, each sampled round's, and last
`sampled_round_vs_greedy=X first_sampled_round_s=Y`: the median of the sampled rounds after the first over
the greedy round (the cost of sampling itself, filters included), and the first sampled round's seconds
(its compiles, if any).

Measured on this 2-core CPU, idle (2026-12-05, the tiny chat model, 8 slots, 32 new tokens, 4 sampled
rounds), two runs: greedy 0.124 / 0.114 s a round; sampled 1.372 / 1.284 s for the first round, then
0.118-0.122 s: `sampled_round_vs_greedy=0.97 first_sampled_round_s=1.37`, then `1.05 ... 1.28`. The same
script on 507b903 (before): greedy 0.118 s, sampled 8.658 / 8.835 / 9.205 / 8.926 s:
`sampled_round_vs_greedy=75.85 first_sampled_round_s=8.66`. (With one kind for both filters, where a top-p
round also sorted for top-k, a sampled round took 0.22 s: 1.86.)
With the background compile (2026-12-05, same host, quiet): greedy 0.126 s, sampled 0.188 s for the first
round, then 0.166-0.175 s: `sampled_round_vs_greedy=1.32 first_sampled_round_s=0.19` (background 23.5 s);
`--no-background-warm-up` in the run before it: greedy 0.176 s, sampled 1.794 s, then 0.139-0.157 s:
`sampled_round_vs_greedy=0.89 first_sampled_round_s=1.79`. Rounds of 0.12-0.18 s swing by a third between
runs here; the first round's compile does not.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.serve import train_smoke  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4, help="sampled rounds, each with new numbers")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-background-warm-up", action="store_true",
                        help="warm as before the background compile: prefills and the greedy decode only")
    args = parser.parse_args()
    from tests.serve_server import serve_together
    from valen_jax.decoding.sampling import Sampling
    from valen_jax.serve import load_service
    from valen_jax.serving.slots import Request

    tmp = tempfile.TemporaryDirectory()
    workdir = Path(args.workdir) if args.workdir else Path(tmp.name) / "chat-smoke"
    if not args.workdir:
        train_smoke(workdir)
    service = load_service(workdir, slots=args.slots, warm=False)
    engine = service.engine
    engine.warm(background=not args.no_background_warm_up)  # as the server starts
    engine.wait_warm()  # a server serves greedy requests meanwhile; here the rounds start after it
    print(f"warm-up: {engine.warm_seconds:.1f} s, then in the background: "
          f"{engine.background_warm_seconds or 0:.1f} s")
    ids = np.asarray(service.tokenizer.encode("The weather in Wellington is", add_special_tokens=False), np.int32)

    def round_seconds(samplings) -> float:
        requests = [Request(ids, args.new_tokens, s, seed, 0, None) for seed, s in enumerate(samplings)]
        started = time.perf_counter()
        serve_together(engine, requests)  # queued together: admitted in one round, until all have ended
        return time.perf_counter() - started

    try:
        greedy = round_seconds([Sampling()] * args.slots)
        print(f"greedy round ({args.slots} requests, {args.new_tokens} new tokens): {greedy:.3f} s")
        sampled = []
        for r in range(args.rounds):
            samplings = [Sampling(temperature=round(0.5 + 0.1 * i + 0.01 * r, 2), top_p=0.9 if i % 2 else 1.0)
                         for i in range(args.slots)]
            sampled.append(round_seconds(samplings))
            print(f"sampled round {r} (temperatures {samplings[0].temperature}..{samplings[-1].temperature}, "
                  f"half with top-p 0.9): {sampled[-1]:.3f} s")
    finally:
        engine.stop()
    later = float(np.median(sampled[1:])) if len(sampled) > 1 else float("nan")
    print(f"sampled_round_vs_greedy={later / greedy:.2f} first_sampled_round_s={sampled[0]:.2f}")


if __name__ == "__main__":
    main()
