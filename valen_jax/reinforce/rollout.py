"""One rollout on the host: G completions per prompt from the decode engine, their rewards, and the
training rows the update reads (`reinforce.update`).

Completion g of prompt p is row p·G + g of one batched, compiled `decoding.generate_ids` call; its random
stream is the engine's `fold_in(fold_in(key(seed), row), token)` with seed `settings.rollout_seed(run seed,
step)`: a pure function of (run seed, step, prompt index, completion index), so a resumed run draws the
same completions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from data_pipeline.chat_templates import template_family
from valen_jax.decoding.engine import generate_ids
from valen_jax.decoding.sampling import Sampling
from valen_jax.evaluation.tokens import decode
from valen_jax.reinforce import rewards as registry
from valen_jax.reinforce.grader import grade
from valen_jax.reinforce.rows import decode_gold
from valen_jax.reinforce.settings import GRADER

# A grader's generate: chat conversations -> answers (`reinforce.grader`).
Generate = Callable[[list[list[dict]]], list[str]]


@dataclass(frozen=True)
class Rollout:
    prompts: list[dict]  # P engine prompts {"ids", "positions"}
    golds: list[dict]  # P gold assistant messages
    completions: list[list[int]]  # P·G generated ids, the stop token kept when reached
    texts: list[str]  # P·G decoded completions (stop token dropped)
    # P·G: whether each completion ended with the stop token within max_new_tokens (the `format` reward
    # reads it); None where it was not recorded, refused by a reward that needs it.
    finished: list[bool] | None = None


def prompts_of(batch: Mapping[str, np.ndarray]) -> tuple[list[dict], list[dict]]:
    """The host batch of `rows.PromptAssembly` -> (engine prompts, gold messages)."""
    prompts, golds = [], []
    for row, length in enumerate(np.asarray(batch["prompt_lengths"])):
        prompts.append({"ids": np.asarray(batch["prompt_tokens"][row, :length]),
                        "positions": np.asarray(batch["prompt_positions"][row, :length])})
        golds.append(decode_gold(batch["gold"][row], batch["gold_lengths"][row]))
    return prompts, golds


def sample(params, graphdef, batch, *, group_size: int, max_new_tokens: int, sampling: Sampling, seed: int,
           tokenizer, end_of_turn: int, mesh) -> Rollout:
    """G completions of every prompt of `batch`, in one batched decode call (each prompt prefilled once)."""
    prompts, golds = prompts_of(batch)
    completions = generate_ids(params, graphdef, prompts, max_new_tokens=max_new_tokens, stop_ids=(end_of_turn,),
                               vocab=len(tokenizer), sampling=sampling, seed=seed, mesh=mesh,
                               local_batch=len(prompts), group_size=group_size)
    texts = [decode(tokenizer, ids, end_of_turn) for ids in completions]
    finished = [len(ids) > 0 and int(ids[-1]) == int(end_of_turn) for ids in completions]
    return Rollout(prompts, golds, completions, texts, finished)


def score(rollout: Rollout, weights: Mapping[str, float], group_size: int, *, tokenizer=None,
          grader: Generate | None = None, grader_instructions: str = "") -> tuple[np.ndarray, dict[str, list[float]]]:
    """(weighted totals [P·G], each reward function's values): the registry's rewards read the gold
    message; the grader reward asks `grader` about (prompt text, completion, gold) for every completion."""
    # Tool calls are read as evaluate reads the run's template family; without a tokenizer (the rewards'
    # own tests) as ChatML, the default template's.
    named = registry.resolve({k: v for k, v in weights.items() if k != GRADER},
                             template_family(tokenizer.chat_template) if tokenizer is not None else "chatml")
    golds = [gold for gold in rollout.golds for _ in range(group_size)]
    # Unrecorded: None for each, which only `format` reads (and refuses).
    finished = rollout.finished if rollout.finished is not None else [None] * len(rollout.texts)
    each = {name: [fn(text, gold, done) for text, gold, done in zip(rollout.texts, golds, finished, strict=True)]
            for name, fn, _ in named}
    totals = np.zeros(len(rollout.texts), np.float64)
    for name, _, weight in named:
        totals += weight * np.asarray(each[name])
    if GRADER in weights:
        if grader is None:
            raise ValueError("config.rl.rewards names 'grader' but no grader model was opened")
        prompt_texts = [[{"role": "user", "content": tokenizer.decode(p["ids"].tolist(), skip_special_tokens=True)}]
                        for p in rollout.prompts]
        items = [(prompt_texts[i // group_size], text, golds[i]) for i, text in enumerate(rollout.texts)]
        scores, unparsed = grade(grader, grader_instructions, items)
        each[GRADER] = scores
        each["grader_unparsed"] = [float(unparsed)]
        totals += float(weights[GRADER]) * np.asarray(scores)
    return totals, each


def training_rows(rollout: Rollout, group_size: int, seq_len: int, window: int) -> dict[str, np.ndarray]:
    """The P·G rows the update reads (`reinforce.update`'s SEQUENCE_KEYS): prompt then completion,
    right-padded to `seq_len` (tokens, positions, segment_ids [N, seq_len]), and the completion window:
    `completion_start` [N], the position whose next token is the completion's first, `targets` [N, window]
    the completion's tokens, `mask` [N, window] 1 on each of them (the stop token included: the policy
    learns to stop). `window` is the longest completion (config.rl.max_new_tokens): only those positions
    get logits."""
    n = len(rollout.completions)
    tokens, positions = np.zeros((n, seq_len), np.int32), np.zeros((n, seq_len), np.int32)
    segment_ids = np.zeros((n, seq_len), np.int32)
    starts = np.zeros((n,), np.int32)
    targets, mask = np.zeros((n, window), np.int32), np.zeros((n, window), np.float32)
    for row, completion in enumerate(rollout.completions):
        prompt = rollout.prompts[row // group_size]
        completion = np.asarray(completion, np.int32)
        ids = np.concatenate([prompt["ids"], completion]).astype(np.int32)
        if len(ids) > seq_len:
            raise ValueError(f"rollout row {row}: {len(ids)} tokens exceed data.seq_len={seq_len}")
        if len(completion) > window:
            raise ValueError(f"rollout row {row}: {len(completion)} completion tokens exceed the window of {window} "
                             "(config.rl.max_new_tokens)")
        start = int(prompt["positions"].max()) + 1  # a generated token's position, as the engine gives it
        length, plen = len(ids), len(prompt["ids"])
        tokens[row, :length] = ids
        positions[row, :plen] = prompt["positions"]
        positions[row, plen:length] = np.arange(start, start + length - plen)
        segment_ids[row, :length] = 1
        starts[row] = plen - 1
        targets[row, :len(completion)] = completion
        mask[row, :len(completion)] = 1.0
    return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids, "completion_start": starts,
            "targets": targets, "mask": mask}


def lengths(rollout: Rollout) -> Sequence[int]:
    return [len(c) for c in rollout.completions]
