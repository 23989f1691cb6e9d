"""Evaluate a trained workdir on a data file; needs nothing but the workdir.

    python -m valen_jax.evaluate --workdir=runs/vflash-smoke --data=data/smoke/vflash/eval.jsonl \
        --output=runs/vflash-smoke/eval/report.json

Model config, `media_kwargs` and tokenizer come from the checkpoint. For VFlash data the report
holds the assistant-token loss and next-token accuracy (teacher forcing), and from greedy
decoding of each example's last answer the fraction of answers whose primitives parse.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from data_pipeline.primitives import PrimitiveError, parse_answer
from data_pipeline.shards import Example
from valen_jax import checkpoint, experiment, sharding
from valen_jax.data.assemble import RowSpec, assemble, expand_media_slots, vision_arrays
from valen_jax.models.config import ModelConfig
from valen_jax.step import TrainLayout, forward_loss, vision_inputs

log = logging.getLogger("valen_jax.evaluate")


def _format_of(path: Path) -> str:
    if path.is_dir():
        return "shards"
    return "recipe" if path.suffix == ".json" else "vflash"


def _stack(rows: list[dict], size: int) -> dict[str, np.ndarray]:
    """Stack rows into a fixed-size batch; missing rows are all-padding with zero weight."""
    padded = rows + [jax.tree.map(np.zeros_like, rows[0])] * (size - len(rows))
    return {k: np.stack([r[k] for r in padded]) for k in rows[0]}


@functools.cache
def _forward(graphdef):
    # One compiled forward per model: evaluation during training reuses it every time.
    return jax.jit(lambda p, b: forward_loss(graphdef, p, b))


def teacher_forced(params, graphdef, examples, spec, mesh, batch_size) -> dict[str, float]:
    """Loss and next-token accuracy over the examples' supervised tokens (teacher forcing)."""
    forward = _forward(graphdef)
    totals = np.zeros(3)
    for start in range(0, len(examples), batch_size):
        rows = [assemble(e, spec) for e in examples[start:start + batch_size]]
        batch = sharding.global_batch(_stack(rows, batch_size), mesh)
        totals += np.asarray(jax.device_get(forward(params, batch)))
    loss_sum, weight_sum, correct = totals
    return {"target_tokens": int(weight_sum), "loss": loss_sum / max(weight_sum, 1.0),
            "accuracy": correct / max(weight_sum, 1.0)}


def _prompt_rows(example: Example, spec: RowSpec) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """Expanded ids of the conversation before its last assistant answer, and its vision inputs."""
    expanded = expand_media_slots(example, spec)
    targets = np.flatnonzero(expanded.weights > 0)
    breaks = np.flatnonzero(np.diff(targets) > 1)
    answer_start = int(targets[breaks[-1] + 1] if len(breaks) else targets[0])
    where = f"{example.meta.get('source')}:{example.meta.get('line')}"
    return expanded.ids[:answer_start], vision_arrays(expanded.media, spec, where), answer_start


def _greedy(params, graphdef, examples, spec, mesh, batch_size, max_new_tokens, eos_id) -> list[list[int]]:
    def next_tokens(p, tokens, cursor, vision):
        model = nnx.merge(graphdef, p)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits = model(tokens, positions, jnp.ones_like(tokens), vision_inputs(vision))
        last = jnp.take_along_axis(logits, (cursor - 1)[:, None, None], axis=1)[:, 0]
        return jnp.argmax(last, axis=-1).astype(jnp.int32)

    step = jax.jit(next_tokens)
    outputs = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        prompts = [_prompt_rows(e, spec) for e in chunk]
        tokens = np.full((batch_size, spec.seq_len), spec.pad_id, np.int32)
        cursor = np.ones(batch_size, np.int32)
        for row, (ids, _, length) in enumerate(prompts):
            tokens[row, :length] = ids
            cursor[row] = length
        vision = sharding.global_batch(_stack([v for _, v, _ in prompts], batch_size), mesh)
        generated = [[] for _ in chunk]
        done = np.zeros(batch_size, bool)
        done[len(chunk):] = True
        for _ in range(max_new_tokens):
            if done.all() or cursor.max() >= spec.seq_len:
                break
            batch = sharding.global_batch({"tokens": tokens, "cursor": cursor}, mesh)
            new = np.asarray(jax.device_get(step(params, batch["tokens"], batch["cursor"], vision)))
            for row in range(len(chunk)):
                if done[row]:
                    continue
                generated[row].append(int(new[row]))
                tokens[row, cursor[row]] = new[row]
                cursor[row] += 1
                done[row] = new[row] == eos_id or cursor[row] >= spec.seq_len
        outputs.extend(generated)
    return outputs


def _parses(text: str) -> bool:
    try:
        primitives, _ = parse_answer(text)
    except PrimitiveError:
        return False
    return bool(primitives)


def evaluate_params(params, graphdef, model_cfg: ModelConfig, tokenizer, spec: RowSpec, mesh, data,
                    workdir: Path, fingerprint: dict[str, str], eval_cfg, data_format: str = "vflash",
                    fmt: str | None = None, options: dict | None = None) -> dict:
    """`fmt`/`options`: the data's converter format and options (config.data.eval_format/eval_options);
    None guesses the format from the path."""
    data = Path(data)
    fmt = fmt or _format_of(data)
    shard_set = experiment.ensure_shards(fmt, data, Path(workdir) / "eval_shards",
                                         checkpoint.tokenizer_dir(workdir), fingerprint, options)
    source = shard_set.source()
    count = min(len(shard_set), int(eval_cfg.max_examples))
    examples = [Example.from_bytes(source[i]) for i in range(count)]
    report = {"data": str(data), "format": data_format, "examples": count}
    report.update(teacher_forced(params, graphdef, examples, spec, mesh, int(eval_cfg.batch_size)))
    generated = _greedy(params, graphdef, examples, spec, mesh, int(eval_cfg.batch_size),
                        int(eval_cfg.max_new_tokens), int(tokenizer.eos_token_id))
    texts = [tokenizer.decode([t for t in ids if t != tokenizer.eos_token_id]) for ids in generated]
    references = [e.meta["answers"][-1] for e in examples]
    parsed = [_parses(t) for t in texts]
    report["generation"] = {
        "answers": len(texts),
        "primitive_parse_rate": float(np.mean(parsed)) if texts else 0.0,
        "exact_match_rate": float(np.mean([t == r for t, r in zip(texts, references, strict=True)])),
    }
    report["samples"] = [{"source": f"{e.meta['source']}:{e.meta['line']}", "reference": r, "answer": t,
                          "parses": p} for e, r, t, p in list(zip(examples, references, texts, parsed, strict=True))[:8]]
    return report


def write_report(report: dict, path: str | Path) -> None:
    if jax.process_index() != 0:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def evaluate_workdir(workdir: str | Path, data: str | Path, step: int | None = None) -> dict:
    workdir = Path(workdir).resolve()
    mgr = checkpoint.manager(workdir, read_only=True)
    step = mgr.latest_step() if step is None else step
    if step is None:
        raise checkpoint.CheckpointError(f"{workdir}: no checkpoint to evaluate")
    meta = checkpoint.restore_meta(mgr, step)
    config = ml_collections.ConfigDict(meta["config"])
    fingerprint = meta["tokenizer"]["fingerprint"]
    tokenizer = checkpoint.load_tokenizer(workdir, fingerprint)
    model_cfg = ModelConfig.from_json(meta["model"])
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    layout = TrainLayout.from_config(model_cfg, config.train, mesh)
    state = checkpoint.restore_state(mgr, step, layout.abstract_state())
    mgr.close()
    spec = experiment.row_spec(meta["row"]["seq_len"], meta["row"]["max_patches"], tokenizer, model_cfg,
                               meta["media_kwargs"])
    with jax.set_mesh(mesh):
        report = evaluate_params(state["params"], layout.graphdef, model_cfg, tokenizer, spec, mesh, data,
                                 workdir, fingerprint, config.eval, data_format=config.task)
    report["step"] = step
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--data", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = evaluate_workdir(args.workdir, args.data, args.step)
    write_report(report, args.output)
    print(f"{args.output}: loss {report['loss']:.4f}, accuracy {report['accuracy']:.4f}, "
          f"primitive parse rate {report['generation']['primitive_parse_rate']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
