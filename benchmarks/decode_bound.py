"""How much of the batch-1 decode roofline (`benchmarks/decode.py`) the matrix-vector products alone reach
on this backend: the ceiling that figure runs into before any of the decode step's other work.

    .venv/bin/python benchmarks/decode_bound.py          # decode.py's default model shapes (~1 min)
    .venv/bin/python benchmarks/decode_bound.py --dim 1024 --mlp 4096 --layers 4

A decode step at batch 1 multiplies one row by every weight once: per layer q [D, D], k and v [D, KV·Hd],
o [D, D], gate and up [D, M], down [M, D], then the head [V, D] (tied embeddings). This times exactly those
products, chained as a step chains them (each layer's input is the previous layer's output, random f32
weights of decode.py's shapes, nothing else: no attention, norms, cache or sampling), jitted, the fastest of
5 rounds of 50 calls; and the head's product alone. Each figure is weight bytes / seconds over the
bandwidth of a streaming copy measured in the same run (`decode.copy_bandwidth`, the roofline's own
denominator).

Printed: the bandwidth, the layers' products (bytes, ms, fraction), the head's, both together, and the
step `decode.py` measured is to be read against them: the decode step cannot exceed
`matmul_bound_fraction` of the roofline while its products run at that speed. Last line
`matmul_bound_fraction=X head_fraction=Y`.

Measured on this 2-core CPU, idle (load 0.1-0.3), decode.py's shapes, four runs: copy 53.7-55.4 GB/s; the
head's [32000, 512] product (65.5 MB) streams at about the copy's speed (1.00 in the first run), but the
layers' 56 products of 0.26-3.1 MB each reach 0.46 of it (3.8 ms for 96.5 MB: XLA:CPU pays a fixed cost per
dot of this size), so the products alone bound the step at 0.55-0.58 of the roofline
(`matmul_bound_fraction=0.58 head_fraction=1.00`), below the issue's 0.8, before attention, norms, cache
writes and the argmax add theirs. The whole step, timed the same hour through `generate_ids` (129 against
1 new tokens, a 128-token prompt): 6.32 ms, 0.47 of the roofline, i.e. 0.84 of this bound. One run in five
measured the copy at ~90 GB/s (all fractions ~0.3): read the bandwidth line beside the fractions. On a
GPU/TPU the same products are HBM-bound kernels of a few microseconds each, and the figure is read there
against decode.py's own roofline.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decode import add_shape_args, copy_bandwidth  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(parser)
    return parser.parse_args(argv)


def fastest(fn, *args, calls: int = 50, rounds: int = 5) -> float:
    """Seconds per call of jitted `fn`, the fastest round's mean."""
    fn = jax.jit(fn)
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def layer_weights(args, rng) -> list[dict]:
    d, kv = args.dim, args.kv_heads * (args.dim // args.heads)
    shapes = {"q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d), "gate": (d, args.mlp), "up": (d, args.mlp),
              "down": (args.mlp, d)}
    return [{name: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02) for name, shape in shapes.items()}
            for _ in range(args.layers)]


def layer_products(x, layers):
    """Every layer's products in the order a step runs them, each input depending on the last output."""
    for w in layers:
        q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
        x = x + (q + jnp.pad(k + v, ((0, 0), (0, q.shape[1] - k.shape[1])))) @ w["o"]
        x = x + (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]
    return x


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    layers = layer_weights(args, rng)
    head = jnp.asarray(rng.standard_normal((args.vocab, args.dim), np.float32) * 0.02)
    x = jnp.asarray(rng.standard_normal((1, args.dim), np.float32))
    bandwidth = copy_bandwidth()
    layer_bytes = sum(w.nbytes for layer in layers for w in layer.values())
    layer_s = fastest(layer_products, x, layers)
    head_s = fastest(lambda x, h: x @ h.T, x, head)
    both = (layer_bytes + head.nbytes) / (layer_s + head_s) / bandwidth
    print(f"{jax.devices()[0].platform}, copy bandwidth {bandwidth / 1e9:.1f} GB/s; dim {args.dim}, {args.layers} layers, "
          f"MLP {args.mlp}, vocab {args.vocab}, f32")
    print(f"layers' products: {layer_bytes / 1e6:.1f} MB in {layer_s * 1e3:.3f} ms = "
          f"{layer_bytes / layer_s / bandwidth:.2f} of the copy")
    print(f"head's product: {head.nbytes / 1e6:.1f} MB in {head_s * 1e3:.3f} ms = {head.nbytes / head_s / bandwidth:.2f}")
    print(f"products of a step: {(layer_bytes + head.nbytes) / 1e6:.1f} MB in {(layer_s + head_s) * 1e3:.3f} ms = "
          f"{both:.2f} of the roofline")
    print(f"matmul_bound_fraction={both:.2f} head_fraction={head.nbytes / head_s / bandwidth:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
