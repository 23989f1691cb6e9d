"""Train step of Qwen2.5-0.5B/1.5B-shaped decoders in bf16 at 4k tokens per row, per attention kernel.

    .venv/bin/python benchmarks/accelerator.py            # on a GPU or TPU host (≈ a few minutes)
    .venv/bin/python benchmarks/accelerator.py --smoke    # tiny shapes on CPU: checks the script works

For each model (0.5B: hidden 896, 24 layers, 14/2 heads; 1.5B: hidden 1536, 28 layers, 12/2 heads;
vocab 151,936, tied embeddings, Qwen2 q/k/v biases) and each attention implementation this backend has
(GPU: cudnn, flash; TPU: splash, flash; CPU: blockwise, flash), one child process compiles
`valen_jax.training.step.make_train_step` (AdamW, f32 master weights, bf16 compute, scanned layers) through
`valen_jax.training.step.compile_step` (the state donated, as training runs it), runs warm-up + `--steps`
steps on one random batch, and reports step time, tokens/s, peak device memory
(`device.memory_stats()`, fresh per child; on CPU the compiled step's own memory analysis), and MFU
against the datasheet peak (`valen_jax.training.metrics.peak_flops_per_device`; on CPU a measured matmul).
The batch is sized to the device from a batch-1 compile's memory analysis: rows × its temp memory +
its fixed memory within 85% of device memory (conservative: some temp, e.g. gradients, does not grow
with rows; `--batch` overrides). The pre-update loss and gradient norm
of every implementation on the same batch-1 rows (same parameters) must agree (`TOLERANCE`), else
exit status 1.
Last line: `mfu=X attention=NAME` (the best implementation on the largest model run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODELS = {
    # name: (hidden, layers, heads, kv heads, head dim, mlp)
    "0.5b": (896, 24, 14, 2, 64, 4864),
    "1.5b": (1536, 28, 12, 2, 128, 8960),
    "smoke": (128, 2, 4, 2, 32, 256),
}
BACKEND_IMPLEMENTATIONS = {"gpu": ("cudnn", "flash"), "tpu": ("splash", "flash"), "cpu": ("blockwise", "flash")}
# bf16 kernels sum in different orders. At initialisation the loss hardly depends on attention, so
# the gradient norm (which does) is compared too.
TOLERANCE = {"loss": 2e-3, "grad_norm": 2e-2}
GIB = 1024**3


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (vocab 1024, 256 tokens), CPU-friendly")
    parser.add_argument("--models", default=None, help="comma list of 0.5b,1.5b (default both; smoke: smoke)")
    parser.add_argument("--attention", default=None, help="comma list (default: every one this backend has)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default 4096; smoke 256)")
    parser.add_argument("--batch", type=int, default=0, help="rows per step; 0 = sized to device memory")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up (default 5; smoke 2)")
    parser.add_argument("--no-remat", action="store_true", help="keep activations (remat is on by default)")
    parser.add_argument("--memory-fraction", type=float, default=0.85)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # MODEL:ATTENTION, run by the parent
    return parser.parse_args()


def model_config(name: str, attention: str, smoke: bool, remat: bool):
    import dataclasses

    from valen_jax.models.config import ModelConfig

    # remat is a bool today and may become a policy name (issue 14: none | full | save_dots | offload).
    default = {f.name: f.default for f in dataclasses.fields(ModelConfig)}["remat"]
    remat = remat if isinstance(default, bool) else ("full" if remat else "none")
    dim, layers, heads, kv_heads, head_dim, mlp = MODELS[name]
    return ModelConfig(vocab_size=1024 if smoke else 151_936, dim=dim, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, mlp_dim=mlp, rope_theta=1e6, norm_eps=1e-6,
                       attention_bias=True, tie_embeddings=True, remat=remat, scan_layers=True,
                       attention=attention, dtype="bfloat16", param_dtype="float32")


def make_batch(rows: int, seq: int, vocab: int):
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (rows, seq)).astype(np.int32)
    return {
        "tokens": tokens, "targets": np.roll(tokens, -1, axis=1).astype(np.int32),
        "target_weights": np.ones(tokens.shape, np.float32),
        "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
        "segment_ids": np.ones(tokens.shape, np.int32),
        "patches": np.zeros((rows, 0, 0), np.float32),
        "patch_positions": np.zeros((rows, 0, 3), np.int32),
        "patch_segments": np.zeros((rows, 0), np.int32),
    }


def run_child(args) -> None:
    """One (model, attention) pair in a fresh process: its own compile cache and peak-memory counter."""
    import jax
    import jax.numpy as jnp
    from step_setup import compiled_step, train_layout

    from valen_jax.models import sharding
    from valen_jax.models.transformer import init_params
    from valen_jax.training.metrics import model_flops_per_step, peak_flops_per_device

    name, attention = args.child.split(":")
    cfg = model_config(name, attention, args.smoke, remat=not args.no_remat)
    mesh, tx, _, layout = train_layout(cfg, learning_rate=1e-5)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    # CPU has no memory limit to size against; it sizes against 256 MiB so the path runs (--smoke).
    limit = stats.get("bytes_limit") or GIB // 4

    def compiled_for(rows):
        batch = sharding.global_batch(make_batch(rows, args.seq, cfg.vocab_size), mesh)
        return compiled_step(layout, batch), batch

    def footprint(compiled):
        m = compiled.memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes

    def fresh_state():
        params = init_params(cfg, 0, layout.param_shardings)
        return {"params": params, "opt_state": jax.jit(tx.init)(params), "step": jnp.zeros((), jnp.int32)}

    start = time.perf_counter()
    rows = args.batch * jax.device_count() if args.batch else jax.device_count()
    compiled, batch = compiled_for(rows)
    compile_s = time.perf_counter() - start
    with jax.set_mesh(mesh):
        # The loss every kernel must agree on: fresh parameters (seed 0) on the first compiled batch,
        # which is the same for every implementation (the sized batch below may differ between them).
        _, metrics = compiled(fresh_state(), batch)
        check_loss = float(jax.device_get(metrics["loss"]))
        check_grad_norm = float(jax.device_get(metrics["grad_norm"]))
    if not args.batch:
        # Temp memory grows with the rows; weights and optimizer state do not.
        one = compiled.memory_analysis()
        fixed = footprint(compiled) - one.temp_size_in_bytes
        fit = int((args.memory_fraction * limit - fixed) // max(one.temp_size_in_bytes, 1))
        rows = max(1, min(fit, 64)) * jax.device_count()
        if rows != jax.device_count():
            start = time.perf_counter()
            compiled, batch = compiled_for(rows)
            compile_s += time.perf_counter() - start
    state = fresh_state()
    with jax.set_mesh(mesh):
        state, metrics = compiled(state, batch)  # warm-up
        start = time.perf_counter()
        for _ in range(args.steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - start) / args.steps
    peak, peak_from = peak_flops_per_device(None, device)
    flops = model_flops_per_step(cfg, rows, args.seq) / jax.device_count()
    stats = device.memory_stats() or {}
    print(json.dumps({
        "model": name, "attention": attention, "rows": rows, "seq": args.seq, "loss": check_loss, "grad_norm": check_grad_norm,
        "step_s": step_s, "tokens_per_s": rows * args.seq / step_s, "compile_s": compile_s,
        "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / GIB or None,
        "compiled_memory_gib": footprint(compiled) / GIB, "mfu": flops / step_s / peak, "peak_flops": peak,
        "peak_from": peak_from, "device": device.device_kind, "devices": jax.device_count(),
    }), flush=True)


def main() -> int:
    args = parse_args()
    args.seq = args.seq or (256 if args.smoke else 4096)
    args.steps = args.steps or (2 if args.smoke else 5)
    if args.child:
        run_child(args)
        return 0
    # The parent never claims the device (a TPU admits one process; a GPU process preallocates): a
    # child reports the backend.
    probe = subprocess.run([sys.executable, "-c", "import jax; d = jax.devices()[0]; "
                            "print(jax.default_backend(), jax.device_count(), d.device_kind, sep='|')"],
                           capture_output=True, text=True, check=True)
    backend, count, kind = probe.stdout.strip().splitlines()[-1].split("|")
    models = (args.models or ("smoke" if args.smoke else "0.5b,1.5b")).split(",")
    available = BACKEND_IMPLEMENTATIONS.get(backend, ("flash",))
    attentions = args.attention.split(",") if args.attention else (available[:1] if args.smoke else available)
    print(f"backend={backend} device={kind} x{count} seq={args.seq} "
          f"models={','.join(models)} attention={','.join(attentions)} remat={not args.no_remat}", flush=True)
    forwarded = [f"--seq={args.seq}", f"--steps={args.steps}", f"--batch={args.batch}",
                 f"--memory-fraction={args.memory_fraction}"] + (["--smoke"] if args.smoke else []) + (
                 ["--no-remat"] if args.no_remat else [])
    results, failures = [], []
    for model in models:
        for attention in attentions:
            command = [sys.executable, os.path.abspath(__file__), f"--child={model}:{attention}", *forwarded]
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                failures.append(f"{model}/{attention}: exit {done.returncode}: {tail}")
                print(f"{model:>5} {attention:<9} FAILED: {tail}", flush=True)
                continue
            r = json.loads(lines[-1])
            results.append(r)
            memory = (f"peak {r['peak_memory_gib']:.2f} GiB" if r["peak_memory_gib"]
                      else f"compiled {r['compiled_memory_gib']:.2f} GiB")
            print(f"{model:>5} {attention:<9} rows={r['rows']}x{r['seq']} loss={r['loss']:.5f} "
                  f"step={r['step_s'] * 1e3:.1f} ms tokens/s={r['tokens_per_s']:,.0f} {memory} "
                  f"mfu={r['mfu']:.3f} (peak {r['peak_flops'] / 1e12:.3g} TFLOP/s from {r['peak_from']}; "
                  f"compile {r['compile_s']:.0f} s)", flush=True)
    for model in models:
        for key, tolerance in TOLERANCE.items():
            values = {r["attention"]: r[key] for r in results if r["model"] == model}
            if len(values) < 2:
                continue
            base = next(iter(values.values()))
            spread = max(abs(value - base) for value in values.values()) / abs(base)
            verdict = "agree" if spread <= tolerance else "DISAGREE"
            print(f"{model}: {key} on one batch {verdict} (max relative difference {spread:.2e}; "
                  f"tolerance {tolerance:g}): {values}", flush=True)
            if spread > tolerance:
                failures.append(f"{model}: {key} disagrees between implementations: {values}")
    if not results:
        print("mfu=nan attention=none")
        return 1
    last_model = [r for r in results if r["model"] == results[-1]["model"]]
    best = max(last_model, key=lambda r: r["mfu"])
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    print(f"mfu={best['mfu']:.3f} attention={best['attention']}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
