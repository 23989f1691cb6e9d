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

One row (prompt) per call, a device drafter (`CachedDrafter`, `ScriptedDrafter`, `RandomDrafter`,
`OracleDrafter`): each announced block is ONE compiled `lax.while_loop` (draft → verify → accept →
advance both caches → write the committed tokens), no host round trip inside a block (`block_loop`).
The trained drafter's context keys/values are cached once per token from the target's own prefill /
decode / verify passes (`Transformer.prefill(collect=)`), so a pass costs one small drafter forward over
B + 1 slots (`draft_rules`). Targets with a vision tower and M-RoPE positions are decoded with the
prompt's image (`generate(prompt, ..., vision_inputs=)` or an engine prompt dict); generated tokens
continue after the prompt's largest position, as the engine does. This is the only library path; a
Python loop around jitted prefill / decode_step / extend passes, for drafters written in Python, lives
in the tests (`tests/speculative_host.py`) as the differential oracle of this one.

    drafter = CachedDrafter(drafter_graphdef, drafter_params, vocab)
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, stop_ids=[eot])
    out = decoder.generate({"ids": ids, "positions": positions, "vision": vision}, drafter, max_new_tokens=256)
    decoder.stats.tau, decoder.timing.block_seconds / decoder.timing.block_tokens   # s/token in blocks
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data_pipeline.primitives import AtomicCalls
from valen_jax.decoding.block_loop import FastRow, Timing
from valen_jax.decoding.draft_rules import ScriptRule, TrainedRule, UniformRule
from valen_jax.decoding.engine import GREEDY, generate_ids
from valen_jax.decoding.sampling import Sampling
from valen_jax.decoding.verification import accept_pass, target_probs, verify_sampled

__all__ = ["BlockStats", "CachedDrafter", "OracleDrafter", "RandomDrafter", "ScriptedDrafter",
           "SpeculativeDecoder", "Timing", "accept_pass", "target_probs", "verify_sampled"]

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

    def generate(self, prompt, drafter, *, max_new_tokens: int, seed: int = 0, positions=None,
                 vision_inputs=None) -> list[int]:
        """The generated ids of `prompt`, the stop token kept, as `engine.generate_ids` returns them.

        prompt: int ids, or an engine prompt dict {"ids", "positions", optional "vision"}. positions:
        [n] or, with M-RoPE, [n, 3] (default 0..n-1); vision_inputs: the dict `engine.generate_ids` takes
        as prompt["vision"] (patches, patch_positions, patch_segments), for a target with a vision tower.
        drafter: a device drafter (`CachedDrafter`, `ScriptedDrafter`, `RandomDrafter`, or `OracleDrafter`,
        which scripts the target's greedy output); target-only decoding is `engine.generate_ids`."""
        ids, positions, vision = self._prompt(prompt, positions, vision_inputs)
        if hasattr(drafter, "for_prompt"):
            drafter = drafter.for_prompt(ids, positions, vision, max_new_tokens)
        if getattr(drafter, "rule", None) is None:
            raise TypeError(f"a {type(drafter).__name__} is not a device drafter (one with a `rule`: CachedDrafter, "
                            "ScriptedDrafter, RandomDrafter, OracleDrafter); target-only decoding is "
                            "engine.generate_ids")
        return self._generate_fast(ids, positions, vision, drafter, max_new_tokens, seed)

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
        """The loop over announcements (shared with the tests' host-loop oracle, tests/speculative_host.py):
        `block(size, key)` commits a block and returns its overflow, `step(key)` one target token."""
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

# -- device drafters -------------------------------------------------------------

class ScriptedDrafter:
    """A device drafter proposing a given continuation (the output ids it expects, from index 0) at the
    row's output index; `block_size` caps a pass (None: the rest of the block)."""

    def __init__(self, tokens, block_size: int | None = None):
        self.rule = ScriptRule(block_size=block_size)
        self.params = jnp.asarray(np.asarray(tokens, np.int32))


class OracleDrafter:
    """Proposes the target's own greedy continuation: the greedy output of the prompt, computed once
    (`for_prompt`), as a `ScriptedDrafter` (drafting costs a slice: the speed-up ceiling). Under sampling
    it still scripts the greedy output of the prompt (a drafter, so output stays the target's own)."""

    def __init__(self, graphdef, params, vocab: int, block_size: int | None = None):
        self.graphdef, self.params, self.vocab, self.block_size = graphdef, params, vocab, block_size

    def for_prompt(self, ids, positions, vision, max_new_tokens: int) -> ScriptedDrafter:
        prompt = {"ids": np.asarray(ids, np.int32),
                  "positions": np.arange(len(ids), dtype=np.int32) if positions is None else positions}
        if vision is not None:
            prompt["vision"] = vision
        out = generate_ids(self.params, self.graphdef, [prompt], max_new_tokens=max_new_tokens, stop_ids=(),
                           vocab=self.vocab)
        return ScriptedDrafter(out[0], self.block_size)


class RandomDrafter:
    """Uniform random tokens in [0, vocab), q uniform: the worst honest drafter, drawn on the device from
    each pass's key (the decoding seed)."""

    def __init__(self, vocab: int):
        self.vocab = int(vocab)
        self.rule, self.params = UniformRule(self.vocab), ()


class CachedDrafter:
    """A `models.drafter.Drafter` (vflash training) on the fast path: its context keys/values cached once
    per token (prefill, decode steps, verify passes), one small forward per pass against them
    (`Drafter.draft_cached`); greedy drafting, so under sampling q is the point mass on its tokens."""

    def __init__(self, drafter_graphdef, drafter_params, vocab: int):
        cfg = nnx.merge(drafter_graphdef, drafter_params).cfg
        self.rule = TrainedRule(drafter_graphdef, tuple(cfg.target_layers), cfg.block_size, int(vocab))
        self.params, self.block_size, self.dim, self.vocab = drafter_params, cfg.block_size, cfg.dim, int(vocab)
