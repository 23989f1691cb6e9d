"""What a speculative verify pass costs on this host, against one decode step (issue 30), piece by piece.

    .venv/bin/python benchmarks/verify_pass.py [--width 16] [--repeats 5]

On the dim-512 / 8-layer target of `speculative_ceiling.py --configs big` (random weights, batch 1, a
cache of 512 slots holding a 64-token prompt), each figure is the fastest of --repeats runs of a jitted
`fori_loop` of 20 calls (so no dispatch is counted), in ms per call:
- `decode`: `Transformer.decode_step`, one token (the target-only engine's step);
- `extend(T)`: `Transformer.extend` over T = 2, 5, 9 and width + 1 tokens (the verify pass's target forward,
  cache writes and block attention included), and the same without the output head;
- `dense(T)`: the decoder's matmuls alone ([T, 512] through every layer's q/k/v/o and gated-MLP weights,
  no attention, no cache), T = 1 and width + 1: the share of the pass that is matrix products, and the
  GFLOP/s this CPU's XLA reaches on them.
A pass of the decode loop adds the drafter (its forward over width + 1 slots and the context it absorbs)
and the acceptance to `extend(width + 1)`: `speculative_ceiling.py` measures whole passes in the loop.
Last line: `extend_vs_decode=X dense_vs_dense1=Y dense_gflops=Z` for T = width + 1: X is the target's
share of the pass in decode steps; Y says how much of X the matmuls alone explain (on a memory-bound
accelerator both are close to 1: one read of the weights serves all T rows).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, ".")
from benchmarks.speculative_ceiling import CONFIGS  # noqa: E402
from valen_jax.models.config import ModelConfig  # noqa: E402
from valen_jax.models.transformer import Transformer  # noqa: E402

CALLS = 20  # per timed program
PROMPT, SLOTS = 64, 512


def fastest(program, args, repeats: int) -> float:
    jax.block_until_ready(program(*args))  # compiles
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - started)
    return min(times) / CALLS * 1e3


def model_pass(graphdef, length: int, head: bool):
    """CALLS cached passes of `length` tokens (a decode step when 1) at the prompt's end."""
    @jax.jit
    def run(params, cache):
        model = nnx.merge(graphdef, params)

        def body(_, carry):
            cache, total = carry
            tokens = jnp.full((1, length), 5, jnp.int32)
            positions = PROMPT + jnp.arange(length)[None]
            cursor = jnp.full((1,), PROMPT)
            if length == 1:
                out, cache = model.decode_step(tokens[:, 0], positions[:, 0], cache, cursor)
            elif head:
                out, cache = model.extend(tokens, positions, cache, cursor)
            else:
                x = model._embed(tokens, None)[0]
                out, cache, _ = model._cached_layers("extend", x, positions, cache, cursor)
            return cache, total + out.sum()
        return jax.lax.fori_loop(0, CALLS, body, (cache, 0.0))
    return run


def dense_chain(shape: dict, rows: int):
    """CALLS passes of [rows, dim] through every layer's matmuls (q/k/v, o, gate/up, down) → (program, args, flops)."""
    dim, mlp = shape["dim"], shape["mlp_dim"]
    qkv = shape["head_dim"] * (shape["num_heads"] + 2 * shape["num_kv_heads"])
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02)
               for _ in range(shape["num_layers"]) for s in ((dim, qkv), (dim, dim), (dim, 2 * mlp), (mlp, dim))]

    @jax.jit
    def run(weights, x):
        def body(_, x):
            for j in range(0, len(weights), 4):
                w_qkv, w_o, w_up, w_down = weights[j:j + 4]
                x = x + (x @ w_qkv)[:, :dim] @ w_o
                up = x @ w_up
                x = x + (jax.nn.silu(up[:, :mlp]) * up[:, mlp:]) @ w_down
            return x * 0.5
        return jax.lax.fori_loop(0, CALLS, body, x)
    flops = 2 * rows * shape["num_layers"] * (dim * qkv + dim * dim + dim * 2 * mlp + mlp * dim)
    return run, (weights, jnp.ones((rows, dim), jnp.float32)), flops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=16, help="draft slots per pass (the pass covers width + 1)")
    parser.add_argument("--vocab", type=int, default=2176, help="the smoke tokenizer's, rounded to 64")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shape = CONFIGS["big"]
    cfg = ModelConfig(vocab_size=args.vocab, attention="blockwise", **shape)
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    prompt = jnp.ones((1, PROMPT), jnp.int32)
    cache = jax.jit(lambda p: nnx.merge(graphdef, p).prefill(prompt, jnp.arange(PROMPT)[None], jnp.array([PROMPT]),
                                                             SLOTS)[1])(params)
    wide = args.width + 1
    decode = fastest(model_pass(graphdef, 1, True), (params, cache), args.repeats)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; target {shape}, vocab {args.vocab}")
    print(f"decode step: {decode:.2f} ms")
    for length in sorted({2, 5, 9, wide}):
        full = fastest(model_pass(graphdef, length, True), (params, cache), args.repeats)
        print(f"extend({length}): {full:.2f} ms = {full / decode:.2f} decode steps", flush=True)
    extend = full
    bare = fastest(model_pass(graphdef, wide, False), (params, cache), args.repeats)
    print(f"extend({wide}) without the output head: {bare:.2f} ms = {bare / decode:.2f} decode steps")
    (one, one_args, _), (many, many_args, flops) = dense_chain(shape, 1), dense_chain(shape, wide)
    dense_one, dense_many = fastest(one, one_args, args.repeats), fastest(many, many_args, args.repeats)
    gflops = flops / dense_many / 1e6
    print(f"matmuls alone: T=1 {dense_one:.2f} ms, T={wide} {dense_many:.2f} ms ({dense_many / dense_one:.2f}x, "
          f"{gflops:.0f} GFLOP/s)")
    print(f"extend_vs_decode={extend / decode:.2f} dense_vs_dense1={dense_many / dense_one:.2f} "
          f"dense_gflops={gflops:.0f}")


if __name__ == "__main__":
    main()
