"""Pieces every renderer shares: chat templating with assistant masks, media embedding."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from data_pipeline.tokenizer import end_of_turn_id


def control_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Tokens that carry template structure: special added tokens, and added tokens the template writes.

    The same rule transformers uses for `sanitize_control_tokens`; primitive and number tokens
    (`<point>`, `<12>`) are ordinary added tokens that user and assistant text may hold.
    """
    template = tokenizer.chat_template or ""
    found = {t.content for t in tokenizer.added_tokens_decoder.values()
             if t.special or (t.content in template and not t.content.isspace())}
    return tuple(sorted(found))


class ControlTokenGuard:
    """Refuses text that spells a control token: tokenised as one, it would forge template structure."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, allowed: frozenset[str] = frozenset()):
        tokens = sorted(set(control_tokens(tokenizer)) - allowed, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, tokens))) if tokens else None

    def find(self, text: str) -> str | None:
        found = self._pattern.search(text) if self._pattern is not None else None
        return found.group() if found else None

    def refuse(self, source: str, line: int, field: str, text: str) -> None:
        token = self.find(text)
        if token is not None:
            raise RenderError(source, line, field,
                              f"holds the control token {token!r}; text cannot write template structure, "
                              "so remove it or spell it differently")


class RenderError(ValueError):
    """A record that validates but cannot be trained on as given; names the source line."""

    def __init__(self, source: str, line: int, field: str, message: str):
        super().__init__(f"{source}:{line}: {field}: {message}")
        self.source, self.line, self.field, self.message = source, line, field, message

    def __reduce__(self):
        # A worker's error must unpickle in the parent; the default would call __init__ with one argument
        # and hang multiprocessing's result thread.
        return (type(self), (self.source, self.line, self.field, self.message))


@dataclass(frozen=True)
class ChatTokens:
    input_ids: np.ndarray  # int32 [T]
    assistant_mask: np.ndarray  # bool [T]; True where the token is a target to train on


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], source: str, line: int,
                tools: Sequence[dict] | None = None, end_of_turn: int | None = None) -> ChatTokens:
    """Template a conversation and mark assistant tokens via `{% generation %}` spans.

    Refuses an all-zero mask and an assistant span that does not end with the end-of-turn
    token: both silently produce models that never learn to answer or to stop (DESIGN, Lessons).
    `end_of_turn` defaults to the template family's own token (`data_pipeline.tokenizer.end_of_turn_id`), which
    for Llama-3 is `<|eot_id|>`, not the eos token. A template that refuses the conversation
    (`raise_exception`) becomes a RenderError naming the line.
    """
    try:
        encoded = tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True)
    except TemplateError as err:
        raise RenderError(source, line, "messages", f"the chat template refuses the conversation: {err}") from None
    ids = np.asarray(encoded["input_ids"], dtype=np.int32)
    mask = np.asarray(encoded["assistant_masks"], dtype=bool)
    if not mask.any():
        raise RenderError(source, line, "conversations", "the chat template marks no assistant token")
    if end_of_turn is None:
        end_of_turn = end_of_turn_id(tokenizer)
    for _, stop in mask_runs(mask):
        if ids[stop - 1] != end_of_turn:
            raise RenderError(source, line, "conversations",
                              f"an assistant span ends with token {int(ids[stop - 1])}, not the end-of-turn "
                              f"token {tokenizer.convert_ids_to_tokens(end_of_turn)!r}; "
                              "the model would never learn to stop")
    return ChatTokens(ids, mask)


def mask_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True values, in order."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


@dataclass(frozen=True)
class MediaBlob:
    """Original media bytes travel inside the shard so shards train anywhere (DESIGN)."""

    data: bytes
    sha256: str
    kind: str
    source_path: str
    frame_index: int | None
    resize: tuple[int, int] | None
    lmdb_key: str | None = None

    def header(self) -> dict:
        header = {"sha256": self.sha256, "kind": self.kind, "path": self.source_path,
                  "frame_index": self.frame_index, "resize": list(self.resize) if self.resize else None}
        if self.lmdb_key is not None:  # only LMDB items, so other shards keep their bytes
            header["lmdb_key"] = self.lmdb_key
        return header


def read_media(path: Path, kind: str, frame_index: int | None, resize: tuple[int, int] | None) -> MediaBlob:
    data = path.read_bytes()
    return MediaBlob(data, hashlib.sha256(data).hexdigest(), kind, str(path), frame_index, resize)
