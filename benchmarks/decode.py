"""Greedy decoding: our KV-cache engine against transformers `generate` on torch, same model, same prompts.

    .venv/bin/python benchmarks/decode.py            # dim 512, 8 layers, vocab 32000; 128 new tokens (minutes)
    .venv/bin/python benchmarks/decode.py --quick    # the same model, 32 new tokens, one repeat

A random Qwen2-shaped model (default: dim 512, 8 layers, 8 query / 2 key-value heads of 64, MLP
1536, vocab 32000, tied embeddings, attention biases; float32 on both sides) is built with
`transformers`, saved with `save_pretrained` and imported with `valen_jax.models.hf.from_pretrained`,
so both sides run the same weights. Eight random prompts of 64–256 tokens go through
`valen_jax.decoding.engine.generate_ids` and through `model.generate(do_sample=False)` (torch's
default SDPA attention, left-padded batches with an attention mask): at batch 8 (one batch of mixed
lengths) and at batch 1 (the first `--batch1-prompts` of them, each alone). No end-of-sequence id:
every row makes `--new-tokens`.

Threads: `torch.set_num_threads(N)` with N the CPUs this process may use (`os.sched_getaffinity`),
which is the size of XLA:CPU's intra-op pool, so both sides may use the same cores
(`--torch-threads` overrides it). Run it on a quiet machine: under load from other jobs torch's
spinning threads collapse far more than XLA's pool, and the ratios below grew from 1.1 to 4–6.

Timing, for each side and batch size: prefill = a generate call with max_new_tokens=1 (the prompt's
forward and the first token); whole = one with max_new_tokens=`--new-tokens`. Prefill tokens/s =
real prompt tokens (padding not counted) / prefill time; decode tokens/s = rows × (new tokens − 1)
/ (whole − prefill), the new tokens after the first. Every call is run once first, untimed by the
figures (its time, compilation included for us, is printed as warm-up), then `--repeats` times; the
fastest repeat counts, the least disturbed by other work on the machine.

Roofline at batch 1: a decode step must read every weight once and the keys/values of the context so far;
bytes/token = parameter bytes + 2 (keys, values) x layers x kv heads x head dim x 4 bytes x the mean
context length of the batch-1 rows' decoded tokens (the bytes the math needs: the engine's cache is
bucketed, so it reads up to 1.5x more KV slots, masked). The bandwidth is a streaming copy measured in
the same run (`x + 1` over 512 MiB of float32 under jit, donated so it runs in place: 1 read + 1 write per
element, fastest of 5),
and the fraction reached = bytes/token x our batch-1 decode tokens/s / that bandwidth. On this CPU
the weights of the default model (~170 MB) do not fit in cache, so the figure is memory-bound as on an
accelerator; on a GPU/TPU the same formula holds with HBM bandwidth.

Printed: the shape, threads, warm-up times, tokens/s of both sides per batch size, whether the two
produced the same tokens (rows equal, and the first differing step if not), and last
`decode_ratio_vs_torch=X prefill_ratio_vs_torch=Y roofline_fraction=Z`: ours over torch's tokens/s, the
geometric mean of the batch-1 and batch-8 ratios, and the batch-1 roofline fraction.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from valen_jax.decoding.engine import generate_ids
from valen_jax.models import hf

PROMPTS = 8
PAD = 0  # transformers' left padding; masked out, so any id does


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """The model's shape (also `benchmarks/decode_bound.py`'s, which times the same products)."""
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--mlp", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=32000)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 new tokens, 1 repeat")
    add_shape_args(parser)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--batch1-prompts", type=int, default=2,
                        help="of the 8 prompts, how many (the first ones) also run alone at batch 1")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=None, help="default: the CPUs JAX uses")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats = 32, 1
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2: decode speed is measured on the tokens after the first")
    return args


def reference_model(args, directory: Path):
    """The random transformers model, saved where `hf.from_pretrained` reads it."""
    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.mlp, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
        tie_word_embeddings=True, rope_theta=1000000.0, initializer_range=0.05, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(directory)
    return model


class Ours:
    name = "ours"

    def __init__(self, directory: Path, vocab: int):
        model, _ = hf.from_pretrained(directory)  # float32 parameters and compute
        self.graphdef, self.params = nnx.split(model)
        self.vocab = vocab

    def generate(self, prompts: list[np.ndarray], new_tokens: int) -> list[list[int]]:
        batch = [{"ids": ids, "positions": np.arange(len(ids), dtype=np.int32)} for ids in prompts]
        return generate_ids(self.params, self.graphdef, batch, max_new_tokens=new_tokens, stop_ids=(),
                            vocab=self.vocab)


class Torch:
    name = "torch"

    def __init__(self, model):
        self.model = model

    def generate(self, prompts: list[np.ndarray], new_tokens: int) -> list[list[int]]:
        longest = max(len(ids) for ids in prompts)
        tokens = torch.full((len(prompts), longest), PAD, dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for row, ids in enumerate(prompts):
            tokens[row, longest - len(ids):] = torch.from_numpy(ids.astype(np.int64))
            mask[row, longest - len(ids):] = 1
        with torch.inference_mode():
            out = self.model.generate(tokens, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                      eos_token_id=None, pad_token_id=PAD)
        return out[:, longest:].tolist()


def timed(side, batches: list[list[np.ndarray]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for every batch in turn, and the generated ids in prompt order."""
    start = time.perf_counter()
    out = [ids for batch in batches for ids in side.generate(batch, new_tokens)]
    return time.perf_counter() - start, out


def measure(side, batches: list[list[np.ndarray]], new_tokens: int, repeats: int) -> dict:
    warm = {n: timed(side, batches, n)[0] for n in (1, new_tokens)}  # compiles (ours), allocator warm-up
    prefill = min(timed(side, batches, 1)[0] for _ in range(repeats))
    runs = [timed(side, batches, new_tokens) for _ in range(repeats)]
    whole = min(seconds for seconds, _ in runs)
    prompt_tokens = sum(len(ids) for batch in batches for ids in batch)
    rows = sum(len(batch) for batch in batches)
    return {"warmup": sum(warm.values()), "prefill": prompt_tokens / prefill,
            "decode": rows * (new_tokens - 1) / max(whole - prefill, 1e-9), "ids": runs[0][1]}


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    equal = sum(a == b for a, b in zip(ours, theirs, strict=True))
    # Rows have the same length (no eos), so the first unequal step exists wherever the rows differ.
    first = [next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
             for a, b in zip(ours, theirs, strict=True) if a != b]
    detail = f" (first difference at new token {min(first)})" if first else ""
    return f"{equal}/{len(ours)} rows identical{detail}"


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a streaming copy on JAX's device: `x + 1` reads and writes every float32 once."""
    x = jnp.zeros(mib * 2 ** 20 // 4, jnp.float32)
    nbytes = x.nbytes
    # Donated, so the result reuses the input's buffer: a fresh 512 MiB output would be timed faulting in
    # its pages (measured: 1.2 GB/s that way, against 11 GB/s that decoding itself reads here).
    bump = jax.jit(lambda x: x + 1, donate_argnums=0)
    x = bump(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = bump(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def roofline(args, ours: Ours, prompts: list[np.ndarray], decode_per_second: float) -> tuple[float, float, float]:
    """(bytes per token, copy bandwidth bytes/s, fraction reached) at batch 1 (see the module doc)."""
    weights = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in jax.tree.leaves(ours.params))
    context = float(np.mean([len(p) + args.new_tokens / 2 for p in prompts]))
    kv = 2 * args.layers * args.kv_heads * (args.dim // args.heads) * 4 * context
    bandwidth = copy_bandwidth()
    return weights + kv, bandwidth, (weights + kv) * decode_per_second / bandwidth


def main(argv=None) -> int:
    args = parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    torch.set_num_threads(args.torch_threads or cpus)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, args.vocab, n).astype(np.int32)
               for n in rng.integers(args.min_prompt, args.max_prompt + 1, PROMPTS)]
    print(f"model: Qwen2-shaped, dim {args.dim}, {args.layers} layers, {args.heads} query / {args.kv_heads} kv heads "
          f"of {args.dim // args.heads}, MLP {args.mlp}, vocab {args.vocab}, float32 on both sides")
    print(f"threads: XLA:CPU pool {cpus} (CPUs this process may use), torch.set_num_threads({torch.get_num_threads()})")
    print(f"prompts: {PROMPTS} of {[len(p) for p in prompts]} tokens; {args.new_tokens} new tokens, greedy, "
          f"no eos; fastest of {args.repeats} repeat(s)")
    with tempfile.TemporaryDirectory() as tmp:
        reference = reference_model(args, Path(tmp))
        sides = (Ours(Path(tmp), args.vocab), Torch(reference))
        layouts = {1: [[p] for p in prompts[:args.batch1_prompts]], PROMPTS: [prompts]}
        results = {(side.name, b): measure(side, batches, args.new_tokens, args.repeats)
                   for b, batches in layouts.items() for side in sides}
        per_token, bandwidth, fraction = roofline(args, sides[0], prompts[:args.batch1_prompts],
                                                  results["ours", 1]["decode"])
    ratios = {"decode": [], "prefill": []}
    for b in layouts:
        ours, theirs = results["ours", b], results["torch", b]
        print(f"batch {b}: warm-up (1 and {args.new_tokens} new tokens, once each) ours {ours['warmup']:.1f}s, "
              f"torch {theirs['warmup']:.1f}s")
        for kind in ratios:
            ratios[kind].append(ours[kind] / theirs[kind])
            print(f"batch {b}: {kind} tokens/s ours {ours[kind]:.1f}, torch {theirs[kind]:.1f} "
                  f"(x{ratios[kind][-1]:.2f})")
        print(f"batch {b}: same tokens as torch: {agreement(ours['ids'], theirs['ids'])}")
    batch1_rows = len(layouts[1])
    print(f"ours batch 1 vs batch 8: {agreement(results['ours', 1]['ids'], results['ours', PROMPTS]['ids'][:batch1_rows])}")
    geomean = {kind: math.exp(sum(map(math.log, values)) / len(values)) for kind, values in ratios.items()}
    print(f"roofline at batch 1: {per_token / 1e6:.1f} MB/token (weights + KV of the context), copy bandwidth "
          f"{bandwidth / 1e9:.2f} GB/s: at most {bandwidth / per_token:.1f} tokens/s; ours "
          f"{results['ours', 1]['decode']:.1f} tokens/s = {fraction:.2f} of the roofline")
    print(f"decode_ratio_vs_torch={geomean['decode']:.2f} prefill_ratio_vs_torch={geomean['prefill']:.2f} "
          f"roofline_fraction={fraction:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
