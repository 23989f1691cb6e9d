"""LoRA and QLoRA against full fine-tuning: step time and peak memory of one train step on this host.

    .venv/bin/python benchmarks/lora.py            # dim 512, 8 layers, imported from a Qwen2 checkpoint built here
    .venv/bin/python benchmarks/lora.py --steps=5 --batch=8 --seq=512

A transformers Qwen2 checkpoint of the issue's shape (dim 512, 8 layers, 8 heads / 2 key-value heads,
MLP 1408, vocabulary 32000, untied head) is written to a temporary directory and imported three times by the
library (`hf.from_pretrained`): whole (every parameter trains: full fine-tuning), with LoRA r=16 on every
linear layer of the decoder on a bf16 base, and with QLoRA (the same adapters on an NF4 base, its
untargeted leaves in bf16). Each trains with the same
AdamW step on the same token batch (`step_setup.compiled_step`, the layout's frozen mask applied), with the
layer settings a run from an imported checkpoint uses (the `:hf` variant: `remat=full`, scanned layers, bf16
compute; `--remat=none --no-scan` gives the model's defaults instead, `--dtype=float32` an f32 step). The
compute dtype matters to the ratio: in an f32 step the bf16 base is cast to f32 at every use (forward, the
remat recompute, the backward), which XLA:CPU runs as unpartitioned loops (156 ms of a 2.4 s LoRA step in an
xprof trace, the head's cast alone 67 ms), while in a bf16 step the base is read as stored and full
fine-tuning casts its f32 master weights instead, as on an accelerator.
Step time: the median of `--steps` steps after one warm-up, the three runs taking turns step by step
(`step_setup.interleaved_seconds`: a drift in the host's load then touches all three alike). Peak memory: what XLA plans for one step
(arguments + outputs − donated aliases + temporaries: the train state, gradients, moments and
activations), i.e. the device memory the step needs, not the host process's resident size.
The host is shared, so the 1-minute load average is printed beside the times.
Last line: `lora_step_vs_full=X lora_memory_vs_full=Y qlora_step_vs_lora=Z`.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from step_setup import compiled_step, interleaved_seconds, train_layout

from valen_jax.models import hf, lora, sharding


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=7, help="timed steps of each run, taken in turns")
    parser.add_argument("--rank", type=int, default=16)
    # The `:hf` variant's settings (configs/common.py), what a run from an imported checkpoint uses; the
    # earlier figures were measured with --remat=none --no-scan.
    parser.add_argument("--remat", default="full", help="remat policy of both steps (none | full | save_dots)")
    parser.add_argument("--scan", default=True, action=argparse.BooleanOptionalAction,
                        help="scanned layers in both steps")
    parser.add_argument("--dtype", default="bfloat16",
                        help="compute dtype of every step (the `:hf` variant's bfloat16, or float32)")
    return parser.parse_args()


def write_checkpoint(directory: str) -> None:
    import torch
    import transformers

    config = transformers.Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def batch(size: int, seq: int) -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, (size, seq)).astype(np.int32)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "target_weights": np.ones((size, seq), np.float32),
            "positions": np.tile(np.arange(seq, dtype=np.int32), (size, 1)), "segment_ids": np.ones((size, seq), np.int32),
            "patches": np.zeros((size, 0, 0), np.float32), "patch_positions": np.zeros((size, 0, 3), np.int32),
            "patch_segments": np.zeros((size, 0), np.int32)}


def prepare(directory: str, adapters: lora.LoraConfig | None, data: dict, remat: str = "none",
            scan: bool = False, dtype: str = "float32") -> tuple[tuple, int, int]:
    """((compiled step, train state, device batch, mesh), planned peak bytes of one step, of which the train
    state and batch: the arguments).
    Full fine-tuning keeps f32 master weights; under (Q)LoRA the frozen base is stored in bf16 (what the issue
    asks and `config.model.param_dtype=bfloat16` gives a LoRA run), the adapters in f32, the step in `dtype`."""
    param_dtype = "float32" if adapters is None else "bfloat16"
    model, cfg = hf.from_pretrained(directory, dtype=dtype, param_dtype=param_dtype, remat=remat, scan_layers=scan,
                                    **({"lora": adapters} if adapters else {}))
    mesh, tx, _, layout = train_layout(cfg, learning_rate=1e-4)
    params = nnx.to_pure_dict(nnx.state(model))
    state = {"params": params, "opt_state": jax.jit(tx.init)(params), "step": jnp.zeros((), jnp.int32)}
    device_batch = sharding.global_batch(data, mesh)
    compiled = compiled_step(layout, device_batch)
    analysis = compiled.memory_analysis()
    peak = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes)
    return (compiled, state, device_batch, mesh), peak, analysis.argument_size_in_bytes


def main():
    args = parse_args()
    data = batch(args.batch, args.seq)
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(directory)
        runs = {"full": None, "lora": lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank),
                "qlora": lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank, quantize_base="nf4")}
        prepared = {name: prepare(directory, adapters, data, args.remat, args.scan, args.dtype)
                    for name, adapters in runs.items()}
        seconds = interleaved_seconds({name: p[0] for name, p in prepared.items()}, args.steps)
        results = {}
        for name, (_, peak, state) in prepared.items():
            results[name] = (seconds[name], peak)
            print(f"{name:6s} step {seconds[name]:7.3f} s   peak {peak / 2**20:8.1f} MiB "
                  f"(state + batch {state / 2**20:7.1f} MiB)", flush=True)
    full, low, quantised = results["full"], results["lora"], results["qlora"]
    print(f"batch {args.batch} × {args.seq} tokens, rank {args.rank} on q,k,v,o,gate,up,down of 8 layers, "
          f"{args.dtype} steps, "
          f"remat={args.remat}, {'scanned' if args.scan else 'unscanned'} layers "
          "(full: f32 weights; LoRA: bf16 base, f32 adapters), "
          f"{jax.devices()[0].platform}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"lora_step_vs_full={low[0] / full[0]:.3f} lora_memory_vs_full={low[1] / full[1]:.3f} "
          f"qlora_step_vs_lora={quantised[0] / low[0]:.3f}")


if __name__ == "__main__":
    main()
