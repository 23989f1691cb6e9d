"""The Grain loader on the smoke VFlash shards: throughput, packing efficiency, and its rate
against the train step of configs/vflash.py.

    .venv/bin/python benchmarks/loader.py
    .venv/bin/python benchmarks/loader.py --workers=0,2 --batches=40 --pack-rows=600 --steps=8

The recipe data/smoke/vflash/recipe.json is converted into a temporary directory with the
tokenizer data/tokenizer. Three measurements:

1. Throughput (examples/s, non-pad tokens/s) of `build_dataset` with 0, 1 and 2 worker
   processes, in configs/vflash.py's row layout (seq_len 192, max_patches 128, global batch 16)
   with `--packing`. Worker start-up (the first batch) is reported apart.
2. Packing efficiency (non-pad fraction of the rows) of best fit against first fit on the same
   stream of examples (65–150 tokens each after media expansion) in rows of `--pack-seq-len`, in
   steady state (an endless shuffled stream, so no final partial rows), plus the same at 192.
3. The compiled train step of configs/vflash.py's model (as train.py builds it: the token-LM
   task's `compile`, i.e. valen_jax.training.step.compile_step) timed on the loader's own batches;
   `loader_vs_step` is the fastest loader configuration's rows per second over the rows per
   second the step consumes (> 1: the step, not the loader, sets the pace).

Last line: `packing_efficiency=X loader_vs_step=Y` (X: best fit at --pack-seq-len).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `configs` is a directory of config files, not an installed package

from configs import vflash  # noqa: E402
from data_pipeline.conversion import convert  # noqa: E402
from data_pipeline.tokenizer import load_tokenizer  # noqa: E402
from valen_jax.data.assemble import RowSpec, batch_shapes_of  # noqa: E402
from valen_jax.data.packing import PackingSpec, PackIterDataset, piece_of  # noqa: E402
from valen_jax.data.pipeline import TokenAssembly, build_dataset  # noqa: E402
from valen_jax.data.sources import ShardSet, decode, sampling_indices  # noqa: E402
from valen_jax.models import sharding  # noqa: E402
from valen_jax.models.build import model_config  # noqa: E402
from valen_jax.tasks.token_lm import TokenLMTask  # noqa: E402
from valen_jax.training.task import Setup  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="0,1,2", help="comma-separated worker counts to measure")
    parser.add_argument("--batches", type=int, default=24, help="batches timed per worker count")
    parser.add_argument("--packing", default="best_fit", choices=("none", "first_fit", "best_fit"))
    parser.add_argument("--pack-seq-len", type=int, default=1024)
    parser.add_argument("--pack-rows", type=int, default=400)
    parser.add_argument("--max-segments", type=int, default=16)
    parser.add_argument("--pack-buffer", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed train steps (after one warm-up)")
    return parser.parse_args()


def measure_loader(shard_set, spec, config, packing: PackingSpec, workers: int, batches: int):
    dataset = build_dataset(shard_set, spec, global_batch=config.data.global_batch, seed=0, shuffle=True,
                            repeat=True, workers=workers, assembly=TokenAssembly(packing))
    started = time.perf_counter()
    iterator = iter(dataset)
    kept = [next(iterator)]
    startup = time.perf_counter() - started
    examples = tokens = 0
    started = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
        examples += int(batch["segment_ids"].max(axis=1).sum())
        tokens += int((batch["segment_ids"] > 0).sum())
        kept.append(batch)
    elapsed = time.perf_counter() - started
    if hasattr(iterator, "close"):
        iterator.close()
    rows = batches * config.data.global_batch
    return {"startup_s": startup, "examples_per_s": examples / elapsed, "tokens_per_s": tokens / elapsed,
            "rows_per_s": rows / elapsed, "examples_per_row": examples / rows}, kept


def packing_efficiency(pieces, spec, packing: PackingSpec, rows: int) -> float:
    """Non-pad fraction of the first `rows` rows of an endless shuffled stream of `pieces`."""
    stream = grain.MapDataset.source(pieces).shuffle(seed=0).repeat(None, reseed_each_epoch=True)
    iterator = iter(PackIterDataset(stream.to_iter_dataset(), spec, packing))
    filled = sum(int((next(iterator)["segment_ids"] > 0).sum()) for _ in range(rows))
    return filled / (rows * spec.seq_len)


def time_train_step(config, model_cfg, tokenizer, spec, batches, steps: int) -> float:
    """Seconds per compiled train step, built the way valen_jax.train builds it: the token-LM task's
    layout, initial parameters and `compile` (valen_jax.training.step.compile_step)."""
    mesh = sharding.make_mesh(config.mesh)
    task = TokenLMTask(Setup(config, None, tokenizer, {}, mesh), model_cfg, None)
    layout = task.layout()
    params = task.initial_params(layout)
    opt_state = jax.jit(layout.tx.init, out_shardings=layout.state_shardings["opt_state"])(params)
    state = {"params": params, "opt_state": opt_state, "step": jax.device_put(jnp.zeros((), jnp.int32),
                                                                                layout.replicated)}
    batch_shapes = batch_shapes_of(spec, config.data.global_batch)
    compiled = task.compile(layout, batch_shapes)
    device_batches = [sharding.global_batch({k: b[k] for k in batch_shapes}, mesh) for b in batches[:steps + 1]]
    state, metrics = compiled(state, device_batches[0])  # warm-up
    jax.block_until_ready(metrics)
    started = time.perf_counter()
    for batch in device_batches[1:steps + 1]:
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - started) / steps


def main() -> None:
    args = parse_args()
    config = vflash.get_config("")
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.template_family)
    model_cfg = model_config(config, tokenizer)
    spec = RowSpec.from_config(config, tokenizer, model_cfg)
    packing = PackingSpec(packing=args.packing, max_segments=args.max_segments, pack_buffer=args.pack_buffer)
    print(f"backend={jax.default_backend()} devices={jax.device_count()} row layout: seq_len={spec.seq_len} "
          f"max_patches={spec.max_patches} global_batch={config.data.global_batch} packing={args.packing}")
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        convert("recipe", ROOT / "data/smoke/vflash/recipe.json", shards, ROOT / "data/tokenizer", progress=False)
        shard_set = ShardSet.open(shards)

        results, kept = {}, None
        for workers in (int(w) for w in args.workers.split(",")):
            results[workers], batches = measure_loader(shard_set, spec, config, packing, workers, args.batches)
            kept = kept or batches
            r = results[workers]
            print(f"workers={workers}: {r['examples_per_s']:.1f} examples/s, {r['tokens_per_s']:.0f} tokens/s, "
                  f"{r['rows_per_s']:.1f} rows/s ({r['examples_per_row']:.2f} examples/row), "
                  f"start-up {r['startup_s']:.1f}s")

        # Decode once; the packers then see the same examples in the same order.
        source = shard_set.source()
        wide = replace(spec, seq_len=args.pack_seq_len, max_patches=args.pack_seq_len)
        pieces = [piece_of(decode(source[int(i)]), wide) for i in sampling_indices(shard_set.manifest, 0)]
        lengths = [p.length for p in pieces]
        print(f"packing set: {len(pieces)} examples of {min(lengths)}–{max(lengths)} tokens "
              f"(mean {np.mean(lengths):.0f}); max_segments={args.max_segments} pack_buffer={args.pack_buffer}")
        efficiency = {}
        for seq_len in (args.pack_seq_len, spec.seq_len):
            row_spec = replace(spec, seq_len=seq_len, max_patches=max(seq_len, spec.max_patches))
            for mode in ("first_fit", "best_fit"):
                efficiency[seq_len, mode] = packing_efficiency(pieces, row_spec, replace(packing, packing=mode),
                                                               args.pack_rows)
            print(f"seq_len={seq_len}: non-pad fraction first_fit={efficiency[seq_len, 'first_fit']:.4f} "
                  f"best_fit={efficiency[seq_len, 'best_fit']:.4f} (none: "
                  f"{np.mean(lengths) / seq_len:.4f})")

    step_s = time_train_step(config, model_cfg, tokenizer, spec, kept, args.steps)
    step_rows_per_s = config.data.global_batch / step_s
    fastest = max(results, key=lambda w: results[w]["rows_per_s"])
    ratio = results[fastest]["rows_per_s"] / step_rows_per_s
    print(f"train step: {step_s * 1000:.0f} ms for {config.data.global_batch} rows ({step_rows_per_s:.1f} rows/s); "
          f"loader with {fastest} workers: {results[fastest]['rows_per_s']:.1f} rows/s")
    print(f"packing_efficiency={efficiency[args.pack_seq_len, 'best_fit']:.4f} loader_vs_step={ratio:.2f}")


if __name__ == "__main__":
    main()
