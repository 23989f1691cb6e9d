"""Cost of asynchronous Orbax checkpoints to training, and how fast a run resumes.

    .venv/bin/python benchmarks/checkpoint.py                      # CPU defaults, ~5 minutes on 2 cores
    .venv/bin/python benchmarks/checkpoint.py --dim=2048 --layers=16 --mlp=5632 --batch=16 --seq=2048
        # a larger model on an accelerator

Part 1, in one process: mean train-step time with an asynchronous save after every step (as
`valen_jax.train` saves: state + Grain iterator + meta with digests) against no saves, in
alternating blocks so machine noise hits both alike. The save call blocks only while the arrays
are copied off the devices (the digests are dispatched to the devices and fetched by the
background write); the write runs in a background thread while the next steps compute. Saving
every step is the worst case: a save waits for the previous one to finish, so steps shorter than
a write are throttled to the write's pace.

Part 2: restore + compile + first step of the same model from its last checkpoint in this
process; and `python -m valen_jax.train` resumed on the vflash tiny config, timed from process
start to its first logged step (imports, data check, restore, compile, one step).

Last line: `async_save_overhead=X resume_to_first_step_s=Y` (X: fractional slow-down of the mean
step, 0.05 = 5%; Y: the CLI resume).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
from step_setup import compiled_step, train_config, train_layout

from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import init_params
from valen_jax.training import checkpoint
from valen_jax.training.step import TrainLayout

ROOT = Path(__file__).resolve().parent.parent
LEARNING_RATE = 1e-4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--mlp", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--block", type=int, default=4, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=3, help="alternating (no-save, save) block pairs")
    parser.add_argument("--no-cli", action="store_true", help="skip the valen_jax.train resume timing")
    return parser.parse_args()


def make_batch(args) -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "target_weights": np.ones(tokens.shape, np.float32),
            "positions": np.tile(np.arange(args.seq, dtype=np.int32), (args.batch, 1)),
            "segment_ids": np.ones(tokens.shape, np.int32), "patches": np.zeros((args.batch, 0, 0), np.float32),
            "patch_positions": np.zeros((args.batch, 0, 3), np.int32),
            "patch_segments": np.zeros((args.batch, 0), np.int32)}


def timed_block(compiled, state, batch, steps: int, save=None):
    """Mean seconds per step; each step's metrics are fetched, as a loop that logs every step does."""
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
        jax.device_get(metrics["loss"])
        if save is not None:
            save(state)
    return state, (time.perf_counter() - start) / steps


def cli_resume_seconds(workdir: Path) -> float:
    """Wall time from `python -m valen_jax.train` start to its first logged step, resuming."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    common = ["--config=configs/vflash.py:tiny", f"--workdir={workdir}", "--config.eval.at_end=False",
              "--config.train.log_every=1", "--config.train.checkpoint_every=2"]
    subprocess.run([sys.executable, "-m", "valen_jax.train", *common, "--config.train.steps=2"], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    metrics = workdir / "metrics.jsonl"
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "valen_jax.train", *common, "--config.train.steps=4"],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while process.poll() is None:
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
        if any(r["step"] == 3 for r in records):
            break
        time.sleep(0.02)
    elapsed = time.perf_counter() - started
    process.wait()
    if process.returncode not in (0, None):
        raise RuntimeError(f"valen_jax.train exited with {process.returncode}")
    return elapsed


def main() -> None:
    args = parse_args()
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, head_dim=args.dim // args.heads, mlp_dim=args.mlp,
                      tie_embeddings=False, dtype=args.dtype, param_dtype="float32")
    mesh, _, _, layout = train_layout(cfg, LEARNING_RATE)
    params = init_params(cfg, 0, layout.param_shardings)
    state = {"params": params, "opt_state": jax.jit(layout.tx.init)(params), "step": jnp.zeros((), jnp.int32)}
    state_mib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    batch = sharding.global_batch(make_batch(args), mesh)
    compiled = compiled_step(layout, batch)
    print(f"backend={jax.default_backend()} devices={jax.device_count()} dim={args.dim} layers={args.layers} "
          f"vocab={args.vocab} batch={args.batch}x{args.seq} dtype={args.dtype}; train state {state_mib:.0f} MiB")

    workdir = Path(tempfile.mkdtemp(prefix="valen-ckpt-bench-"))
    mgr = checkpoint.manager(workdir / "inproc", max_to_keep=2)
    iterator = iter(grain.MapDataset.range(10**6).batch(args.batch).to_iter_dataset())
    meta = {"state_layout": checkpoint.state_layout(layout.abstract_state())}
    saved, blocked = [0], []

    def save(state):
        saved[0] += 1
        next(iterator)
        started = time.perf_counter()
        checkpoint.save(mgr, saved[0], state, iterator, meta, force=True)
        blocked.append(time.perf_counter() - started)

    state, _ = timed_block(compiled, state, batch, 2)  # warm-up (and the digest function's compile)
    save(state)
    mgr.wait_until_finished()
    plain, with_saves = [], []
    for _ in range(args.rounds):
        state, seconds = timed_block(compiled, state, batch, args.block)
        plain.append(seconds)
        state, seconds = timed_block(compiled, state, batch, args.block, save)
        with_saves.append(seconds)
        mgr.wait_until_finished()  # the last write of a block ends before the next no-save block
    wait_started = time.perf_counter()
    mgr.wait_until_finished()
    mgr.close()
    mean_plain, mean_saving = statistics.mean(plain), statistics.mean(with_saves)
    overhead = mean_saving / mean_plain - 1.0
    print(f"no saves:            {mean_plain:.3f} s/step  (blocks: {', '.join(f'{s:.3f}' for s in plain)})")
    print(f"async save per step: {mean_saving:.3f} s/step  (blocks: {', '.join(f'{s:.3f}' for s in with_saves)}); "
          f"{saved[0]} saves of {state_mib:.0f} MiB; final wait {time.perf_counter() - wait_started:.2f}s")
    print(f"async save overhead: {100 * overhead:+.1f}%; of it, the save call blocks the loop "
          f"{statistics.mean(blocked[1:]):.3f}s per save ({100 * statistics.mean(blocked[1:]) / mean_plain:.1f}% of a "
          "step: device→host copy, waiting for the previous write); the rest is the background "
          "writer's threads taking CPU from the step (with CPU devices they share the same cores)")

    # Resume in this process: a fresh manager restores the latest checkpoint, compiles, steps once.
    started = time.perf_counter()
    mgr = checkpoint.manager(workdir / "inproc", max_to_keep=2)
    fresh_iterator = iter(grain.MapDataset.range(10**6).batch(args.batch).to_iter_dataset())
    step, state, _ = checkpoint.restore_intact(mgr, workdir / "inproc", layout.abstract_state(), fresh_iterator,
                                               lambda step, meta: None)
    restored = time.perf_counter()
    compiled = compiled_step(TrainLayout.from_config(cfg, train_config(LEARNING_RATE), mesh), batch)
    compiled_at = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.device_get(metrics["loss"])
    done = time.perf_counter()
    mgr.close()
    print(f"in-process resume of step {step}: restore+verify {restored - started:.2f}s, compile "
          f"{compiled_at - restored:.2f}s, first step {done - compiled_at:.2f}s, total {done - started:.2f}s")

    cli = float("nan")
    if not args.no_cli:
        cli = cli_resume_seconds(workdir / "cli")
        print(f"python -m valen_jax.train (vflash:tiny) resume, process start → first logged step: {cli:.1f}s")
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"async_save_overhead={overhead:.3f} resume_to_first_step_s={cli:.1f}")


if __name__ == "__main__":
    main()
