"""`atomic_decoding` announcements found on the device: a small automaton over token ids that the decode
loop (`decoding.loop`) advances with every committed token.

The rule itself has one home, `data_pipeline.primitives` (`parse_announcement` on the text between the
last `<tool_call>` and a `</tool_call>`, as `AtomicCalls.announced` reads ids). Parsing JSON in-graph
would be a second copy of it, so the device recognises one spelling only, the one the seed's answers
use and a trained target writes: the compact JSON `json.dumps` makes with `(",", ":")` separators,
`{"name":"atomic_decoding","arguments":{"block_size":N}}` or `...,"count":M}}`, N and M in 1..9999
without leading zeros. The automaton runs over characters; the host folds it into tables over token
ids (each token's piece of text, decoded after `<tool_call>` as `AtomicCalls` decodes a body), so any
tokenisation of that spelling is read, the numbers accumulated in two registers.

At every `</tool_call>` the automaton reports one event:
- ANNOUNCE (block_size, count): the body was exactly that spelling: `parse_announcement` would return
  the same `Announcement` (the tables are checked against it when they are built);
- NOTHING: no `<tool_call>` before it, or its body already holds a `</tool_call>` (then it is never a
  JSON value, and `parse_announcement` returns None);
- ASK_HOST: any other body (other JSON spacing or key order, another tool, text, a number over 9999,
  a zero): the device cannot tell, so the row stops and the host reads the body with
  `AtomicCalls.announced` (`SpeculativeDecoder`), which also raises on a malformed atomic_decoding call
  exactly as before. That is the one case where the device detection is not exact by itself; it is
  named and answered by the rule's own home, never guessed.
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from data_pipeline.primitives import ATOMIC_DECODING, Announcement, AtomicCalls

# Events at a committed token.
NOTHING, ANNOUNCE, ASK_HOST = 0, 1, 2
# Automaton states below the spelling's own: no <tool_call> yet; after a </tool_call>; inside a call that
# is not the spelling.
NEVER, AFTER, OTHER = 0, 1, 2
LIMIT = 9999  # the largest block_size / count read on the device (registers stay far from int32's range)
_MAX_DIGITS = 3  # digits one token may add: a longer run of digits in one piece is left to the host


class Tables(NamedTuple):
    """Device arrays (a pytree argument of the compiled loop, so they never key a compile)."""

    token_class: jnp.ndarray  # int32 [V]: each token id's class
    next_state: jnp.ndarray  # int32 [C, S]
    multiply: jnp.ndarray  # int32 [C, S, 2]: registers (block_size, count) become r * multiply + add
    add: jnp.ndarray  # int32 [C, S, 2]
    accept: jnp.ndarray  # int32 []: the state after the spelling's last character
    open_id: jnp.ndarray  # int32 []
    close_id: jnp.ndarray  # int32 []
    dense_id: jnp.ndarray  # int32 []
    # The spelling's fixed text as the tokenizer writes it (`spelled_drafts`): from a state at one of its
    # token boundaries, the tokens up to its next number (padded with 0), and how many; 0 elsewhere.
    spelled: jnp.ndarray  # int32 [S, F]
    spelled_length: jnp.ndarray  # int32 [S]


def spelling() -> tuple[str, str, str]:
    """(prefix, between, suffix) of the compact call: prefix N suffix, or prefix N between M suffix."""
    one = json.dumps({"name": ATOMIC_DECODING, "arguments": {"block_size": 7}}, separators=(",", ":"))
    two = json.dumps({"name": ATOMIC_DECODING, "arguments": {"block_size": 7, "count": 9}}, separators=(",", ":"))
    prefix, suffix = one.split("7")
    between = two[len(prefix) + 1:two.index("9")]
    assert two == prefix + "7" + between + "9" + suffix
    return prefix, between, suffix


class _CharAutomaton:
    """The spelling's characters as states 3.. (after NEVER, AFTER, OTHER): `step(state, ch)` → (state,
    register or None, digit), OTHER on any character the spelling has not there."""

    def __init__(self):
        self.prefix, self.between, self.suffix = spelling()
        names = [("P", i) for i in range(len(self.prefix))] + [("first", 0), ("digits", 0), ("first", 1),
                                                                 ("digits", 1)]
        names += [("B", i) for i in range(1, len(self.between))] + [("S", i) for i in range(1, len(self.suffix))]
        names.append(("accept", 0))
        self.index = {name: 3 + i for i, name in enumerate(names)}
        self.names = {v: k for k, v in self.index.items()}
        self.start, self.accept = self.index[("P", 0)], self.index[("accept", 0)]
        self.count = 3 + len(names)

    def _after(self, text: str, i: int, kind: str):
        """The state after matching text[:i + 1] of a literal part."""
        if i + 1 < len(text):
            return self.index[(kind, i + 1)]
        return {"P": self.index[("first", 0)], "B": self.index[("first", 1)], "S": self.accept}[kind]

    def step(self, state: int, ch: str):
        kind, i = self.names[state]
        if kind == "P":
            return (self._after(self.prefix, i, "P"), None, 0) if ch == self.prefix[i] else (OTHER, None, 0)
        if kind == "first":  # JSON has no leading zeros, and 0 is no block_size: both left to the host
            return (self.index[("digits", i)], i, int(ch)) if ch in "123456789" else (OTHER, None, 0)
        if kind == "digits":
            if ch.isdigit() and ch.isascii():
                return state, i, int(ch)
            if i == 0 and ch == self.between[0]:
                return self._after(self.between, 0, "B"), None, 0
            if ch == self.suffix[0]:
                return self._after(self.suffix, 0, "S"), None, 0
            return OTHER, None, 0
        if kind == "B":
            return (self._after(self.between, i, "B"), None, 0) if ch == self.between[i] else (OTHER, None, 0)
        if kind == "S":
            return (self._after(self.suffix, i, "S"), None, 0) if ch == self.suffix[i] else (OTHER, None, 0)
        return OTHER, None, 0  # after the whole spelling, anything but </tool_call> is another body

    def piece(self, state: int, text: str):
        """(state, multiply [2], add [2]) after a token's text from `state`."""
        multiply, add = [1, 1], [0, 0]
        for ch in text:
            state, register, digit = self.step(state, ch)
            if state == OTHER:
                return OTHER, [1, 1], [0, 0]
            if register is not None:
                multiply[register] *= 10
                add[register] = add[register] * 10 + digit
                if multiply[register] > 10 ** _MAX_DIGITS:
                    return OTHER, [1, 1], [0, 0]
        return state, multiply, add


@functools.cache
def _host_tables(tokenizer, open_id: int, close_id: int, vocab_size: int):
    automaton = _CharAutomaton()
    alphabet = set(automaton.prefix + automaton.between + automaton.suffix + "0123456789")
    # A token's text as it reads inside a body: decoded after <tool_call>, as AtomicCalls decodes one.
    head = tokenizer.decode([open_id])
    columns: dict[tuple, int] = {}
    foreign = tuple((s if s in (NEVER, AFTER, OTHER) else OTHER, 1, 1, 0, 0) for s in range(automaton.count))
    columns[foreign] = 0
    token_class = np.zeros(vocab_size, np.int32)
    # Decoding every id of a 150k vocabulary takes a minute; a token whose vocabulary string has a
    # character outside the spelling's is skipped unread. A skipped token that would decode into the
    # spelling (a byte-fallback <0x31>) only sends its body to the host: safe, never a misread.
    raw = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
    for token, string in enumerate(raw):
        if token in (open_id, close_id) or string is None or not set(string) <= alphabet:
            continue
        text = tokenizer.decode([open_id, token])
        text = text[len(head):] if text.startswith(head) else None
        if not text or not set(text) <= alphabet:
            continue
        column = []
        for s in range(automaton.count):
            if s in (NEVER, AFTER, OTHER):
                column.append((s, 1, 1, 0, 0))  # text outside a call, or inside one already not the spelling
                continue
            state, multiply, add = automaton.piece(s, text)
            column.append((state, *multiply, *add))
        token_class[token] = columns.setdefault(tuple(column), len(columns))
    # <tool_call> starts a body from any state, registers cleared; </tool_call> ends one (its event is
    # read from the state before it).
    token_class[open_id] = columns.setdefault(tuple((automaton.start, 0, 0, 0, 0) for _ in range(automaton.count)),
                                              len(columns))
    token_class[close_id] = columns.setdefault(tuple((AFTER, 1, 1, 0, 0) for _ in range(automaton.count)),
                                               len(columns))
    table = np.asarray(list(columns), np.int32)  # [C, S, 5] in class order (dicts keep insertion order)
    return token_class, table, automaton.accept


def spelled_drafts(tokenizer, open_id: int, close_id: int, token_class, next_state, count: int):
    """The tokens the compact spelling forces, for drafting outside blocks (`loop.Passes.verify`): the
    spelling with two numbers, `<tool_call>{"name":"atomic_decoding","arguments":{"block_size":7,"count":9}}`,
    encoded by the tokenizer and walked through the automaton's tables. At each token boundary inside a
    literal part (after `<tool_call>`, after `,"`, ...) the state there maps to the tokens that follow it up
    to the next one holding a digit (a number is the target's to choose) and never `</tool_call>` (the
    token after a spelling is the target's own bonus, so a block's first token stays the drafter's). Inside
    a number (its digits state) the draft guesses that the number ends there: after block_size's digits
    `,"count":` (so the count is the bonus), after count's `}}` (so `</tool_call>` is). The guess is wrong
    when the number goes on (a tokenizer writing digits one by one) or when no count follows; then the pass
    commits the target's own token, as a step would, so the call costs at most as many passes as it would
    undrafted. → (spelled [S, F], spelled_length [S]). The draft is only a proposal: the target verifies
    it, so a target that writes another tool or spelling loses one pass, never a token."""
    prefix, between, suffix = spelling()
    ids = tokenizer.encode("<tool_call>" + prefix + "7" + between + "9" + suffix + "</tool_call>",
                           add_special_tokens=False)
    forced: dict[int, list[int]] = {}
    names = _CharAutomaton().names
    literal = {state for state, (kind, _) in names.items() if kind in ("P", "B", "S", "digits")}
    if open_id in ids:
        body = ids[ids.index(open_id) + 1:]
        state = int(next_state[token_class[open_id], NEVER])
        numbered = [t == close_id or any(ch.isdigit() for ch in tokenizer.decode([t])) for t in body]
        for k, token in enumerate(body):
            if state in literal and not numbered[k]:
                end = next((j for j in range(k, len(body)) if numbered[j]), len(body))
                forced.setdefault(state, body[k:end])
            state = int(next_state[token_class[token], state])
    width = max((len(v) for v in forced.values()), default=0)
    spelled, length = np.zeros((count, width), np.int32), np.zeros(count, np.int32)
    for state, tokens in forced.items():
        spelled[state, :len(tokens)], length[state] = tokens, len(tokens)
    return spelled, length


def states() -> int:
    """The automaton's state count (the tables' second axis): it depends on the spelling only."""
    return _CharAutomaton().count


def tables(calls: AtomicCalls, vocab_size: int) -> Tables:
    """The device tables for `calls`' tokenizer over a model vocabulary of `vocab_size` rows, checked
    against `AtomicCalls.announced` on the spelling (a tokenizer whose decoded pieces do not concatenate
    to the body's text is refused here, not misread later). Built once per tokenizer and ids."""
    return _tables(calls.tokenizer, calls.open_id, calls.close_id, calls.dense_id, int(vocab_size))


@functools.lru_cache(maxsize=16)
def _tables(tokenizer, open_id: int, close_id: int, dense_id: int, vocab_size: int) -> Tables:
    token_class, table, accept = _host_tables(tokenizer, open_id, close_id, vocab_size)
    spelled, spelled_length = spelled_drafts(tokenizer, open_id, close_id, token_class, table[..., 0], table.shape[1])
    found = Tables(jnp.asarray(token_class), jnp.asarray(table[..., 0]), jnp.asarray(table[..., 1:3]),
                   jnp.asarray(table[..., 3:5]), jnp.int32(accept), jnp.int32(open_id),
                   jnp.int32(close_id), jnp.int32(dense_id), jnp.asarray(spelled), jnp.asarray(spelled_length))
    _check(AtomicCalls(tokenizer), found)
    return found


def _check(calls: AtomicCalls, found: Tables) -> None:
    prefix, between, suffix = spelling()
    for block_size, count in [(1, None), (26, 8), (9999, None), (18, 1234)]:
        body = prefix + str(block_size) + (between + str(count) if count else "") + suffix
        ids = calls.tokenizer.encode("<tool_call>" + body + "</tool_call>", add_special_tokens=False)
        state, registers, event = initial(found, ids)
        want = calls.announced(ids)
        if int(event) != ANNOUNCE or want != Announcement(block_size, count) or \
                [int(r) for r in registers] != [block_size, count or 0]:
            raise ValueError(f"the device announcement tables misread {body!r} in this tokenizer's ids {ids} "
                             f"(event {int(event)}, registers {np.asarray(registers).tolist()}, host {want}): "
                             "its tokens' decoded pieces do not concatenate to the body's text")


def advance(found: Tables, state, registers, token):
    """One committed token per row: state int32 [B], registers int32 [B, 2], token int32 [B] → (state,
    registers, event [B]). The event is read from the state before the token (see the module doc)."""
    cls = found.token_class[token]
    registers = registers * found.multiply[cls, state] + found.add[cls, state]
    at_close = token == found.close_id
    event = jnp.where(at_close, jnp.where(state == found.accept, ANNOUNCE,
                                          jnp.where((state == NEVER) | (state == AFTER), NOTHING, ASK_HOST)), NOTHING)
    nxt = found.next_state[cls, state]
    nxt = jnp.where(jnp.any(registers > LIMIT, axis=-1) & (nxt > OTHER), OTHER, nxt)
    return nxt, registers, event


def initial(found: Tables, ids):
    """(state, registers, event of the last id) after one row's ids, on the host (tests, the check)."""
    state, registers, event = jnp.int32(NEVER), jnp.zeros(2, jnp.int32), jnp.int32(NOTHING)
    for token in ids:
        state, registers, event = advance(found, state[None], registers[None], jnp.asarray([token], jnp.int32))
        state, registers, event = state[0], registers[0], event[0]
    return state, registers, event
