"""The speed-up ceiling of speculative decoding (issue 16): ms/token target-only (the engine's compiled
loop) against the fast speculative path, on random weights, so no training is needed.

    .venv/bin/python benchmarks/speculative_ceiling.py [--configs tiny,big] [--block 128] [--repeats 5]

Per config (random lively weights; tiny = configs/vflash.py:tiny's decoder, dim 64, 2 layers; big = dim 512,
8 layers): a prompt that announces a block of --block tokens.
- engine: `generate_ids` greedy; ms/token = (t(N) - t(1)) / (N - 1), N = block + 1 (the prefill cancels);
- oracle: `SpeculativeDecoder` (the decode loop, whole answer in one program) with the target's own
  greedy output scripted at B = 16 per pass (drafting costs a slice): ms per block token = (t(N) - t(1))
  / (N - 1), the speed-up ceiling at tau = 17;
- cached: the same with an untrained 1-layer block drafter of B = 16 (CachedDrafter): ms per verify pass
  ((t(N) - t(1)) / (passes - 1)),
  i.e. the cost of one real draft + verify pass; speed-up at acceptance tau = engine ms × tau / pass ms.
Each figure is the fastest of --repeats runs after one warm-up (compilation). Every speculative output is
checked equal to the engine's greedy output. Last line, per config: `NAME: ceiling_speedup=X
breakeven_tau=Y speedup_at_tau6=Z`.
Measured before issue 30 (one program per block; CPU, 2 cores, load ~5-6, --repeats 10): tiny ceiling 2.13x, break-even tau 7.8, 0.77x at tau 6;
dim 512 ceiling 4.39x, break-even tau 3.9, 1.54x at tau 6. The 17-slot verify pass is compute-bound on a
CPU (~8 decode steps at dim 64, ~4 at dim 512); on an accelerator it is close to one memory-bound step.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, ".")
from data_pipeline.primitives import AtomicCalls  # noqa: E402
from data_pipeline.tokenizer import load_tokenizer  # noqa: E402
from valen_jax.decoding import generate_ids  # noqa: E402
from valen_jax.decoding.speculative import CachedDrafter, ScriptedDrafter, SpeculativeDecoder  # noqa: E402
from valen_jax.models.config import ModelConfig  # noqa: E402
from valen_jax.models.drafter import Drafter, DrafterConfig  # noqa: E402
from valen_jax.models.transformer import Transformer  # noqa: E402

CONFIGS = {
    "tiny": dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128),
    "big": dict(dim=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1536),
}


def fastest(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(name: str, prompt, calls, vocab: int, block: int, repeats: int) -> str:
    """One config: engine vs oracle and cached-drafter fast path; prints the figures, returns the summary."""
    shape = CONFIGS[name]
    cfg = ModelConfig(vocab_size=-(-vocab // 64) * 64, attention="blockwise", **shape)
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    params = jax.tree.map(lambda p: p * 4 if p.ndim >= 2 else p, params)
    spec = {"ids": prompt, "positions": np.arange(len(prompt), dtype=np.int32)}
    new = block + 1

    def engine(n):
        return generate_ids(params, graphdef, [spec], max_new_tokens=n, stop_ids=(), vocab=vocab)[0]

    reference = engine(new)
    t_full, t_one = fastest(lambda: engine(new), repeats), fastest(lambda: engine(1), repeats)
    engine_ms = (t_full - t_one) / (new - 1) * 1e3

    def speculative(drafter, n):
        decoder = SpeculativeDecoder(graphdef, params, calls=calls, vocab=vocab)
        out = decoder.generate(prompt, drafter, max_new_tokens=n)
        assert out == reference[:n], "speculative output differs from engine greedy"
        return decoder

    # The whole answer is one program (the decode loop): a block's cost is the answer's time minus that of
    # a one-token answer (prefill + one pass), as the engine's prefill is subtracted.
    best = {}
    for kind, drafter in [("oracle", ScriptedDrafter(reference, block_size=16)),
                          ("cached", CachedDrafter(*nnx.split(Drafter(DrafterConfig(
                              block_size=16, num_layers=1, target_layers=tuple(range(min(cfg.num_layers, 5))),
                              **{k: shape[k] for k in ("dim", "num_heads", "num_kv_heads", "head_dim",
                                                       "mlp_dim")}), nnx.Rngs(1))), vocab))]:
        speculative(drafter, new), speculative(drafter, 1)  # warm-up: compiles
        full = min((speculative(drafter, new) for _ in range(repeats)), key=lambda d: d.timing.seconds)
        one = min(speculative(drafter, 1).timing.seconds for _ in range(repeats))
        best[kind] = (full, max(full.timing.seconds - one, 1e-9))
    (oracle, oracle_s), (cached, cached_s) = best["oracle"], best["cached"]
    oracle_ms = oracle_s / (new - 1) * 1e3
    pass_oracle = oracle_s / max(oracle.stats.passes - 1, 1) * 1e3
    pass_cached = cached_s / max(cached.stats.passes - 1, 1) * 1e3
    print(f"[{name}] {shape}")
    print(f"  engine target-only: {engine_ms:.3f} ms/token")
    print(f"  fast oracle B=16: tau {oracle.stats.tau:.2f}, {oracle_ms:.3f} ms/block token, "
          f"{pass_oracle:.3f} ms/pass -> ceiling speed-up {engine_ms / oracle_ms:.2f}x")
    print(f"  fast cached drafter B=16 (untrained, tau {cached.stats.tau:.2f}): {pass_cached:.3f} ms/pass "
          f"(= {pass_cached / engine_ms:.2f} target tokens); break-even tau {pass_cached / engine_ms:.2f}, "
          f"speed-up at tau 6: {6 * engine_ms / pass_cached:.2f}x")
    return (f"{name}: ceiling_speedup={engine_ms / oracle_ms:.2f} breakeven_tau={pass_cached / engine_ms:.2f} "
                   f"speedup_at_tau6={6 * engine_ms / pass_cached:.2f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="tiny,big")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = load_tokenizer("data/tokenizer")
    vocab = len(tokenizer)
    text = ('move the red cup left<action>Pull.</action><tool_call>{"name":"atomic_decoding","arguments":'
            f'{{"block_size":{args.block}}}}}</tool_call>')
    prompt = np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
    calls = AtomicCalls(tokenizer)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; prompt {len(prompt)} tokens, block {args.block}")
    figures = [measure(name, prompt, calls, vocab, args.block, args.repeats) for name in args.configs.split(",")]
    print(" | ".join(figures))


if __name__ == "__main__":
    main()
