"""Text-only baseline (issue 25): the answers a predictor that never sees an image gives, so a report can
say whether its data needs the images at all. A model scoring no better than this baseline may have
learnt only what the text says; data on which the baseline scores 1 can be answered without looking.

The predictor (`TextOnlyPredictor`) answers a record with the most common reference last answer of the
training records whose prompt equals the record's, and, when no training record has that prompt, with
the most common training last answer overall. A prompt (`prompt_key`) is the token ids before the last
trained answer, as the shards hold them, with each run of media-slot tokens collapsed to one token: the
same question about a larger image (more slot tokens once expanded) is the same prompt. Ties between
equally common answers go to the one met first in training data order, so the answer depends on the
data alone.

The training records are the workdir's training data read the way training read it (`training_answers`):
`config.data.train` of the checkpoint's config through `ensure_shards` into `WORKDIR/shards/` (already
converted for a trained workdir; converted again when the data changed), only the first
TRAINING_RECORDS of them, in data order, so the cost stays bounded whatever the training set's size.
Training data that is no longer there (moved, deleted, made with another tokenizer, no longer valid)
raises `TrainingDataUnavailable` with a one-line reason naming the path; the evaluator reports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline.formats.errors import FormatError
from data_pipeline.shards import Example, ShardError
from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.data.shard_cache import ensure_shards
from valen_jax.evaluation import prompts, tokens
from valen_jax.evaluation.workdir import Restored
from valen_jax.training import checkpoint

# Training records read for the baseline: enough for the answer counts of any prompt that repeats, and a
# bounded read (the Examples carry their media bytes) on a training set of millions.
TRAINING_RECORDS = 20_000


class TrainingDataUnavailable(Exception):
    """The workdir's training data cannot be read; the message is one line naming the path."""


def collapse_media(ids: np.ndarray, slot_ids: Sequence[int]) -> np.ndarray:
    """`ids` with each run of media-slot tokens cut to its first token (an expanded or a shard prompt
    alike: a shard keeps one slot per media item, an expanded prompt one per vision token)."""
    ids = np.asarray(ids)
    slot = np.isin(ids, np.asarray(slot_ids, ids.dtype))
    follows_slot = np.concatenate([[False], slot[:-1]])
    return ids[~(slot & follows_slot)]


def prompt_key(example: Example, slot_ids: Sequence[int], end_of_turn: int) -> bytes | None:
    """The digest of the example's prompt (module docstring); None without a trained answer. A digest, not
    the ids: TRAINING_RECORDS prompts of thousands of tokens each would otherwise be held whole."""
    ids, weights = example.arrays["input_ids"], example.arrays["target_weights"]
    spans = prompts.answer_spans(ids, weights, end_of_turn)
    if not spans:
        return None
    return hashlib.sha256(collapse_media(ids[:spans[-1][0]], slot_ids).astype("<i8").tobytes()).digest()


def most_common(counts: dict[str, int]) -> str:
    """The answer with the highest count; of equal counts, the first inserted (`max` returns the first
    maximal item and dicts keep insertion order: the first met in training data order)."""
    return max(counts, key=counts.__getitem__)


@dataclass(frozen=True)
class TextOnlyPredictor:
    by_prompt: dict[bytes, str]  # prompt digest → the most common last answer of its training records
    overall: str  # the most common last answer of all training records
    records: int  # training records it was fitted on

    @classmethod
    def fit(cls, pairs: Iterable[tuple[bytes, str]]) -> TextOnlyPredictor:
        """From (prompt digest, reference last answer) of training records, in data order."""
        per_prompt: dict[bytes, dict[str, int]] = {}
        overall: dict[str, int] = {}
        records = 0
        for key, answer in pairs:
            counts = per_prompt.setdefault(key, {})
            counts[answer] = counts.get(answer, 0) + 1
            overall[answer] = overall.get(answer, 0) + 1
            records += 1
        if not records:
            raise TrainingDataUnavailable("no training records to learn a text-only answer from")
        return cls({key: most_common(counts) for key, counts in per_prompt.items()}, most_common(overall), records)

    def answer(self, key: bytes) -> tuple[str, bool]:
        """(the answer for prompt `key`, whether a training record had that prompt)."""
        if key in self.by_prompt:
            return self.by_prompt[key], True
        return self.overall, False


def training_pairs(examples: Iterable[Example], slot_ids: Sequence[int], end_of_turn: int
                   ) -> Iterable[tuple[bytes, str]]:
    """(prompt digest, reference last answer) of each training Example, in order; a record the baseline
    cannot read (no trained answer, shards without reference answers) makes the data unavailable."""
    for example in examples:
        answers = contract.meta_of(example).answers
        if not answers:
            raise TrainingDataUnavailable(f"{contract.where(example)}: training shards without reference answers "
                                          "(meta `answers`, converted before they were recorded)")
        key = prompt_key(example, slot_ids, end_of_turn)
        if key is None:
            raise TrainingDataUnavailable(f"{contract.where(example)}: a training record without a trained answer")
        yield key, answers[-1]


def _training_examples(restored: Restored, limit: int) -> Iterable[Example]:
    """The first `limit` training Examples of the workdir (module docstring), read one at a time."""
    data = restored.config.data
    if not isinstance(data.train, str):
        raise TrainingDataUnavailable(f"config.data.train is {data.train!r}, not one path")
    path = Path(data.train)
    if not path.exists():
        raise TrainingDataUnavailable(f"the training data {path} (config.data.train) is not there: moved or "
                                      "deleted since training")
    try:
        shard_set = ensure_shards(data.format, path, restored.workdir / "shards",
                                  checkpoint.tokenizer_dir(restored.workdir), restored.fingerprint,
                                  data.train_options.to_dict())
    except (OSError, ShardError, FormatError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise TrainingDataUnavailable(f"the training data {path} (config.data.train) cannot be read: {first}") from None
    source = shard_set.source()
    for i in range(min(len(shard_set), limit)):
        yield Example.from_bytes(source[i])


def fit_training(restored: Restored, limit: int = TRAINING_RECORDS) -> TextOnlyPredictor:
    """The predictor of the workdir's first `limit` training records; TrainingDataUnavailable when they
    cannot be read."""
    eot = end_of_turn_id(restored.tokenizer)
    return TextOnlyPredictor.fit(training_pairs(_training_examples(restored, limit), tokens.media_slot_ids(restored.spec),
                                                eot))
