"""Valen record → Example of tokenised pieces the loader assembles (seed 000; DESIGN).

Pieces (the loader builds `question` or `shared_state` sequences from them, so the mode and
per-epoch candidate shuffling change without reconverting):
- `state_ids` int32: the state rendered by the chat template up to where a new user turn's
  content begins (system/user/assistant messages of the state, then the question turn's head).
  Media parts become `<|vision_start|><|image_pad|><|vision_end|>`, one slot per item.
- `instruction_ids` + `instruction_offsets` [Q+1]: each question's instructions.
- `candidate_ids` + `candidate_offsets` [C+1]: each candidate's text, starting with a newline so
  it can follow an instruction or another candidate; `candidate_question` [C] its question.
  Choice: "name: description" (the name is part of the input, seed 000); noul: its key
  ("true" then "false"); score: the grade description, list order.
- `suffix_ids`: what closes the question turn (e.g. `<|im_end|>`); a branch is scored there.
- `labels` float32 [C] (the candidate's probability; 0 when unlabeled), `labeled` bool [Q],
  `question_type` int32 [Q] (0 choice, 1 noul, 2 score), `media_{i}` bytes.
Media of a record WITHOUT labels are embedded like any other, although training and evaluation
never read them (seed 000: "If a record has no labels at all, its media is never read"; the
loader drops such a record before laying it out and counts it, evaluation counts its questions
as unlabeled without laying it out): prediction answers every question of every record (seed
000, "Inference"), and one converted file serves all three (configs/valen.py trains and
evaluates on the same file), so the converter cannot know the bytes will go unused. They cost
shard space, never decoding.
Meta keeps what evaluation reads: group_id, record_id, domain, modality, language_bucket,
question ids, candidate keys per question, which labels are hard. The fields, dtypes and
encodings are declared in `data_pipeline.examples` (kind `valen`), which `build` checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from data_pipeline import examples, vocabulary
from data_pipeline.examples import QUESTION_TYPES
from data_pipeline.formats.valen import ValenRecord
from data_pipeline.render.common import ControlTokenGuard, RenderError, read_media
from data_pipeline.shards import Example

_SENTINEL = "\u2063VALEN_QUESTION\u2063"  # invisible separator: never in real text, split point only
_MEDIA_SLOT = vocabulary.VISION_START + vocabulary.IMAGE_PAD + vocabulary.VISION_END


@dataclass(frozen=True)
class ValenLimits:
    """Pieces longer than these are refused with the record's line (issue 4: length limits)."""

    max_state_tokens: int = 4096
    max_instruction_tokens: int = 512
    max_candidate_tokens: int = 256


class ValenRenderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, limits: ValenLimits | None = None):
        self.tokenizer = tokenizer
        self.limits = limits or ValenLimits()
        self._guard = ControlTokenGuard(tokenizer)

    def _check_text(self, record: ValenRecord, field: str, text: str) -> None:
        self._guard.refuse(record.source, record.line, field, text)

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)

    def _state_messages(self, record: ValenRecord) -> list[dict]:
        if isinstance(record.state, str):
            self._check_text(record, "request.state", record.state)
            return [{"role": "user", "content": record.state}] if record.state else []
        messages = []
        for i, message in enumerate(record.state.messages):
            if isinstance(message.content, str):
                self._check_text(record, f"request.state.messages[{i}].content", message.content)
                messages.append({"role": message.role, "content": message.content})
                continue
            texts = []
            for j, part in enumerate(message.content):
                if part.type == "text":
                    self._check_text(record, f"request.state.messages[{i}].content[{j}].text", part.text or "")
                    texts.append(part.text or "")
                else:
                    texts.append(None)
            # Consecutive text parts are joined here: a token split across two of them is one token.
            self._guard.refuse_joined(record.source, record.line, f"request.state.messages[{i}].content", texts)
            messages.append({"role": message.role,
                             "content": "".join(_MEDIA_SLOT if text is None else text for text in texts)})
        return messages

    def _prefix_and_suffix(self, record: ValenRecord) -> tuple[np.ndarray, np.ndarray]:
        messages = self._state_messages(record) + [{"role": "user", "content": _SENTINEL}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        self._guard.refuse_formed(record.source, record.line, messages, text,
                                  lambda fenced: self.tokenizer.apply_chat_template(fenced, tokenize=False),
                                  lambda i: "request.state" if isinstance(record.state, str)
                                  else f"request.state.messages[{i}].content")
        prefix, sentinel, suffix = text.partition(_SENTINEL)
        if not sentinel:
            raise RenderError(record.source, record.line, "request.state", "the chat template dropped the question turn")
        # The branch is scored at the end-of-turn token: trailing newlines after it add nothing.
        return self._encode(prefix), self._encode(suffix.rstrip("\n"))

    def render(self, record: ValenRecord, entry: str) -> Example:
        state_ids, suffix_ids = self._prefix_and_suffix(record)
        if len(state_ids) > self.limits.max_state_tokens:
            raise RenderError(record.source, record.line, "request.state",
                              f"{len(state_ids)} tokens exceed the limit of {self.limits.max_state_tokens}")
        if int((state_ids == self.tokenizer.convert_tokens_to_ids(vocabulary.IMAGE_PAD)).sum()) != len(record.media):
            raise RenderError(record.source, record.line, "request.state", "media slots do not match media parts")
        instructions, candidates, candidate_question, labels, labeled, types = [], [], [], [], [], []
        candidate_keys, hard = [], []
        for q, (question, label) in enumerate(zip(record.questions, record.targets, strict=True)):
            field = f"request.questions.{question.id}"
            self._check_text(record, f"{field}.instructions", question.instructions)
            ids = self._encode(question.instructions)
            if len(ids) > self.limits.max_instruction_tokens:
                raise RenderError(record.source, record.line, f"{field}.instructions",
                                  f"{len(ids)} tokens exceed the limit of {self.limits.max_instruction_tokens}")
            instructions.append(ids)
            for key, text in question.candidates:
                shown = f"{key}: {text}" if question.type == "choice" else text
                self._check_text(record, f"{field}.criteria", shown)
                ids = self._encode("\n" + shown)
                if len(ids) > self.limits.max_candidate_tokens:
                    raise RenderError(record.source, record.line, f"{field}.criteria.{key}",
                                      f"{len(ids)} tokens exceed the limit of {self.limits.max_candidate_tokens}")
                candidates.append(ids)
                candidate_question.append(q)
                labels.append(label.probabilities[key] if label is not None else 0.0)
            labeled.append(label is not None)
            hard.append(bool(label is not None and label.is_hard))
            types.append(QUESTION_TYPES.index(question.type))
            candidate_keys.append(list(question.keys))
        arrays = {
            "state_ids": state_ids, "suffix_ids": suffix_ids,
            "instruction_ids": _concat(instructions), "instruction_offsets": _offsets(instructions),
            "candidate_ids": _concat(candidates), "candidate_offsets": _offsets(candidates),
            "candidate_question": np.asarray(candidate_question, np.int32),
            "labels": np.asarray(labels, np.float32), "labeled": np.asarray(labeled, bool),
            "question_type": np.asarray(types, np.int32),
        }
        media = [read_media(m.path, m.kind, None, None, m.url) for m in record.media]
        for blob, ref in zip(media, record.media, strict=True):
            if ref.sha256 is not None and blob.sha256 != ref.sha256:
                raise RenderError(record.source, record.line, "assets", f"{ref.url} changed since it was validated")
        arrays.update(examples.media_arrays([blob.data for blob in media]))
        return examples.build(
            examples.VALEN, arrays, format="valen", source=record.source, line=record.line, entry=entry,
            group_id=record.group_key, **{key: record.meta.get(key) for key in examples.VALEN_RECORD_META},
            questions=[q.id for q in record.questions], question_types=[q.type for q in record.questions],
            candidate_keys=candidate_keys, hard_labels=hard, media=[blob.header() for blob in media])


def _concat(pieces: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)


def _offsets(pieces: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int32)
