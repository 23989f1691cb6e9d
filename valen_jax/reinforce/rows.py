"""The data stream of a reinforcement run: one row per prompt, with its gold answer riding along.

A chat or vakforge Example holds several trained assistant messages; each gives one prompt (every
token before the message, `evaluation.chat.answer_prompts`, the prompts `evaluate` decodes from) and
its gold answer (seed 003: "uses the assistant message as the gold answer"), the message's text and
tool calls from the Example's meta. The gold answer is UTF-8 JSON in a fixed byte array, so the
rows go through the shared Grain pipeline (order, process sharding, checkpointed iterator state: a
resumed run reads the same prompts) without a side table keyed by record.

Row arrays (batched to [P, ...], P = config.rl.prompts_per_rollout):
  prompt_tokens, prompt_positions int32 [Lp]: the prompt right-padded to Lp = seq_len - max_new_tokens;
  prompt_lengths int32 []; segment_ids int32 [Lp] (1 on prompt tokens: what the loop counts as tokens);
  gold uint8 [gold_bytes], gold_lengths int32 [].
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grain
import jax
import numpy as np
from grain.experimental import FlatMapIterDataset, FlatMapTransform

from data_pipeline import examples as contract
from valen_jax.errors import ConfigError
from valen_jax.evaluation.chat import answer_prompts

# At most this many trained assistant messages per Example (Grain's flat map needs a bound).
MAX_MESSAGES = 256


@dataclass(frozen=True)
class PromptShape:
    prompt_length: int  # Lp
    gold_bytes: int

    @classmethod
    def from_config(cls, config) -> PromptShape:
        return cls(int(config.data.seq_len) - int(config.rl.max_new_tokens), int(config.rl.gold_bytes))


def gold_of(example, message: int) -> dict:
    """The assistant message `message` as the rewards read it: {"content", "tool_calls"}."""
    meta = contract.meta_of(example)
    if meta.answers is None:
        raise ConfigError(f"{contract.where(example)}: the shard records no assistant text (meta `answers`) to use "
                          "as the gold answer; reconvert it (remove WORKDIR/shards)")
    return {"role": "assistant", "content": meta.answers[message], "tool_calls": list(meta.tool_calls[message] or [])}


def encode_gold(gold: dict, size: int, where: str) -> tuple[np.ndarray, int]:
    data = json.dumps(gold, ensure_ascii=False).encode("utf-8")
    if len(data) > size:
        raise ConfigError(f"{where}: its gold answer is {len(data)} bytes as JSON; config.rl.gold_bytes={size} "
                          "holds less (raise it)")
    out = np.zeros(size, np.uint8)
    out[:len(data)] = np.frombuffer(data, np.uint8)
    return out, len(data)


def decode_gold(gold: np.ndarray, length: int) -> dict:
    return json.loads(bytes(np.asarray(gold[:int(length)], np.uint8)).decode("utf-8"))


class _Flatten(FlatMapTransform):
    max_fan_out = MAX_MESSAGES

    def flat_map(self, element):
        return element


@dataclass(frozen=True)
class PromptAssembly:
    """`build_dataset`'s assembly for reinforcement runs (`data.pipeline.RowAssembly`)."""

    shape: PromptShape
    end_of_turn: int  # the tokenizer's end-of-turn id: it closes each trained answer

    def item(self, example, spec, *, training, rng, entry, media_log):
        where = contract.where(example)
        rows = []
        for message, prompt in answer_prompts(example, spec, self.end_of_turn):
            ids = np.asarray(prompt["ids"], np.int32)
            if len(ids) > self.shape.prompt_length:
                raise ConfigError(f"{where}: the prompt before assistant message {message} is {len(ids)} tokens; "
                                  f"config.data.seq_len - config.rl.max_new_tokens = {self.shape.prompt_length} "
                                  "leaves no room for it")
            positions = np.asarray(prompt["positions"], np.int32)
            if positions.ndim != 1:
                raise ConfigError(f"{where}: M-RoPE prompts (images) are refused in reinforcement runs (seed 003)")
            gold, gold_length = encode_gold(gold_of(example, message), self.shape.gold_bytes, where)
            pad = self.shape.prompt_length - len(ids)
            rows.append({"prompt_tokens": np.pad(ids, (0, pad)), "prompt_positions": np.pad(positions, (0, pad)),
                         "prompt_lengths": np.int32(len(ids)),
                         "segment_ids": np.pad(np.ones(len(ids), np.int32), (0, pad)),
                         "gold": gold, "gold_lengths": np.int32(gold_length)})
        if len(rows) > MAX_MESSAGES:
            raise ConfigError(f"{where}: {len(rows)} trained assistant messages; a reinforcement run reads at most "
                              f"{MAX_MESSAGES} per row")
        return rows

    def rows(self, items: grain.IterDataset, spec) -> grain.IterDataset:
        return FlatMapIterDataset(items, _Flatten())

    def batch_shapes(self, spec, global_batch: int) -> dict:
        lp, b = self.shape.prompt_length, int(global_batch)
        s = jax.ShapeDtypeStruct
        return {"prompt_tokens": s((b, lp), np.int32), "prompt_positions": s((b, lp), np.int32),
                "prompt_lengths": s((b,), np.int32), "segment_ids": s((b, lp), np.int32),
                "gold": s((b, self.shape.gold_bytes), np.uint8), "gold_lengths": s((b,), np.int32)}
