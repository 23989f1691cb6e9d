"""The first check to run on a real accelerator (GPU or TPU host), one command, at most `--budget` seconds (9 min).

    .venv/bin/python benchmarks/device_check.py            # on the accelerator host
    .venv/bin/python benchmarks/device_check.py --smoke    # tiny shapes on CPU: checks the script works

Each part runs in its own process (a TPU admits one process at a time; each part's compile cache and
memory counters are its own), and each is a benchmark that already exists or the library itself:
- the device kind, and the attention implementation `auto` chooses there (`models.attention.resolve`);
- `benchmarks/accelerator.py --models=1.5b`: the measured MFU of the Qwen2.5-1.5B-shaped bf16 train step
  at 4k tokens per row, per kernel of the backend (cuDNN or splash, and flash), and whether their loss
  and gradient norm agree on one batch (its exit status says so);
- decode tokens/s at batch 1 and 8: `decoding.generate_ids` (the engine's compiled loop) on random
  weights of that shape (`--smoke`: the tiny decoder), made scanned and laid out per layer as the commands
  decode (`transformer.per_layer`), rows × new tokens / the time of the new tokens (a run of 1 new token is
  subtracted: the prefill cancels);
- `benchmarks/speculative_ceiling.py --configs=big`: the speculative path's speed-up with the target's own
  greedy output as the oracle drafter, random weights (the ceiling at acceptance 17 per pass).
Last line: `device=… attention=… mfu=… kernels_agree=… decode_tokens_per_s_b1=… decode_tokens_per_s_b8=…
spec_speedup=…`; exit 1 when a part fails (its last stderr line is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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
    from valen_jax.models import sharding
    from valen_jax.models.config import ModelConfig
    from valen_jax.models.transformer import Transformer, per_layer

    dim, layers, heads, kv_heads, head_dim, mlp = DECODE_SHAPES["smoke" if smoke else "1.5b"]
    vocab = 1024 if smoke else 151_936
    cfg = ModelConfig(vocab_size=vocab, dim=dim, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=head_dim, mlp_dim=mlp, rope_theta=1e6, attention_bias=True, tie_embeddings=True,
                      scan_layers=True, dtype="bfloat16", param_dtype="bfloat16")
    # Trained scanned (as the `hf` variant trains), decoded per layer (as generate, evaluate and serve decode).
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    _, graphdef, params = per_layer(cfg, nnx.to_pure_dict(nnx.split(Transformer(cfg, nnx.Rngs(0)))[1]), mesh)
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


def run(args: list[str], what: str, failures: list[str], timeout: float, env: dict | None = None) -> str:
    """One part in its own process group; a part past its `timeout` seconds is killed with its children (which
    would otherwise keep holding device memory) and counted as failed, so a hang in one part cannot spend a lent
    machine's whole lease: the parts after it still run."""
    child = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, _ = child.communicate()
        failures.append(f"{what}: killed after {timeout:.0f} s")
    else:
        if child.returncode:
            last = (stderr.strip().splitlines() or ["(no output)"])[-1]
            failures.append(f"{what}: exit {child.returncode}: {last}")
    print(stdout.rstrip(), flush=True)
    return stdout


def last_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU-friendly")
    parser.add_argument("--child", choices=("probe", "decode"), help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for the whole check, shared among the parts (probe 4%%, train step 50%%, "
                             "decode 22%%, speculative 24%%); a part over its share is killed and reported")
    args = parser.parse_args()
    if args.child == "probe":
        probe_child()
        return 0
    if args.child == "decode":
        decode_child(args.smoke)
        return 0
    me, smoke = str(Path(__file__).resolve()), ["--smoke"] if args.smoke else []
    failures: list[str] = []
    share = {part: args.budget * fraction for part, fraction in
             (("probe", 0.04), ("train", 0.5), ("decode", 0.22), ("speculative", 0.24))}
    probe = last_json(run([me, "--child=probe"], "probe", failures, share["probe"]))
    train = run([str(HERE / "accelerator.py"), *(smoke or ["--models=1.5b", "--steps=3"])], "train step", failures,
                share["train"])
    mfu = re.search(r"^mfu=(\S+) attention=(\S+)$", train, re.MULTILINE)
    agree = "DISAGREE" not in train and not any(f.startswith("train step") for f in failures)
    compared = "agree" in train or "DISAGREE" in train  # one kernel only (--smoke): nothing to compare
    decode = last_json(run([me, "--child=decode", *smoke], "decode", failures, share["decode"]))
    # --smoke: a block of 64 and the fastest of 3, because on the tiny decoder 16 tokens take a few ms, which a
    # busy host's noise can exceed, and t(N) - t(1) then came out negative (spec_speedup=-0.1 in a CI-like run).
    spec_args = ["--configs=tiny", "--block=64", "--repeats=3"] if args.smoke else ["--configs=big", "--repeats=3"]
    # Full f32 matmuls: the oracle drafter proposes the engine's own greedy tokens, and the check asserts the
    # verify pass accepts exactly them. GPUs run f32 matmuls as TF32 by default, whose rounding differs between a
    # one-token step and a 17-token verify pass, so near-tied logits of random weights flip (seen on an H200:
    # "speculative output differs from engine greedy" at default precision, identical at highest).
    spec = run([str(HERE / "speculative_ceiling.py"), *spec_args], "speculative", failures, share["speculative"],
               env={"JAX_DEFAULT_MATMUL_PRECISION": "highest"})
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
