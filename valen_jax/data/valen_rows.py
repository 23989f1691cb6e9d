"""Valen Example pieces → one row in `question` or `shared_state` mode (seed 000; DESIGN).

question mode: the state once, then one branch per candidate (instructions + candidate +
suffix); `branch_ids` let each branch attend to the prefix and itself only, and positions
restart after the prefix, so a branch's score equals that of the separate sequence
prefix + branch. In training, unlabeled questions are skipped and a record without labels is
skipped whole (before its media is read).
shared_state mode: the state, then every question's instructions followed by all its
candidates in one causal sequence; each candidate is scored at its last token in one forward
pass. Unlabeled questions stay as context with no loss.
Training shuffles choice candidates together with their labels (a fresh order per epoch from
the rng); inference keeps the input order (seed 000 table).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data_pipeline.shards import Example
from valen_jax.data.assemble import AssemblyError, RowSpec, expand_slots, process_media, vision_arrays

MODES = ("question", "shared_state")
_CHOICE = 0


@dataclass(frozen=True)
class QuestionSpec:
    mode: str
    max_questions: int
    max_candidates: int
    training: bool

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"valen mode {self.mode!r}; choose one of {MODES}")

    @classmethod
    def from_config(cls, config, training: bool) -> QuestionSpec:
        data = config.data
        return cls(data.valen_mode, int(data.max_questions), int(data.max_candidates), training)


def _pieces(ids: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def _where(example: Example) -> str:
    return f"{example.meta.get('source', '?')}:{example.meta.get('line', '?')}"


def has_labels(example: Example) -> bool:
    return bool(example.arrays["labeled"].any())


def valen_row(example: Example, spec: RowSpec, qspec: QuestionSpec, rng: np.random.Generator | None) -> dict:
    arrays = example.arrays
    where = _where(example)
    if qspec.training and not has_labels(example):
        raise AssemblyError(f"{where}: no labeled question; filter such records before assembly")
    instructions = _pieces(arrays["instruction_ids"], arrays["instruction_offsets"])
    candidates = _pieces(arrays["candidate_ids"], arrays["candidate_offsets"])
    owner = arrays["candidate_question"]
    questions = [q for q in range(len(instructions))
                 if not (qspec.training and qspec.mode == "question" and not arrays["labeled"][q])]
    if len(questions) > qspec.max_questions:
        raise AssemblyError(f"{where}: {len(questions)} questions exceed data.max_questions={qspec.max_questions}")

    media = process_media(example, spec)
    state, _ = expand_slots(arrays["state_ids"], np.zeros(len(arrays["state_ids"]), np.float32), media, spec, where)
    suffix = arrays["suffix_ids"]
    tokens, positions, branch_ids = [state], [np.arange(len(state))], [np.zeros(len(state), np.int32)]
    length = len(state)
    shape = (qspec.max_questions, qspec.max_candidates)
    score_positions = np.zeros(shape, np.int32)
    branch_mask = np.zeros(shape, bool)
    labels = np.zeros(shape, np.float32)
    order_out = np.full(shape, -1, np.int32)  # candidate index in the record, for predictions
    branch = 0
    for slot, q in enumerate(questions):
        members = np.flatnonzero(owner == q)
        if len(members) > qspec.max_candidates:
            raise AssemblyError(f"{where}: question {q} has {len(members)} candidates; "
                                f"data.max_candidates={qspec.max_candidates}")
        if qspec.training and arrays["question_type"][q] == _CHOICE and rng is not None:
            members = rng.permutation(members)
        if qspec.mode == "shared_state":
            tokens.append(instructions[q])
            positions.append(length + np.arange(len(instructions[q])))
            branch_ids.append(np.zeros(len(instructions[q]), np.int32))
            length += len(instructions[q])
        for k, c in enumerate(members):
            if qspec.mode == "question":
                branch += 1
                piece = np.concatenate([instructions[q], candidates[c], suffix])
                positions.append(len(state) + np.arange(len(piece)))
                branch_ids.append(np.full(len(piece), branch, np.int32))
            else:
                piece = candidates[c]
                positions.append(length + np.arange(len(piece)))
                branch_ids.append(np.zeros(len(piece), np.int32))
            tokens.append(piece)
            length += len(piece)
            score_positions[slot, k] = length - 1
            branch_mask[slot, k] = True
            labels[slot, k] = arrays["labels"][c]
            order_out[slot, k] = c
    if qspec.mode == "shared_state":
        tokens.append(suffix)
        positions.append(length + np.arange(len(suffix)))
        branch_ids.append(np.zeros(len(suffix), np.int32))
        length += len(suffix)
    if length > spec.seq_len:
        raise AssemblyError(f"{where}: {length} tokens in {qspec.mode} mode exceed data.seq_len={spec.seq_len}")
    pad = spec.seq_len - length
    ids = np.concatenate(tokens).astype(np.int32)
    labeled = np.zeros(qspec.max_questions, bool)
    labeled[: len(questions)] = arrays["labeled"][questions]
    return {
        "tokens": np.pad(ids, (0, pad), constant_values=spec.pad_id),
        # Valen trains the branch head only: no token is a language-model target.
        "targets": np.full(spec.seq_len, spec.pad_id, np.int32),
        "target_weights": np.zeros(spec.seq_len, np.float32),
        "positions": np.pad(np.concatenate(positions).astype(np.int32), (0, pad)),
        "segment_ids": np.pad(np.ones(length, np.int32), (0, pad)),
        "branch_ids": np.pad(np.concatenate(branch_ids), (0, pad)),
        "score_positions": score_positions, "branch_mask": branch_mask, "labels": labels, "labeled": labeled,
        "question_state": np.where(np.arange(qspec.max_questions) < len(questions), 1, 0).astype(np.int32),
        "candidate_index": order_out,
        **vision_arrays(media, spec, where),
    }
