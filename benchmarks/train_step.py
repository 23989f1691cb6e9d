"""One training step (forward, backward, AdamW) of valen-jax against transformers + torch AdamW.

    .venv/bin/python benchmarks/train_step.py                 # the issue's shape, f32, CPU here
    .venv/bin/python benchmarks/train_step.py --dtype=bfloat16 --layers=24 --dim=2048 --mlp=5632 \
        --heads=16 --kv-heads=4 --batch=8 --seq=2048 --no-torch   # a larger model on a GPU

Both sides run the same decoder shape (Llama layout: RMSNorm, RoPE, GQA, SwiGLU, untied head)
on the same token batch in one process. MFU divides the model's FLOPs per step (6·N·T for the
matmuls plus causal attention) by the step time and by a matmul peak measured in this run.
Last line: `train_step_ratio_vs_torch=X mfu=Y`.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from step_setup import compiled_step, seconds_per_step, train_layout

from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import init_params
from valen_jax.training.metrics import measured_matmul_flops, model_flops_per_step


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--mlp", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    return parser.parse_args()


def jax_step_time(cfg: ModelConfig, batch: dict, steps: int) -> float:
    mesh, tx, _, layout = train_layout(cfg, learning_rate=1e-4)
    params = init_params(cfg, 0, layout.param_shardings)
    state = {"params": params, "opt_state": jax.jit(tx.init)(params), "step": jnp.zeros((), jnp.int32)}
    device_batch = sharding.global_batch(batch, mesh)
    compiled = compiled_step(layout, device_batch)
    return seconds_per_step(compiled, state, device_batch, mesh, steps)


def torch_step_time(cfg: ModelConfig, tokens: np.ndarray, steps: int) -> float:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, tie_word_embeddings=False, max_position_embeddings=tokens.shape[1],
        attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).train()
    if cfg.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    ids = torch.tensor(tokens, dtype=torch.long)

    def one():
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    one()
    start = time.perf_counter()
    for _ in range(steps):
        one()
    return (time.perf_counter() - start) / steps


def main() -> None:
    args = parse_args()
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, head_dim=args.dim // args.heads, mlp_dim=args.mlp,
                      tie_embeddings=False, dtype=args.dtype, param_dtype="float32", remat=args.remat)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    batch = {
        "tokens": tokens, "targets": np.roll(tokens, -1, axis=1).astype(np.int32),
        "target_weights": np.ones(tokens.shape, np.float32),
        "positions": np.tile(np.arange(args.seq, dtype=np.int32), (args.batch, 1)),
        "segment_ids": np.ones(tokens.shape, np.int32),
        "patches": np.zeros((args.batch, 0, 0), np.float32),
        "patch_positions": np.zeros((args.batch, 0, 3), np.int32),
        "patch_segments": np.zeros((args.batch, 0), np.int32),
    }
    print(f"backend={jax.default_backend()} devices={jax.device_count()} shape: dim={args.dim} layers={args.layers} "
          f"heads={args.heads}/{args.kv_heads} mlp={args.mlp} vocab={args.vocab} batch={args.batch}x{args.seq} "
          f"dtype={args.dtype}")
    on_cpu = jax.default_backend() == "cpu"
    peak = measured_matmul_flops(jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32,
                                 size=2048 if on_cpu else 4096, runs=5 if on_cpu else 20)
    print(f"matmul peak: {peak / 1e12:.3f} TFLOP/s")
    tokens_per_step = args.batch * args.seq
    jax_time = jax_step_time(cfg, batch, args.steps)
    flops = model_flops_per_step(cfg, args.batch, args.seq)
    mfu = flops / jax_time / peak
    print(f"valen-jax: {jax_time:.3f} s/step, {tokens_per_step / jax_time:,.0f} tokens/s, "
          f"{flops / jax_time / 1e12:.3f} TFLOP/s, MFU {mfu:.3f}")
    ratio = float("nan")
    if not args.no_torch:
        torch_time = torch_step_time(cfg, tokens, args.steps)
        ratio = torch_time / jax_time
        print(f"torch:     {torch_time:.3f} s/step, {tokens_per_step / torch_time:,.0f} tokens/s")
    print(f"train_step_ratio_vs_torch={ratio:.3f} mfu={mfu:.3f}")


if __name__ == "__main__":
    main()
