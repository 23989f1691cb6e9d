"""Speculative atomic decoding (seed 004, issue 16): a drafter proposes an announced primitive block,
the target verifies it in ONE pass over its KV cache, and the output is the target's own.

Outside announced blocks the target decodes one token per step, as `engine.generate_ids` does. When
the committed ids complete an `atomic_decoding` tool call (`data_pipeline.primitives.AtomicCalls`, by
token ids: `</tool_call>` just committed; the ids back to the last `<tool_call>` read by
`parse_announcement`), the blocks it announces, the next `block_size` tokens each (seed 004: every
token of the primitive, start and end tags included; `count` blocks for `<dense>` motion, one block
otherwise: `Announcement.blocks`), are drafted and verified:

- the drafter proposes the d tokens still missing from the block (d capped by the token budget);
- one `extend` pass over [last committed token, proposal] gives the target's logits at all d + 1 slots;
- greedy: accept the longest prefix where proposal == target argmax, then commit the target's own next
  token (the bonus). Sampling: standard speculative rejection sampling (Leviathan et al. 2023; Chen et
  al. 2023): accept x_k with probability min(1, p(x_k) / q(x_k)); at the first rejection draw from
  norm(max(p - q, 0)); when all are accepted draw the bonus from p. The emitted tokens then follow p
  exactly (p: the target's distribution after `Sampling`'s temperature/top-k/top-p);
- crop: the row's cursor moves to its committed length. Slots above hold the rejected tail's keys; a
  query attends slots <= its own only, and the next pass writes those slots before any query reads them.
- if the block is not complete, draft again for the rest.

Statistics (`BlockStats`): tau = tokens committed per target pass inside blocks, the bonus token
INCLUDED (an oracle drafter on a block of B tokens gives tau = B + 1: B accepted + the bonus, one pass);
per-position acceptance; a histogram over 0..B of the draft tokens accepted per pass.

Two paths, one row (prompt) per call, the same rules and statistics:
- fast (a device drafter: `CachedDrafter` / `TrainedDrafter`, `ScriptedDrafter`, `RandomDrafter`,
  `OracleDrafter`): each announced block is ONE compiled `lax.while_loop` (draft → verify → accept →
  advance both caches → write the committed tokens), no host round trip inside a block
  (`block_loop`). The trained drafter's context keys/values are cached once per token from the
  target's own prefill / decode / verify passes (`Transformer.prefill(collect=)`), so a pass costs one
  small drafter forward over B + 1 slots (`draft_rules`). Targets with a vision tower and M-RoPE
  positions are decoded with the prompt's image (`generate(prompt, ..., vision_inputs=)` or an engine
  prompt dict); generated tokens continue after the prompt's largest position, as the engine does;
- host (any other object with `propose(context, block, key)`): a Python loop around jitted prefill /
  decode_step / extend passes, for drafters written in Python (tests, experiments).

Fast path:

    drafter = CachedDrafter(drafter_graphdef, drafter_params, vocab)   # or TrainedDrafter(...)
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, stop_ids=[eot])
    out = decoder.generate({"ids": ids, "positions": positions, "vision": vision}, drafter, max_new_tokens=256)
    decoder.stats.tau, decoder.timing.block_seconds / decoder.timing.block_tokens   # s/token in blocks
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data_pipeline.primitives import AtomicCalls
from valen_jax.decoding.block_loop import FastRow, Timing
from valen_jax.decoding.draft_rules import ScriptRule, TrainedRule, UniformRule
from valen_jax.decoding.engine import GREEDY, bucket
from valen_jax.decoding.sampling import Sampling, mask_vocab, sample
from valen_jax.decoding.verification import accept_pass, target_probs, verify_sampled
from valen_jax.models import drafter as block_drafter
from valen_jax.models import kv_cache

__all__ = ["BlockStats", "CachedDrafter", "OracleDrafter", "Proposal", "RandomDrafter",
           "ScriptedDrafter", "SpeculativeDecoder", "Timing", "TrainedDrafter", "accept_pass", "target_probs",
           "verify_sampled"]

# -- drafters -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Proposal:
    tokens: np.ndarray  # int32 [d]
    q: np.ndarray | None = None  # f32 [d, V]: the drafter's distribution at each slot; None: deterministic


class Drafter(Protocol):
    def propose(self, context: np.ndarray, block: int, key: jax.Array) -> Proposal:
        """1 to `block` tokens to follow `context` (every committed id of the row: prompt and output)."""
        ...


# -- statistics -----------------------------------------------------------------------------------

@dataclass
class BlockStats:
    """Verify passes inside announced blocks. tau counts the bonus token: committed / passes."""

    passes: int = 0
    committed: int = 0
    drafted_at: dict[int, int] = field(default_factory=dict)  # draft position k (1-based) → proposals
    accepted_at: dict[int, int] = field(default_factory=dict)  # → proposals accepted
    histogram: dict[int, int] = field(default_factory=dict)  # accepted draft tokens per pass → passes

    def record(self, drafted: int, accepted: int, committed: int) -> None:
        self.passes += 1
        self.committed += committed
        for k in range(1, drafted + 1):
            self.drafted_at[k] = self.drafted_at.get(k, 0) + 1
            self.accepted_at[k] = self.accepted_at.get(k, 0) + (k <= accepted)
        self.histogram[accepted] = self.histogram.get(accepted, 0) + 1

    @property
    def tau(self) -> float:
        return self.committed / self.passes if self.passes else 0.0

    def acceptance(self) -> dict[int, float]:
        return {k: self.accepted_at[k] / n for k, n in sorted(self.drafted_at.items())}


# -- the decoder ----------------------------------------------------------------------------------

@functools.cache
def _passes(graphdef, cache_length: int):
    def prefill(params, tokens, positions, lengths, vision=None):
        return nnx.merge(graphdef, params).prefill(tokens, positions, lengths, cache_length, vision)

    def step(params, token, position, cache, cursor):
        return nnx.merge(graphdef, params).decode_step(token, position, cache, cursor)

    def verify(params, tokens, positions, cache, cursor):
        return nnx.merge(graphdef, params).extend(tokens, positions, cache, cursor)

    return jax.jit(prefill), jax.jit(step), jax.jit(verify)


@dataclass
class _Row:
    ids: list[int]  # prompt + committed output
    prompt: int
    cache: kv_cache.KVCache
    cursor: int  # the slot of ids[-1], committed but not yet in the cache
    position: int  # its position
    passes: int = 0  # target passes so far (the random stream's counter)

    @property
    def output(self) -> list[int]:
        return self.ids[self.prompt:]


class SpeculativeDecoder:
    """Greedy (`Sampling()`) or sampled decoding of one prompt at a time with speculative blocks."""

    def __init__(self, graphdef, params, *, calls: AtomicCalls | None, vocab: int, stop_ids=(),
                 sampling: Sampling = GREEDY):
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a decoding.Sampling, got {type(sampling).__name__}")
        self.graphdef, self.params, self.calls = graphdef, params, calls
        self.vocab, self.stop_ids, self.sampling = int(vocab), {int(s) for s in stop_ids}, sampling
        self.stats = BlockStats()
        self.timing = Timing()

    def generate(self, prompt, drafter: Drafter | None, *, max_new_tokens: int, seed: int = 0,
                 positions=None, vision_inputs=None) -> list[int]:
        """The generated ids of `prompt`, the stop token kept, as `engine.generate_ids` returns them.

        prompt: int ids, or an engine prompt dict {"ids", "positions", optional "vision"}. positions:
        [n] or, with M-RoPE, [n, 3] (default 0..n-1); vision_inputs: the dict `engine.generate_ids` takes
        as prompt["vision"] (patches, patch_positions, patch_segments), for a target with a vision tower.
        drafter=None: target-only decoding through the host loop. A device drafter (`CachedDrafter`,
        `TrainedDrafter`, `ScriptedDrafter`, `RandomDrafter`, and `OracleDrafter`, which scripts the
        target's greedy output) takes the fast path (`block_loop`); any other object with `propose`
        the host loop."""
        ids, positions, vision = self._prompt(prompt, positions, vision_inputs)
        if hasattr(drafter, "for_prompt"):
            drafter = drafter.for_prompt(ids, positions, vision, max_new_tokens)
        if getattr(drafter, "rule", None) is not None:
            return self._generate_fast(ids, positions, vision, drafter, max_new_tokens, seed)
        if vision is None and positions is None:
            row = self.start(ids, max_new_tokens)
        else:
            row = self.start(ids, max_new_tokens, positions=positions, vision=vision)
        return self._decode(row, lambda size, key: self.block(row, drafter, size, key, max_new_tokens),
                            lambda key: self.step(row, key), drafter is not None, max_new_tokens, seed)

    def _generate_fast(self, ids, positions, vision, drafter, max_new_tokens: int, seed: int) -> list[int]:
        self._check_drafter(drafter)
        if positions is None:
            positions = np.arange(len(ids), dtype=np.int32)
        row = FastRow(self.graphdef, self.params, drafter, sampling=self.sampling, vocab=self.vocab,
                      stop_ids=self.stop_ids, ids=ids, positions=positions, vision=vision,
                      max_new_tokens=max_new_tokens, timing=self.timing)
        return self._decode(row, lambda size, key: row.block(size, key, max_new_tokens, self.stats), row.step,
                            True, max_new_tokens, seed)

    def _decode(self, row, block, step, drafting: bool, max_new_tokens: int, seed: int) -> list[int]:
        """The loop over announcements shared by both paths: `block(size, key)` commits a block and
        returns its overflow, `step(key)` one target token."""
        key = jax.random.key(seed)
        announced = self.calls.announced(row.ids) if self.calls else None
        while len(row.output) < max_new_tokens and not self._stopped(row):
            if announced is not None and drafting:
                start = len(row.output)
                overflow = block(announced.block_size, key)
                # Seed 004: for dense motion `count` gives the number of trajectories, one block each.
                blocks = announced.blocks(row.output[start:start + 1] == [self.calls.dense_id])
                for _ in range(blocks - 1):
                    # A bonus token past the previous block is this block's first.
                    overflow = block(announced.block_size - overflow, key)
                # A bonus token past the block is ordinary output; a call it completes is announced.
                announced = self.calls.announced(row.ids)
                continue
            step(key)
            announced = self.calls.announced(row.ids) if self.calls else None
        return row.output

    def _prompt(self, prompt, positions, vision):
        """(ids, positions or None, vision dict or None), checked against the target."""
        if isinstance(prompt, dict):
            if positions is not None or vision is not None:
                raise ValueError("a prompt dict carries its own positions and vision; pass neither beside it")
            prompt, positions, vision = prompt["ids"], prompt.get("positions"), prompt.get("vision")
        ids = [int(i) for i in np.asarray(prompt)]
        if len(ids) < 2:
            raise ValueError(f"prompt of {len(ids)} tokens: speculative decoding needs at least 2")
        cfg = nnx.merge(self.graphdef, self.params).cfg
        if vision is not None and cfg.vision is None:
            vision = None  # as engine.generate_ids: a text-only target ignores vision inputs
        if positions is None:
            if vision is not None and cfg.mrope_section is not None:
                raise ValueError("an M-RoPE prompt with an image needs its positions [n, 3] (models.mrope.rope_index)")
            return ids, None, vision
        positions = np.asarray(positions)
        if positions.shape not in ((len(ids),), (len(ids), 3)) or not np.issubdtype(positions.dtype, np.integer):
            raise ValueError(f"prompt positions of shape {positions.shape} ({positions.dtype}) for {len(ids)} ids; "
                             f"want integers [{len(ids)}] or, with M-RoPE, [{len(ids)}, 3]")
        last = positions[-1].reshape(-1)
        # Generated tokens take the prompt's largest position + 1 on every axis (engine.generate_ids); the
        # loop counts on from the last prompt token, so that one must be a text token at that maximum.
        if not (last == positions.max()).all():
            raise ValueError(f"prompt's last token has position {last.tolist()}, not the prompt's largest "
                             f"({int(positions.max())}) on every axis: a prompt must end with a text token")
        return ids, positions, vision

    def _check_drafter(self, drafter) -> None:
        cfg = nnx.merge(self.graphdef, self.params).cfg
        layers = drafter.rule.collect
        if layers and (max(layers) >= cfg.num_layers or drafter.dim != cfg.dim):
            raise ValueError(f"drafter reads target layers {layers} at width {drafter.dim}; the target has "
                             f"{cfg.num_layers} layers of width {cfg.dim}")

    def _stopped(self, row) -> bool:
        return bool(row.output) and row.output[-1] in self.stop_ids

    def start(self, prompt, max_new_tokens: int, positions=None, vision=None) -> _Row:
        """Prefill all but the prompt's last token; that one is the first `last` a pass feeds. Host loop."""
        ids = [int(i) for i in np.asarray(prompt)]
        if len(ids) < 2:
            raise ValueError(f"prompt of {len(ids)} tokens: speculative decoding needs at least 2")
        positions = np.arange(len(ids), dtype=np.int32) if positions is None else np.asarray(positions, np.int32)
        cache_length = bucket(len(ids) + max_new_tokens + 1)
        prefill, _, _ = _passes(self.graphdef, cache_length)
        head = jnp.asarray(ids[:-1], jnp.int32)[None]
        batched = None if vision is None else tuple(jnp.asarray(vision[k])[None] for k in
                                                    ("patches", "patch_positions", "patch_segments"))
        _, cache = prefill(self.params, head, jnp.asarray(positions[:-1])[None], jnp.asarray([len(ids) - 1], jnp.int32),
                           batched)
        last = int(positions[-1].reshape(-1)[0])
        return _Row(ids, len(ids), cache, len(ids) - 1, last)

    def _choose(self, logits, key):
        return int(sample(logits, key[None], self.sampling, self.vocab)[0])

    def step(self, row: _Row, key) -> None:
        """One target token: decode_step on the row's last token."""
        _, step, _ = _passes(self.graphdef, row.cache.length)
        logits, row.cache = step(self.params, jnp.asarray([row.ids[-1]], jnp.int32),
                                 jnp.asarray([row.position], jnp.int32), row.cache, jnp.asarray([row.cursor], jnp.int32))
        row.ids.append(self._choose(logits, jax.random.fold_in(key, row.passes)))
        row.passes += 1
        row.cursor += 1
        row.position += 1

    def block(self, row: _Row, drafter: Drafter, size: int, key, max_new_tokens: int) -> int:
        """Commit the next `size` tokens (fewer at a stop or the budget) by draft + verify passes. The
        last pass's bonus token may lie one past the block (it is the target's next token all the same):
        returns how many tokens did (0 or 1)."""
        _, _, verify = _passes(self.graphdef, row.cache.length)
        remaining = size
        while remaining > 0 and len(row.output) < max_new_tokens and not self._stopped(row):
            d = min(remaining, max_new_tokens - len(row.output))
            pass_key = jax.random.fold_in(key, row.passes)
            proposal = drafter.propose(np.asarray(row.ids, np.int32), d, jax.random.fold_in(pass_key, 1))
            draft = np.asarray(proposal.tokens, np.int32)
            if draft.ndim != 1 or not 1 <= len(draft) <= d:
                raise ValueError(f"drafter proposed tokens of shape {draft.shape}; asked for 1 to {d} tokens")
            if draft.min() < 0 or draft.max() >= self.vocab:
                raise ValueError(f"drafter proposed ids {draft.tolist()}: outside the vocabulary [0, {self.vocab})")
            d = len(draft)  # a drafter with a shorter block proposes what it can; the next pass drafts on
            # One compiled pass per padded length: slots past the draft hold -1 tokens (id 0 embedded) that
            # greedy never accepts (no argmax is -1) and sampling masks; their cache writes lie above the
            # committed length, cropped like a rejected tail. Exact length where padding would not fit.
            width = max(8, 1 << d.bit_length())  # >= d + 1
            if row.cursor + width > row.cache.length:
                width = d + 1
            padded = np.full(width - 1, -1, np.int32)
            padded[:d] = draft
            tokens = jnp.asarray(np.concatenate([[row.ids[-1]], np.maximum(padded, 0)]), jnp.int32)[None]
            positions = (row.position + jnp.arange(width, dtype=jnp.int32))[None]
            logits, row.cache = verify(self.params, tokens, positions, row.cache, jnp.asarray([row.cursor], jnp.int32))
            accepted, nxt = self._verify(logits[0], padded, d, proposal.q, jax.random.fold_in(pass_key, 2))
            new = [*draft[:accepted].tolist(), nxt]
            row.passes += 1
            # Crop: the committed tokens' keys stay; the cursor moves to the new last token's slot.
            row.cursor += accepted + 1
            row.position += accepted + 1
            committed = 0
            for token in new:
                if len(row.output) >= max_new_tokens or self._stopped(row):
                    break
                row.ids.append(int(token))
                committed += 1
            self.stats.record(d, accepted, committed)
            remaining -= accepted + 1
        return max(-remaining, 0)

    def _verify(self, logits, padded, drafted: int, q, key) -> tuple[int, int]:
        """(accepted, next token) from the verify pass's logits [W, V] over a draft padded with -1 to W - 1:
        the block loop's own rule (`accept_pass`), so both paths accept alike."""
        q_rows = None  # a deterministic drafter: accept_pass takes q as the point mass on its proposal
        if not self.sampling.greedy and q is not None:
            width, vocab = logits.shape
            q = np.asarray(q, np.float32)
            if q.shape != (drafted, q.shape[1]) or q.shape[1] > vocab:
                raise ValueError(f"drafter q of shape {q.shape}; want [{drafted}, <= {vocab}]")
            q_rows = np.zeros((width - 1, vocab), np.float32)
            q_rows[:drafted, :q.shape[1]] = q
        accepted, nxt = _accept(logits, jnp.maximum(jnp.asarray(padded), 0), q_rows, key, jnp.int32(drafted),
                                self.sampling, self.vocab)
        return int(accepted), int(nxt)


_accept = jax.jit(accept_pass, static_argnums=(5, 6))


# -- drafters for tests and baselines -------------------------------------------------------------

class ScriptedDrafter:
    """A device drafter proposing a given continuation (the output ids it expects, from index 0) at the
    row's output index; `block_size` caps a pass (None: the rest of the block)."""

    def __init__(self, tokens, block_size: int | None = None):
        self.rule = ScriptRule(block_size=block_size)
        self.params = jnp.asarray(np.asarray(tokens, np.int32))


class OracleDrafter:
    """Proposes the target's own greedy continuation. Host loop (`propose`): `engine.generate_ids` on the
    context at every pass. Fast path (`for_prompt`): the greedy output of the prompt, computed once, as a
    `ScriptedDrafter` (drafting costs a slice: the speed-up ceiling). Under sampling the fast oracle
    still scripts the greedy output of the prompt (a drafter, so output stays the target's own)."""

    def __init__(self, graphdef, params, vocab: int, block_size: int | None = None):
        self.graphdef, self.params, self.vocab, self.block_size = graphdef, params, vocab, block_size

    def for_prompt(self, ids, positions, vision, max_new_tokens: int) -> ScriptedDrafter:
        from valen_jax.decoding.engine import generate_ids

        prompt = {"ids": np.asarray(ids, np.int32),
                  "positions": np.arange(len(ids), dtype=np.int32) if positions is None else positions}
        if vision is not None:
            prompt["vision"] = vision
        out = generate_ids(self.params, self.graphdef, [prompt], max_new_tokens=max_new_tokens, stop_ids=(),
                           vocab=self.vocab)
        return ScriptedDrafter(out[0], self.block_size)

    def propose(self, context, block, key) -> Proposal:
        from valen_jax.decoding.engine import generate_ids

        prompt = {"ids": np.asarray(context, np.int32), "positions": np.arange(len(context), dtype=np.int32)}
        out = generate_ids(self.params, self.graphdef, [prompt], max_new_tokens=block, stop_ids=(), vocab=self.vocab)
        return Proposal(np.asarray(out[0], np.int32))


class RandomDrafter:
    """Uniform random tokens in [0, vocab), q uniform: the worst honest drafter. Host loop: numpy's
    stream from `seed`; fast path: drawn on the device from each pass's key (the decoding seed)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, np.random.default_rng(seed)
        self.rule, self.params = UniformRule(int(vocab)), ()

    def propose(self, context, block, key) -> Proposal:
        return Proposal(self.rng.integers(0, self.vocab, block).astype(np.int32),
                        np.full((block, self.vocab), 1.0 / self.vocab, np.float32))


class CachedDrafter:
    """A `models.drafter.Drafter` (vflash training) on the fast path: its context keys/values cached once
    per token (prefill, decode steps, verify passes), one small forward per pass against them
    (`Drafter.draft_cached`); greedy drafting, so under sampling q is the point mass on its tokens."""

    def __init__(self, drafter_graphdef, drafter_params, vocab: int):
        cfg = nnx.merge(drafter_graphdef, drafter_params).cfg
        self.rule = TrainedRule(drafter_graphdef, tuple(cfg.target_layers), cfg.block_size, int(vocab))
        self.params, self.block_size, self.dim, self.vocab = drafter_params, cfg.block_size, cfg.dim, int(vocab)


class TrainedDrafter(CachedDrafter):
    """`CachedDrafter`, also usable by the host loop (`propose`), where the target's fused features are
    recomputed over the whole context on every proposal (text-only contexts, 1-D positions): that
    path measures acceptance, not speed."""

    def __init__(self, drafter_graphdef, drafter_params, target_graphdef, target_params, vocab: int):
        super().__init__(drafter_graphdef, drafter_params, vocab)
        self.host_params = (drafter_params, target_params)

        def run(params, tokens, length):
            drafter, target = nnx.merge(drafter_graphdef, params[0]), nnx.merge(target_graphdef, params[1])
            # Right-padded to a bucket (one compile per bucket, not per context length); padding is
            # segment 0, which no block sees.
            slots = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
            batch = {"tokens": tokens, "positions": slots, "segment_ids": (slots < length).astype(jnp.int32)}
            # The anchor is the last committed token; the drafter reads target features before it.
            hidden = block_drafter.draft_hidden(drafter, target, batch, jnp.reshape(length - 1, (1, 1)))
            logits = jnp.einsum("basd,dv->basv", hidden, target.head_matrix(), preferred_element_type=jnp.float32)
            return jnp.argmax(mask_vocab(logits[0, 0], vocab), axis=-1).astype(jnp.int32)

        self._run = jax.jit(run)

    def propose(self, context, block, key) -> Proposal:
        # Greedy drafting: deterministic given the context, so under sampling q is the point mass on it.
        padded = np.zeros(bucket(len(context)), np.int32)
        padded[:len(context)] = context
        tokens = self._run(self.host_params, jnp.asarray(padded)[None], jnp.int32(len(context)))
        return Proposal(np.asarray(tokens)[:min(block, self.block_size)])
