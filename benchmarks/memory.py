"""Memory of one training step against sequence length, from the compiler (compiled, never run).

    .venv/bin/python benchmarks/memory.py --attention=flash        # Qwen2.5-0.5B, all 24 layers, 2k…32k
    .venv/bin/python benchmarks/memory.py --attention=blockwise
    .venv/bin/python benchmarks/memory.py --model=1.5b --layers=28 --lengths=8192,16384,32768,65536 \
        --fit-gib=80                                             # longest 1.5B row on one 80 GB device

For each length, `valen_jax.training.step.make_train_step` (AdamW, f32 master weights, bf16 compute, remat
`--remat`, scanned layers, token-tiled loss) is compiled by `valen_jax.training.step.compile_step` (the state
donated, as training runs it) for one row of that many tokens on this backend;
`compiled.memory_analysis()` gives the step's temporary memory (every buffer live inside the step:
activations, residuals, logits chunks, gradients) next to its arguments (parameters + optimizer
state + batch). Nothing is allocated, so lengths far beyond this machine's memory compile. Scanned
layers make the compile time independent of depth, so the 1.5B model compiles with all its layers.

Growth: each line shows the slope of log(temp) against log(length) from the previous length, and the
exponent is that slope between the two longest lengths, where what grows with length weighs most.
Temp is the peak of live buffers over the step, a maximum over phases (the loss's vocabulary-sized
f32 gradients, one layer's recompute, ...), each affine in the length when memory is linear; such a
temp at most doubles when the length doubles, so a slope ≤ 1 is linear growth (below 1 while the
length-independent part still weighs) and a slope towards 2 is quadratic memory taking over. A
least-squares slope over all lengths is printed too, but the length-independent part dominates it
at 2k-8k tokens (the pre-issue-14 path, O(T²) attention residuals and whole logits, fits 1.09 there
while its 16k→32k slope is 1.87).
Last line: `memory_scaling_exponent=X temp_gib_at_32k=Y` (Y: the whole temp at 32768 tokens, or at
the longest length measured if 32k was not).
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from step_setup import compiled_step, train_layout

from valen_jax.models.config import ModelConfig
from valen_jax.models.remat import REMAT_POLICIES

GIB = 1024**3
MODELS = {
    # name: (hidden, heads, kv heads, head dim, mlp) of Qwen2.5; vocabulary 151,936, tied, q/k/v biases.
    "0.5b": (896, 14, 2, 64, 4864),
    "1.5b": (1536, 12, 2, 128, 8960),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="0.5b", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2.5-0.5B: 24, 1.5B: 28)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--attention", default="flash", help="config.model.attention (flash, blockwise, auto, ...)")
    parser.add_argument("--remat", default="full", choices=REMAT_POLICIES)
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    parser.add_argument("--fit-gib", type=float, default=0.0,
                        help="also report the longest measured length whose step fits this many GiB")
    return parser.parse_args()


def model_config(args) -> ModelConfig:
    dim, heads, kv_heads, head_dim, mlp = MODELS[args.model]
    return ModelConfig(vocab_size=args.vocab, dim=dim, num_layers=args.layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, mlp_dim=mlp, rope_theta=1e6, attention_bias=True,
                       tie_embeddings=True, remat=args.remat, scan_layers=True, attention=args.attention,
                       dtype="bfloat16", param_dtype="float32")


def compile_length(cfg: ModelConfig, length: int):
    """The compiled train step for one row of `length` tokens (abstract inputs only)."""
    _, _, _, layout = train_layout(cfg, learning_rate=1e-5)
    shapes = {"tokens": ((1, length), jnp.int32), "targets": ((1, length), jnp.int32),
              "target_weights": ((1, length), jnp.float32), "positions": ((1, length), jnp.int32),
              "segment_ids": ((1, length), jnp.int32), "patches": ((1, 0, 0), jnp.float32),
              "patch_positions": ((1, 0, 3), jnp.int32), "patch_segments": ((1, 0), jnp.int32)}
    return compiled_step(layout, {name: jax.ShapeDtypeStruct(*shape) for name, shape in shapes.items()})


def main() -> None:
    args = parse_args()
    cfg = model_config(args)
    lengths = [int(n) for n in args.lengths.split(",")]
    params = cfg.vocab_size * cfg.dim + cfg.num_layers * (
        cfg.dim * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * cfg.dim
        + 3 * cfg.dim * cfg.mlp_dim)
    print(f"backend={jax.default_backend()} model={args.model}-shaped: hidden {cfg.dim}, {cfg.num_layers} layers "
          f"(scanned), heads {cfg.num_heads}/{cfg.num_kv_heads}, head_dim {cfg.head_dim}, mlp {cfg.mlp_dim}, "
          f"vocab {cfg.vocab_size} (tied), ~{params / 1e9:.2f}B params; batch 1, bf16 compute, f32 AdamW, "
          f"remat={cfg.remat}, attention={cfg.attention}, compiled not run", flush=True)
    temps, fits = [], []
    for length in lengths:
        started = time.perf_counter()
        memory = compile_length(cfg, length).memory_analysis()
        seconds = time.perf_counter() - started
        temp = memory.temp_size_in_bytes
        # Parameters + optimizer state + batch in, the updated state out (donated: aliased to the input).
        total = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes + temp
        slope = f"{math.log(temp / temps[-1][1]) / math.log(length / temps[-1][0]):.2f}" if temps else "-"
        temps.append((length, temp))
        if total <= args.fit_gib * GIB:
            fits.append(length)
        print(f"seq={length:>6} temp_gib={temp / GIB:8.3f} arguments_gib={memory.argument_size_in_bytes / GIB:7.3f} "
              f"total_gib={total / GIB:8.3f} slope_from_previous={slope} compile_s={seconds:.0f}", flush=True)
    x, y = np.log([n for n, _ in temps]), np.log([t for _, t in temps])
    fitted = float(np.polyfit(x, y, 1)[0]) if len(temps) > 1 else float("nan")
    exponent = float((y[-1] - y[-2]) / (x[-1] - x[-2])) if len(temps) > 1 else float("nan")
    at = dict(temps).get(32768, temps[-1][1])
    print(f"least-squares slope of log(temp) over all lengths: {fitted:.3f}; "
          f"slope {temps[-2][0] if len(temps) > 1 else '-'}→{temps[-1][0]}: {exponent:.3f}")
    if args.fit_gib:
        print(f"longest measured length within {args.fit_gib:g} GiB (arguments + temp): "
              f"{max(fits) if fits else 'none'}")
    print(f"memory_scaling_exponent={exponent:.3f} temp_gib_at_32k={at / GIB:.3f}")


if __name__ == "__main__":
    main()
