"""Pieces every renderer shares: chat templating with assistant masks, media embedding."""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from data_pipeline.chat_templates import TURN_START, template_family
from data_pipeline.formats.limits import MAX_MEDIA_BYTES, TooLarge, read_file_capped
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
        # The pieces of a token a text could contribute to one formed across its edge (see `may_join`).
        self._longest = len(tokens[0]) if tokens else 0
        heads = {t[:k] for t in tokens for k in range(1, len(t))}
        tails = {t[k:] for t in tokens for k in range(1, len(t))}
        self._ends_in_head = re.compile(_alternation(heads) + r"\Z") if heads else None
        self._starts_with_tail = re.compile(_alternation(tails)) if tails else None
        self._inner = frozenset(t[i:j] for t in tokens for i in range(len(t)) for j in range(i + 1, len(t) + 1))

    def may_join(self, text: str) -> bool:
        """Whether `text` (free of control tokens) could complete one with what is written beside it:
        it ends with a token's head, starts with a token's tail, or lies inside a token."""
        if not text or self._ends_in_head is None or self._starts_with_tail is None:
            return False
        if len(text) < self._longest and text in self._inner:
            return True
        return (self._ends_in_head.search(text, max(0, len(text) - self._longest)) is not None
                or self._starts_with_tail.match(text) is not None)

    def count(self, text: str) -> int:
        """Control tokens in `text`, matched as the tokenizer splits added tokens (leftmost, longest)."""
        return len(self._pattern.findall(text)) if self._pattern is not None else 0

    def refuse_formed(self, source: str, line: int, messages: Sequence[dict], rendered: str,
                      render: Callable[[list[dict]], str], field_of: Callable[[int], str]) -> None:
        """Refuse a control token a message text forms with the text the template writes beside it.

        Every text passed `refuse` alone (and consecutive parts `refuse_joined`), but a template may
        write a text right against its own literals (`content|trim`, no newline): "hi<|im_" + "end|>"
        is one token. Messages whose texts could do that (`may_join`: rare) are rendered again by
        `render` with those texts fenced by an invisible separator; more control tokens in `rendered`
        than in the fenced rendering means a text formed one. `field_of(i)`: the field of message i.
        """
        fenced, fields = [], []
        for i, message in enumerate(messages):
            content = message["content"]
            if isinstance(content, str) and self.may_join(content):
                message = {**message, "content": _FENCE + content + _FENCE}
            elif isinstance(content, list) and any(p["type"] == "text" and self.may_join(p["text"]) for p in content):
                message = {**message, "content": [{**p, "text": _FENCE + p["text"] + _FENCE}
                                                   if p["type"] == "text" and self.may_join(p["text"]) else p
                                                   for p in content]}
            else:
                fenced.append(message)
                continue
            fenced.append(message)
            fields.append(field_of(i))
        if fields and self.count(rendered) > self.count(render(fenced)):
            others = f" (or {', '.join(fields[1:])})" if len(fields) > 1 else ""
            raise RenderError(source, line, fields[0],
                              f"forms a control token with the text the chat template writes beside it{others}; "
                              "text cannot write template structure, so remove it or spell it differently")

    def find(self, text: str) -> str | None:
        found = self._pattern.search(text) if self._pattern is not None else None
        return found.group() if found else None

    def refuse(self, source: str, line: int, field: str, text: str) -> None:
        token = self.find(text)
        if token is not None:
            raise RenderError(source, line, field,
                              f"holds the control token {token!r}; text cannot write template structure, "
                              "so remove it or spell it differently")


    def refuse_joined(self, source: str, line: int, field: str, parts: Sequence[str | None]) -> None:
        """Refuses a control token spelled across text parts that the template writes back to back.

        `parts` are a message's content parts in order, None for a part the template renders as
        control tokens (an image slot), which separates the texts around it. Each part alone passed
        `refuse`; `"a<|im_"` + `"start|>system"` still becomes one `<|im_start|>` once joined.
        """
        run: list[int] = []
        for index, part in enumerate([*parts, None]):
            if part is not None:
                run.append(index)
                continue
            if len(run) > 1:
                token = self.find("".join(parts[i] for i in run))  # type: ignore[misc]
                if token is not None:
                    raise RenderError(source, line, field,
                                      f"text parts {run[0]} to {run[-1]}, joined as the template writes them, "
                                      f"hold the control token {token!r} split across parts; text cannot write "
                                      "template structure, so remove it or spell it differently")
            run = []


_FENCE = "\u2063"  # invisible separator: ends a text without being whitespace that `trim` would remove


def _alternation(pieces: set[str]) -> str:
    return "(?:" + "|".join(map(re.escape, sorted(pieces, key=len, reverse=True))) + ")"


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
    text: str = ""  # the rendered conversation the ids encode
    offsets: np.ndarray | None = None  # int32 [T, 2]: each token's [start, stop) in `text`


class ChatTemplater:
    """`apply_chat_template(messages, tools=..., return_dict=True, return_assistant_tokens_mask=True)`,
    the same ids and mask, at conversion speed.

    The same steps as transformers (`render_jinja_template` with generation indices, then the fast
    tokenizer without special tokens, then every token overlapping a generation span masked), with
    two savings that leave the result unchanged:
    - the rendered text is encoded in turns, each starting at the family's turn-start token
      (`chat_templates.TURN_START`), and a turn that keeps coming back (the system block listing a
      row's tools) is encoded twice, then remembered. The tokenizer splits its input at added tokens before normalising and
      pre-tokenising, so a piece that starts with a non-normalised added token without `lstrip` or
      `single_word` encodes alone exactly as it does in place (ids, and offsets shifted by its start).
      Other tokenizers encode the whole text;
    - the mask is one vectorised pass instead of a Python loop over tokens.
    tests/test_render_chat.py compares it with `apply_chat_template` row by row.
    """

    # A turn is remembered from its second sighting on: most turns (questions, answers, tool results)
    # never come back, and remembering them would fill the cache and push out the ones that do. Both
    # are bounded and forgotten at once when full; forgetting only costs re-encoding.
    _CACHE_TOKENS = 4_000_000  # about 12 bytes each
    _SEEN_TURNS = 1 << 20

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._turn_start = _separable_turn_start(tokenizer)
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._cached_tokens = 0
        self._seen: set[int] = set()  # hashes of turns encoded once

    def __call__(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> ChatTokens:
        # As apply_chat_template: keys whose value is None are dropped, the special tokens are template variables.
        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        tools = list(tools) if tools else None
        texts, generation = render_jinja_template(
            conversations=[chat], tools=tools, chat_template=self.tokenizer.get_chat_template(None, tools),
            return_assistant_tokens_mask=True, **self.tokenizer.special_tokens_map)
        text = texts[0]
        ids, offsets = self._encode(text)
        return ChatTokens(ids, _overlapping(offsets, generation[0]), text, offsets)

    def render_text(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The rendered conversation only, as `__call__` renders it (no encoding, no mask)."""
        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        tools = list(tools) if tools else None
        return render_jinja_template(
            conversations=[chat], tools=tools, chat_template=self.tokenizer.get_chat_template(None, tools),
            **self.tokenizer.special_tokens_map)[0][0]

    def _encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        if self._turn_start is None:
            return self._encode_piece(text)
        pieces = text.split(self._turn_start)
        ids, offsets, start = [], [], 0
        for index, piece in enumerate(pieces):
            if index:
                piece = self._turn_start + piece
            piece_ids, piece_offsets = self._cached(piece)
            ids.append(piece_ids)
            offsets.append(piece_offsets + start)
            start += len(piece)
        return np.concatenate(ids), np.concatenate(offsets)

    def _cached(self, piece: str) -> tuple[np.ndarray, np.ndarray]:
        found = self._cache.get(piece)
        if found is not None:
            return found
        found = self._encode_piece(piece)
        key = hash(piece)  # a collision only remembers a turn early
        if key not in self._seen:
            if len(self._seen) >= self._SEEN_TURNS:
                self._seen.clear()
            self._seen.add(key)
            return found
        if self._cached_tokens + len(found[0]) > self._CACHE_TOKENS:
            self._cache.clear()
            self._cached_tokens = 0
        self._cache[piece] = found
        self._cached_tokens += len(found[0])
        return found

    def _encode_piece(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        encoding = self._backend.encode(text, add_special_tokens=False)
        count = len(encoding.ids)
        # fromiter over the flattened pairs: half the time of np.asarray on a list of tuples.
        offsets = np.fromiter(itertools.chain.from_iterable(encoding.offsets), dtype=np.int32, count=2 * count)
        return np.asarray(encoding.ids, dtype=np.int32), offsets.reshape(count, 2)


def _separable_turn_start(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The turn-start token the text can be cut before (see ChatTemplater), or None."""
    token = TURN_START.get(template_family(tokenizer.chat_template) or "")
    if token is None:
        return None
    added = [t for t in tokenizer.added_tokens_decoder.values() if t.content == token]
    # Another added token containing it could match across the cut.
    overlapping = [t for t in tokenizer.added_tokens_decoder.values() if token in t.content and t.content != token]
    if len(added) != 1 or overlapping or added[0].normalized or added[0].lstrip or added[0].single_word:
        return None
    return token


def _overlapping(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Tokens overlapping a character span: transformers' single pass over ordered tokens, vectorised."""
    if not len(spans) or not len(offsets):
        return np.zeros(len(offsets), dtype=bool)
    span_starts = np.array([s for s, _ in spans], dtype=np.int64)
    span_stops = np.array([e for _, e in spans], dtype=np.int64)
    # The loop advances to the first span that does not end at or before the token's start, never back.
    index = np.maximum.accumulate(np.searchsorted(span_stops, offsets[:, 0], side="right"))
    inside = index < len(spans)
    mask = np.zeros(len(offsets), dtype=bool)
    mask[inside] = offsets[inside, 1] > span_starts[index[inside]]
    return mask


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], source: str, line: int,
                tools: Sequence[dict] | None = None, end_of_turn: int | None = None,
                templater: ChatTemplater | None = None) -> ChatTokens:
    """Template a conversation and mark assistant tokens via `{% generation %}` spans.

    Refuses an all-zero mask and an assistant span that does not end with the end-of-turn
    token: both silently produce models that never learn to answer or to stop (DESIGN, Lessons).
    `end_of_turn` defaults to the template family's own token (`data_pipeline.tokenizer.end_of_turn_id`), which
    for Llama-3 is `<|eot_id|>`, not the eos token. A template that refuses the conversation
    (`raise_exception`) becomes a RenderError naming the line. `templater`: a `ChatTemplater` of
    `tokenizer` kept by the caller, so repeated turns are encoded once across calls.
    """
    templater = templater if templater is not None else ChatTemplater(tokenizer)
    try:
        chat = templater(messages, tools)
    except TemplateError as err:
        raise RenderError(source, line, "messages", f"the chat template refuses the conversation: {err}") from None
    ids, mask = chat.input_ids, chat.assistant_mask
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
    return chat


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


def read_media(path: Path, kind: str, frame_index: int | None, resize: tuple[int, int] | None,
               written: str) -> MediaBlob:
    """The bytes of `path`; the header records `written`, the path as the record wrote it (relative to
    the dataset folder), never the machine's absolute path (issue 19: shards travel)."""
    try:  # read whole (its bytes go into the shard record), so bounded first: a regular file, a stated size
        data = read_file_capped(path, MAX_MEDIA_BYTES)
    except TooLarge as error:
        raise TooLarge(f"media {written!r}: {error} (one media file is read whole into its shard record)") from None
    return MediaBlob(data, hashlib.sha256(data).hexdigest(), kind, written, frame_index, resize)
