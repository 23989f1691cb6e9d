"""The first check to run on a real accelerator (GPU or TPU host), one command, a few minutes (< 8 min).

    .venv/bin/python benchmarks/device_check.py            # on the accelerator host
    .venv/bin/python benchmarks/device_check.py --smoke    # tiny shapes on CPU: checks the script works

Each part runs in its own process (a TPU admits one process at a time; each part's compile cache and
memory counters are its own), and each is a benchmark that already exists or the library itself:
- the device kind, and the attention implementation `auto` chooses there (`models.attention.resolve`);
- `benchmarks/accelerator.py --models=1.5b`: the measured MFU of the Qwen2.5-1.5B-shaped bf16 train step
  at 4k tokens per row, per kernel of the backend (cuDNN or splash, and flash), and whether their loss
  and gradient norm agree on one batch (its exit status says so);
- decode tokens/s at batch 1 and 8: `decoding.generate_ids` (the engine's compiled loop) on random
  weights of that shape (`--smoke`: the tiny decoder), rows × new tokens / the time of the new tokens
  (a run of 1 new token is subtracted: the prefill cancels);
- `benchmarks/speculative_ceiling.py --configs=big`: the speculative path's speed-up with the target's own
  greedy output as the oracle drafter, random weights (the ceiling at acceptance 17 per pass).
Last line: `device=… attention=… mfu=… kernels_agree=… decode_tokens_per_s_b1=… decode_tokens_per_s_b8=…
spec_speedup=…`; exit 1 when a part fails (its last stderr line is printed).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The 1.5B shape of benchmarks/accelerator.py (hidden, layers, heads, kv heads, head dim, mlp), the tiny one
# of configs/*:tiny for --smoke.
DECODE_SHAPES = {"1.5b": (1536, 28, 12, 2, 128, 8960), "smoke": (64, 2, 4, 2, 16, 128)}


def decode_child(smoke: bool) -> None:
    """Engine decode tokens/s at batch 1 and 8 on random weights (one process, prints one JSON line)."""
    import jax
    import numpy as np
    from flax import nnx

    sys.path.insert(0, str(ROOT))
    from valen_jax.decoding import generate_ids
    from valen_jax.models.config import ModelConfig
    from valen_jax.models.transformer import Transformer

    dim, layers, heads, kv_heads, head_dim, mlp = DECODE_SHAPES["smoke" if smoke else "1.5b"]
    vocab = 1024 if smoke else 151_936
    cfg = ModelConfig(vocab_size=vocab, dim=dim, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=head_dim, mlp_dim=mlp, rope_theta=1e6, attention_bias=True, tie_embeddings=True,
                      scan_layers=True, dtype="bfloat16", param_dtype="bfloat16")
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    prompt_length, new = (32, 16) if smoke else (512, 128)
    rng = np.random.default_rng(0)
    result = {}
    for rows in (1, 8):
        prompts = [{"ids": rng.integers(0, vocab, prompt_length).astype(np.int32),
                    "positions": np.arange(prompt_length, dtype=np.int32)} for _ in range(rows)]

        def run(n, prompts=prompts):
            started = time.perf_counter()
            generate_ids(params, graphdef, prompts, max_new_tokens=n, stop_ids=(), vocab=vocab)
            return time.perf_counter() - started

        run(new), run(1)  # compile both programs
        seconds = min(run(new) for _ in range(2)) - min(run(1) for _ in range(2))
        result[f"b{rows}"] = rows * (new - 1) / max(seconds, 1e-9)
    print(json.dumps({"device": jax.devices()[0].device_kind, **result}), flush=True)


def probe_child() -> None:
    import jax

    sys.path.insert(0, str(ROOT))
    from valen_jax.models.attention import resolve

    print(json.dumps({"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                      "count": jax.device_count(), "attention": resolve("auto", 4096)}), flush=True)


def run(args: list[str], what: str, failures: list[str]) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    print(done.stdout.rstrip(), flush=True)
    if done.returncode:
        failures.append(f"{what}: exit {done.returncode}: {(done.stderr.strip().splitlines() or ['(no output)'])[-1]}")
    return done.stdout


def last_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU-friendly")
    parser.add_argument("--child", choices=("probe", "decode"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "probe":
        probe_child()
        return 0
    if args.child == "decode":
        decode_child(args.smoke)
        return 0
    me, smoke = str(Path(__file__).resolve()), ["--smoke"] if args.smoke else []
    failures: list[str] = []
    probe = last_json(run([me, "--child=probe"], "probe", failures))
    train = run([str(HERE / "accelerator.py"), *(smoke or ["--models=1.5b"])], "train step", failures)
    mfu = re.search(r"^mfu=(\S+) attention=(\S+)$", train, re.MULTILINE)
    agree = "DISAGREE" not in train and not any(f.startswith("train step") for f in failures)
    compared = "agree" in train or "DISAGREE" in train  # one kernel only (--smoke): nothing to compare
    decode = last_json(run([me, "--child=decode", *smoke], "decode", failures))
    # --smoke: a block of 64 and the fastest of 3, because on the tiny decoder 16 tokens take a few ms, which a
    # busy host's noise can exceed, and t(N) - t(1) then came out negative (spec_speedup=-0.1 in a CI-like run).
    spec_args = ["--configs=tiny", "--block=64", "--repeats=3"] if args.smoke else ["--configs=big", "--repeats=3"]
    spec = run([str(HERE / "speculative_ceiling.py"), *spec_args], "speculative", failures)
    speedup = re.search(r"ceiling_speedup=(\S+)", spec)
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    print(f"device={probe.get('device', 'unknown').replace(' ', '_')} attention={probe.get('attention')} "
          f"mfu={mfu.group(1) if mfu else 'nan'} ({mfu.group(2) if mfu else 'none'}) "
          f"kernels_agree={agree if compared else 'one_kernel'} "
          f"decode_tokens_per_s_b1={decode.get('b1', float('nan')):.1f} "
          f"decode_tokens_per_s_b8={decode.get('b8', float('nan')):.1f} "
          f"spec_speedup={speedup.group(1) if speedup else 'nan'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
