"""Log-probabilities of a choice's tokens, in OpenAI's two shapes.

Computed after the tokens are chosen, by one teacher-forced forward of the model over the sequence
(prompt and generated tokens; logits made only for the rows to report) with float32 `log_softmax` over
the tokenizer's vocabulary (padding rows of
the embedding are never sampled, so never counted), whatever engine chose the tokens (plain or
speculative): the log-probability of token t is read from the logits at t - 1, as decoding read them. A
sequence's program is compiled per length bucket (`engine.bucket`), as prefills are.

Shapes: chat's `logprobs.content[]` entries `{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}`; completions' `{tokens, token_logprobs, top_logprobs, text_offset}` with the first prompt token's
entries null (nothing precedes it). A token's `bytes` are its exact UTF-8 bytes (a byte-level BPE token
can hold half a character; its `token` text then shows U+FFFD for the half)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from valen_jax.decoding.engine import bucket
from valen_jax.serving.protocol import TOP_LOGPROBS


@functools.cache
def _scorer(graphdef, vocab: int, length: int, window: int):
    def score(params, tokens, count, start):
        """tokens [1, length] (the first `count` real) → for t in start + 1 .. start + window: log p(tokens[t])
        and the `TOP_LOGPROBS` most likely tokens at t with their log-probabilities. Only those `window`
        rows of logits are made: a long sequence's [length, vocab] logits would not fit a device's memory."""
        model = nnx.merge(graphdef, params)
        positions = jnp.arange(length, dtype=jnp.int32)[None]
        segments = (positions < count).astype(jnp.int32)  # padding is segment 0: real tokens never see it
        hidden = jax.lax.dynamic_slice_in_dim(model.hidden(tokens, positions, segments), start, window, axis=1)
        logp = jax.nn.log_softmax(model.logits(hidden)[0, :, :vocab].astype(jnp.float32), axis=-1)
        following = jax.lax.dynamic_slice_in_dim(tokens[0], start + 1, window)
        chosen = jnp.take_along_axis(logp, following[:, None], axis=-1)[:, 0]
        top_values, top_ids = jax.lax.top_k(logp, TOP_LOGPROBS)
        return chosen, top_values, top_ids
    return jax.jit(score)


class Scores:
    """log p of tokens `first ..` of a sequence given those before them, and the most likely alternatives."""

    def __init__(self, first: int, chosen: np.ndarray, top_values: np.ndarray, top_ids: np.ndarray):
        self.first, self.chosen, self.top_values, self.top_ids = first, chosen, top_values, top_ids

    def of(self, t: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        """Token t's (t >= max(first, 1)) log-probability and its `top` alternatives (id, log-probability)."""
        row = t - self.first
        ids, values = self.top_ids[row, :top], self.top_values[row, :top]
        return float(self.chosen[row]), [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]


def score(restored, vocab: int, ids, first: int = 1) -> Scores:
    """The teacher-forced scores of tokens `first ..` of token ids `ids` (the first token has none: `first`
    at least 1). Blocking: the routes run it in a worker thread. Compiled per (sequence bucket, scored
    rows bucket), both `engine.bucket`s."""
    ids, first = np.asarray(ids, np.int32), max(int(first), 1)
    window = bucket(len(ids) - first)
    length = bucket(max(len(ids), first - 1 + window + 1))  # the window never runs past the tokens
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :len(ids)] = ids
    chosen, top_values, top_ids = _scorer(restored.graphdef, int(vocab), length, window)(
        restored.params, tokens, np.int32(len(ids)), np.int32(first - 1))
    n = len(ids) - first
    return Scores(first, np.asarray(chosen)[:n], np.asarray(top_values)[:n], np.asarray(top_ids)[:n])


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (Qwen's and Llama 3's tokenizers): each character → the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(b)
        else:
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in enumerate(chars)}


class TokenText:
    """A tokenizer's tokens as OpenAI shows them: text and exact bytes (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        self.special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        if token not in self._cache:
            text = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            raw = text.encode("utf-8")
            if self.byte_level and token not in self.special:
                piece, table = self.tokenizer.convert_ids_to_tokens(token), _byte_decoder()
                if piece is not None and all(c in table for c in piece):
                    raw = bytes(table[c] for c in piece)
            self._cache[token] = (text, raw)
        return self._cache[token]

    def covered(self, tokens: list[int], text: str) -> int:
        """How many of `tokens` (from the first) it takes to write `text`, a prefix of their decoded text:
        the tokens whose entries go with that text (a stop string cuts the text inside a choice's tokens)."""
        want, have = len(text.encode("utf-8")), 0
        for k, token in enumerate(tokens):
            if have >= want:
                return k
            have += len(self(token)[1])
        return len(tokens)


def chat_entries(text: TokenText, scores: Scores, tokens: list[int], start: int, top: int) -> list[dict]:
    """Chat `logprobs.content` entries of sequence positions `start .. start + len(tokens) - 1`."""
    def entry(token: int, logprob: float) -> dict:
        shown, raw = text(token)
        return {"token": shown, "logprob": logprob, "bytes": list(raw)}

    out = []
    for k, token in enumerate(tokens):
        logprob, alternatives = scores.of(start + k, top)
        out.append(dict(entry(token, logprob), top_logprobs=[entry(i, v) for i, v in alternatives]))
    return out


def completion_entries(text: TokenText, scores: Scores, tokens: list[int], start: int, top: int,
                       offset: int) -> dict:
    """Completions `logprobs` of sequence positions `start ..` (`start` 0: the first has no log-probability),
    their text offsets counted from `offset` (the choice's text so far); `next_offset`: the offset after them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for k, token in enumerate(tokens):
        shown = text(token)[0]
        out["tokens"].append(shown)
        out["text_offset"].append(offset)
        offset += len(shown)
        if start + k == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        logprob, alternatives = scores.of(start + k, top)
        out["token_logprobs"].append(logprob)
        # A dict by token text, as OpenAI's legacy shape (two ids with one text keep the likelier).
        tops: dict[str, float] = {}
        for i, v in alternatives:
            tops.setdefault(text(i)[0], v)
        out["top_logprobs"].append(tops)
    out["next_offset"] = offset
    return out


class ChoiceLogprobs:
    """The log-probability entries of one served choice, as its text goes out: entries for the tokens that
    wrote the text sent so far (`TokenText.covered`: a stop string's tokens, cut from the text, get none;
    chat: the end-of-turn token neither, it is not content), and for a completion with `echo` the prompt's
    tokens first. Completions list the end-of-turn token that ended a choice, as OpenAI's list
    `<|endoftext|>` (lm-eval drops the one generated token of its loglikelihood requests by position).
    `score(ids)`: the service's blocking `Service.scores`."""

    def __init__(self, score, text: TokenText, prompt: list[int], top: int, *, chat: bool, echo: bool,
                 stop_ids: frozenset):
        self.score, self.text, self.prompt, self.top = score, text, [int(t) for t in prompt], top
        self.chat, self.stop_ids = chat, stop_ids
        self.reported = 0  # generated tokens whose entries went out
        self.echo_due = echo  # the prompt's entries have yet to go out
        self.offset = 0  # completions: text_offset of the next token (the choice's text so far)

    def due(self, tokens: list[int], sent: str, final: bool, stopped_by_token: bool) -> int:
        """How many generated tokens have entries once `sent` is out."""
        texted = tokens[:-1] if tokens and tokens[-1] in self.stop_ids else tokens
        covered = self.text.covered(texted, sent)
        if final and not self.chat and stopped_by_token and covered == len(texted) < len(tokens):
            return len(tokens)
        return covered

    def entries(self, tokens: list[int], sent: str, final: bool, stopped_by_token: bool):
        """The entries not yet sent (chat: a list; completions: the dict of lists), or None when there are
        none. Blocking (a forward of the model): the routes run it in a worker thread."""
        upto = self.due(tokens, sent, final, stopped_by_token)
        first = 0 if self.echo_due else len(self.prompt) + self.reported
        last = len(self.prompt) + upto
        if last <= first:
            return None
        sequence = self.prompt + [int(t) for t in tokens[:upto]]
        scores = self.score(sequence, first)
        self.reported, self.echo_due = upto, False
        if self.chat:
            return chat_entries(self.text, scores, sequence[first:last], first, self.top)
        out = completion_entries(self.text, scores, sequence[first:last], first, self.top, self.offset)
        self.offset = out.pop("next_offset")
        return out


def merged(a, b):
    """Two consecutive batches of entries (either may be None) as one."""
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, list):
        return a + b
    return {key: a[key] + b[key] for key in a}
