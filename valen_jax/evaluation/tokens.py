"""Token-level evaluation shared by VFlash, chat, vakforge and training's periodic evaluation:
teacher-forced sums per example (the one teacher-forced path), and greedy decoding of an assistant
answer from the conversation before it (KV-cache generation, `valen_jax.decoding`).

`token_sums` and `greedy` run the examples this process was given, in global batches that all
processes enter together (`hosts.batch_count`), and return results for its own examples only;
`teacher_forced` takes the whole data, evaluates this process's slice and adds every process's sums.
The per-token formula is the training loss's (`losses.token_losses`), so `eval_loss` during
training and `loss` in a report are the same number for the same params.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data_pipeline.shards import Example
from valen_jax.data.assemble import RowSpec, assemble, vision_arrays
from valen_jax.decoding import generate_ids
from valen_jax.evaluation import hosts
from valen_jax.evaluation.workdir import host_local, local_batch_size, stack
from valen_jax.models import sharding
from valen_jax.training.losses import token_losses
from valen_jax.training.step import vision_inputs


@functools.cache
def _row_sums_fn(graphdef):
    # One compiled forward per model (and batch shape): periodic evaluation reuses it every time.
    def row_sums(params, batch):
        model = nnx.merge(graphdef, params)
        logits = model(batch["tokens"], batch["positions"], batch["segment_ids"], vision_inputs(batch))

        def one_row(logits, targets, weights):
            sums = token_losses(logits[None], targets[None], weights[None])
            return jnp.stack([sums["ce"], sums["correct"], sums["weight"]])

        return jax.vmap(one_row)(logits, batch["targets"], batch["target_weights"])

    return jax.jit(row_sums)


def token_sums(params, graphdef, examples: list[Example], spec: RowSpec, mesh, local_batch: int,
               batches: int) -> np.ndarray:
    """float64 [len(examples), 3]: Σ w·(−ln q(target)), Σ w·[argmax = target], Σ w per example."""
    return row_sums(params, graphdef, [assemble(e, spec) for e in examples], spec, mesh, local_batch, batches)


def row_sums(params, graphdef, rows: list[dict], spec: RowSpec, mesh, local_batch: int, batches: int) -> np.ndarray:
    """`token_sums` of assembled rows (`assemble.assemble`), e.g. rows whose patches were swapped."""
    fn = _row_sums_fn(graphdef)
    out = []
    for b in range(batches):
        chunk = rows[b * local_batch:(b + 1) * local_batch]
        batch = sharding.global_batch(stack(chunk or [_empty_row(spec)], local_batch), mesh)
        sums = host_local(fn(params, batch), mesh).astype(np.float64)
        out.append(sums[:len(chunk)])
    return np.concatenate(out) if out else np.zeros((0, 3))


def local_rows(examples: list[Example], spec: RowSpec) -> list[dict]:
    """This process's slice of `examples` (the whole data, the same list on every process), assembled."""
    return [assemble(examples[i], spec) for i in hosts.local_indices(len(examples))]


def forced_sums(params, graphdef, rows: list[dict], count: int, spec: RowSpec, mesh, batch_size: int
                ) -> np.ndarray:
    """`row_sums` of this process's `rows` (`local_rows` of `count` examples), in the number of global
    batches of `batch_size` rows every process runs."""
    local_batch = local_batch_size(batch_size, mesh)
    return row_sums(params, graphdef, rows, spec, mesh, local_batch, hosts.batch_count(count, local_batch))


def forced_metrics(sums: np.ndarray) -> dict[str, float]:
    """Loss and next-token accuracy from every process's per-row sums (added before the ratios are formed)."""
    nll, correct, weight = hosts.sum_array(sums.sum(axis=0))
    return {"target_tokens": int(weight), "loss": nll / max(weight, 1.0), "accuracy": correct / max(weight, 1.0)}


def teacher_forced(params, graphdef, examples: list[Example], spec: RowSpec, mesh, batch_size: int
                   ) -> dict[str, float]:
    """Loss and next-token accuracy over the supervised tokens of `examples` (the whole data, the
    same list on every process): each process runs its slice, the sums of all processes are added
    before the ratios are formed. `batch_size`: rows per global batch."""
    return forced_metrics(forced_sums(params, graphdef, local_rows(examples, spec), len(examples), spec, mesh,
                                      batch_size))


def _empty_row(spec: RowSpec) -> dict[str, np.ndarray]:
    """An all-padding row, for a process that has run out of examples while others have not."""
    return {"tokens": np.zeros(spec.seq_len, np.int32), "targets": np.zeros(spec.seq_len, np.int32),
            "target_weights": np.zeros(spec.seq_len, np.float32),
            "positions": np.zeros(spec.positions.shape(spec.seq_len), np.int32),
            "segment_ids": np.zeros(spec.seq_len, np.int32),
            **vision_arrays([], spec, "padding")}


def media_slot_ids(spec: RowSpec) -> list[int]:
    """The tokens media slots are made of (`assemble.expand_slots`): image pads, and video pads for a model with them."""
    return [spec.image_pad_id] + ([spec.video.video_pad_id] if spec.video is not None else [])


def greedy(params, graphdef, prompts: list[dict], spec: RowSpec, mesh, local_batch: int, batches: int,
           max_new_tokens: int, stop_id: int, vocab: int) -> list[list[int]]:
    """Greedy continuation of each prompt (`prompts.Prompts.prompt`) until `stop_id` (kept), `max_new_tokens`
    or the row's end (prompt + generated reaching spec.seq_len), with the KV-cache engine
    (`valen_jax.decoding`). A generated token's position is the largest before it + 1 (on every M-RoPE
    axis), as HF's generate continues after rope_index's prompt positions."""
    for index, prompt in enumerate(prompts):
        if len(prompt["ids"]) >= spec.seq_len:
            raise ValueError(f"prompt {index}: {len(prompt['ids'])} tokens leave no room in seq_len={spec.seq_len}")
    # One budget for every process (it shapes the compiled loop): the most any row here may take;
    # each row is then cut at its own room, which keeps exactly the tokens a row-capped run makes
    # (rows never influence each other).
    room = max((spec.seq_len - len(p["ids"]) for p in prompts), default=1)
    budget = min(int(max_new_tokens), int(hosts.process_gather(np.asarray([room])).max()))
    generated = generate_ids(params, graphdef, prompts, max_new_tokens=budget, stop_ids=(stop_id,), vocab=vocab,
                             mesh=mesh, local_batch=local_batch, batches=batches)
    return [ids[:spec.seq_len - len(p["ids"])] for ids, p in zip(generated, prompts, strict=True)]


def decode(tokenizer, ids: list[int], stop_id: int) -> str:
    """Generated ids as text, without the stop token; special tokens such as `<tool_call>` kept."""
    return tokenizer.decode([t for t in ids if t != stop_id], skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
