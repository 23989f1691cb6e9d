"""Speculative atomic decoding (seed 004, issue 16): a drafter proposes an announced primitive block,
the target verifies it in ONE pass over its KV cache, and the output is the target's own.

Outside announced blocks the target decodes one token per step, as `engine.generate_ids` does, but for
the call's fixed text, which the compact spelling forces and one pass verifies (`decoding.loop`). When
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
per-position acceptance; a histogram over 0..B of the draft tokens accepted per pass. A row whose drafter
accepted nothing in `patience` passes in a row (default `loop.PATIENCE`; 0: never) decodes the rest of
that span with plain steps (`stopped`, `undrafted`; tau counts each such step as a pass of one token).

Rows are decoded together, each answer whole, in ONE compiled `lax.while_loop` (`decoding.loop`: plain
steps, announcements found on the device by `decoding.announcements`, drafted blocks), with a device
drafter (`CachedDrafter`, `ScriptedDrafter`, `RandomDrafter`, `OracleDrafter`). The host waits once per
batch, plus once per call outside the device's spelling, which it reads with `AtomicCalls.announced` (a
held row; `Timing.host_reads`). The prefill covers each whole prompt and gives the first token, as in the
engine; a prompt that ends with a call announcing a block (or inside the call's fixed text) has its last
token fed again by the first pass instead, so that block is drafted whole (an oracle: tau = B + 1). The trained
drafter's context keys/values are cached once per token from the target's own passes
(`Transformer.prefill(collect=)`), so a pass costs one small drafter forward over B + 1 slots
(`draft_rules`). Targets with a vision tower and M-RoPE positions are decoded with the prompt's image;
generated tokens continue after the prompt's largest position, as the engine does. This is the only
library path; a Python loop around jitted passes, for drafters written in Python, lives in the tests
(`tests/speculative_host.py`) as the differential oracle of this one.

    drafter = CachedDrafter(drafter_graphdef, drafter_params, vocab)
    decoder = SpeculativeDecoder(graphdef, params, calls=AtomicCalls(tokenizer), vocab=vocab, stop_ids=[eot])
    out = decoder.generate({"ids": ids, "positions": positions, "vision": vision}, drafter, max_new_tokens=256)
    outs = decoder.generate_batch(prompts, drafter, max_new_tokens=256)       # rows together
    decoder.stats.tau, decoder.timing.seconds / decoder.timing.tokens       # s/token, whole answers
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np
from flax import nnx

from data_pipeline.primitives import AtomicCalls
from valen_jax.decoding import announcements
from valen_jax.decoding.draft_rules import ScriptRule, TrainedRule, UniformRule
from valen_jax.decoding.engine import GREEDY, batch_arrays, bucket, generate_ids
from valen_jax.decoding.loop import PATIENCE, speculative_programs
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
    # Outside blocks: passes verifying the call's fixed text (`announcements.spelled_drafts`), tokens committed
    spelling_passes: int = 0
    spelling_committed: int = 0
    # Spans whose drafting stopped after `loop.PATIENCE` passes in a row accepted nothing, and the tokens
    # plain steps committed in them afterwards (each one target pass inside a block: `tau` counts them)
    stopped: int = 0
    undrafted: int = 0

    def record(self, drafted: int, accepted: int, committed: int) -> None:
        self.passes += 1
        self.committed += committed
        for k in range(1, drafted + 1):
            self.drafted_at[k] = self.drafted_at.get(k, 0) + 1
            self.accepted_at[k] = self.accepted_at.get(k, 0) + (k <= accepted)
        self.histogram[accepted] = self.histogram.get(accepted, 0) + 1

    def add(self, other: BlockStats) -> None:
        """Another row's counts summed into these (a benchmark's answers)."""
        self.passes += other.passes
        self.committed += other.committed
        self.spelling_passes += other.spelling_passes
        self.spelling_committed += other.spelling_committed
        self.stopped += other.stopped
        self.undrafted += other.undrafted
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at),
                             (self.histogram, other.histogram)):
            for k, n in theirs.items():
                mine[k] = mine.get(k, 0) + n

    def add_counts(self, passes, committed, drafted_at, accepted_at, histogram, spelling_passes,
                   spelling_committed, stopped, undrafted) -> None:
        """One row's sums from the device loop (`loop.Stats`): arrays over draft positions 1.. and 0.."""
        self.spelling_passes += int(spelling_passes)
        self.spelling_committed += int(spelling_committed)
        self.stopped += int(stopped)
        self.undrafted += int(undrafted)
        self.passes += int(passes)
        self.committed += int(committed)
        for k, (drafted, accepted) in enumerate(zip(np.asarray(drafted_at).tolist(), np.asarray(accepted_at).tolist(),
                                                    strict=True), start=1):
            if drafted:
                self.drafted_at[k] = self.drafted_at.get(k, 0) + drafted
                self.accepted_at[k] = self.accepted_at.get(k, 0) + accepted
        for n, count in enumerate(np.asarray(histogram).tolist()):
            if count:
                self.histogram[n] = self.histogram.get(n, 0) + count

    @property
    def tau(self) -> float:
        """Tokens committed inside blocks per target pass there: a plain step after drafting stopped is a
        pass committing one token, so giving up on a drafter never raises tau."""
        passes = self.passes + self.undrafted
        return (self.committed + self.undrafted) / passes if passes else 0.0

    def acceptance(self) -> dict[int, float]:
        return {k: self.accepted_at[k] / n for k, n in sorted(self.drafted_at.items())}


# -- the decoder ----------------------------------------------------------------------------------

@dataclass
class Timing:
    """Host wall time of the decode loop's launches (each result is read back, so it is the device's
    time too): prefill to the last token of every row, host answers to held rows included."""

    seconds: float = 0.0
    tokens: int = 0  # output tokens committed
    launches: int = 0  # programs run: one per batch, plus one per host answer to held rows
    host_reads: int = 0  # calls outside the device's spelling read by `AtomicCalls.announced`


# A span's block_size and count as the host hands them to the loop: products stay in int32 (a span longer
# than any budget decodes the same, a pass never drafts past `width` anyway).
_HOST_CAP = 1 << 15


def open_host_span(calls: AtomicCalls, ids: list[int], spans: dict, row: int) -> bool:
    """A held row's ids (prompt and output) end with a call outside the device's spelling: read it with
    `AtomicCalls.announced` (the rule's one home) and open the span it announces in row `row` of `spans`
    (host arrays `left`, `size`, `count`, `fresh`, `misses`) → whether it announced one (else the row decodes on:
    another tool, or text)."""
    found = calls.announced(ids)
    if found is None:
        return False
    size = min(found.block_size, _HOST_CAP)
    spans["left"][row], spans["size"][row] = size, size
    spans["count"][row], spans["fresh"][row] = min(found.count or 0, _HOST_CAP), True
    spans["misses"][row] = 0
    return True


class SpeculativeDecoder:
    """Greedy (`Sampling()`) or sampled decoding of a batch of prompts with speculative blocks: one compiled
    loop per batch (`decoding.loop`); `width`: the draft slots per pass of a drafter without a block size;
    `patience`: verify passes in a row accepting nothing before a row stops drafting in its span (0: never)."""

    def __init__(self, graphdef, params, *, calls: AtomicCalls | None, vocab: int, stop_ids=(),
                 sampling: Sampling = GREEDY, width: int = 32, patience: int = PATIENCE):
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a decoding.Sampling, got {type(sampling).__name__}")
        if calls is None:
            raise ValueError("SpeculativeDecoder needs calls= (AtomicCalls): without announcements nothing is "
                             "drafted; target-only decoding is engine.generate_ids")
        self.graphdef, self.params, self.calls = graphdef, params, calls
        self.vocab, self.stop_ids, self.sampling, self.width = int(vocab), {int(s) for s in stop_ids}, sampling, width
        if int(patience) < 0:
            raise ValueError(f"patience: verify passes >= 0 (0: never stop drafting), got {patience}")
        self.patience = int(patience)
        self.stats = BlockStats()
        self.row_stats: list[BlockStats] = []  # per prompt decoded, in order
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
        return self.generate_batch([{"ids": ids, "positions": positions, "vision": vision}], drafter,
                                   max_new_tokens=max_new_tokens, seed=seed)[0]

    def generate_batch(self, prompts, drafter, *, max_new_tokens, seed: int = 0, first_index: int = 0
                       ) -> list[list[int]]:
        """Every prompt's generated ids, the rows decoded together in one loop. prompts: ids or engine
        prompt dicts; max_new_tokens: one budget or one per prompt. Prompt g's random stream depends on
        (seed, first_index + g) only, as in `engine.generate_ids`."""
        rows = [self._prompt(p, None, None) for p in prompts]
        rows = [(ids, np.arange(len(ids), dtype=np.int32) if pos is None else pos, vision) for ids, pos, vision in rows]
        budgets = [int(max_new_tokens)] * len(rows) if np.ndim(max_new_tokens) == 0 else [int(b) for b in max_new_tokens]
        if len(budgets) != len(rows) or min(budgets, default=0) < 0:
            raise ValueError(f"max_new_tokens: one budget >= 0 or one per prompt ({len(rows)}), got {max_new_tokens}")
        if not rows or max(budgets) == 0:
            return [[] for _ in rows]
        if hasattr(drafter, "for_prompts"):
            drafter = drafter.for_prompts(rows, max(budgets))
        if getattr(drafter, "rule", None) is None:
            raise TypeError(f"a {type(drafter).__name__} is not a device drafter (one with a `rule`: CachedDrafter, "
                            "ScriptedDrafter, RandomDrafter, OracleDrafter); target-only decoding is "
                            "engine.generate_ids")
        self._check_drafter(drafter)
        started = time.perf_counter()
        state, prompt_ids = self._run(rows, budgets, drafter, seed, first_index)
        out, count = np.asarray(state.out), np.asarray(state.count)
        self.timing.seconds += time.perf_counter() - started
        self.timing.tokens += int(count[:len(rows)].sum())
        stats = [np.asarray(a) for a in state.stats]
        for row in range(len(rows)):
            one = BlockStats()
            one.add_counts(*(a[row] for a in stats))
            self.row_stats.append(one)
            self.stats.add_counts(*(a[row] for a in stats))
        return [out[row, :count[row]].tolist() for row in range(len(rows))]

    def _run(self, rows, budgets, drafter, seed: int, first_index: int):
        cfg = nnx.merge(self.graphdef, self.params).cfg
        mrope = cfg.mrope_section is not None
        batch, longest = len(rows), max(len(ids) for ids, _, _ in rows)
        # Whole prompts; the last token and its position also as `last`, fed again by the first pass of a
        # row whose prompt announces a block (`loop.speculative_programs`).
        chunk = [(np.asarray(ids, np.int32), np.asarray(pos, np.int32)) for ids, pos, _ in rows]
        vision_of = [v if cfg.vision is not None else None for _, _, v in rows]
        patches = max((len(v["patches"]) for v in vision_of if v is not None), default=0)
        arrays = batch_arrays(chunk, vision_of, batch, bucket(longest), patches, cfg, mrope)
        width = drafter.rule.block_size or self.width
        start, resume = speculative_programs(self.graphdef, drafter.rule, self.sampling, self.vocab, width,
                                             bucket(longest + max(budgets)), bucket(max(budgets) + width + 1),
                                             self.patience)
        tables = announcements.tables(self.calls, cfg.vocab_size)
        stops = jnp.asarray(sorted(self.stop_ids) or [-1], jnp.int32)
        vision = (None if not patches else
                  tuple(jnp.asarray(arrays[k]) for k in ("patches", "patch_positions", "patch_segments")))
        row_ids = jnp.asarray(np.arange(first_index, first_index + batch, dtype=np.uint32))
        last = jnp.asarray([ids[-1] for ids, _, _ in rows], jnp.int32)
        last_position = jnp.asarray([int(np.asarray(pos[-1]).reshape(-1)[0]) for _, pos, _ in rows], jnp.int32)
        state = start(self.params, drafter.params, jnp.asarray(arrays["tokens"]), jnp.asarray(arrays["positions"]),
                      jnp.asarray(arrays["lengths"]), last, last_position, jnp.asarray(arrays["active"]), vision,
                      stops, jnp.uint32(seed), row_ids, jnp.asarray(budgets, jnp.int32), tables)
        self.timing.launches += 1
        while True:
            held = np.asarray(state.held)
            if not held.any():
                return state, None
            state = self._answer_held(state, held, rows)
            state = resume(self.params, drafter.params, state, stops, jnp.uint32(seed), row_ids, tables)
            self.timing.launches += 1

    def _answer_held(self, state, held, rows):
        """Held rows completed a call outside the device's spelling: the host reads it (the rule's home)
        and opens the span it announces, or lets the row decode on (another tool, text)."""
        out, count = np.asarray(state.out), np.asarray(state.count)
        spans = {k: np.array(getattr(state.spans, k)) for k in ("left", "size", "count", "fresh", "misses")}
        for row in np.flatnonzero(held):
            self.timing.host_reads += 1
            open_host_span(self.calls, list(rows[row][0]) + out[row, :count[row]].tolist(), spans, row)
        return state._replace(held=jnp.zeros_like(state.held),
                              spans=state.spans._replace(**{k: jnp.asarray(v) for k, v in spans.items()}))

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

# -- device drafters -------------------------------------------------------------

class ScriptedDrafter:
    """A device drafter proposing a given continuation (the output ids it expects, from index 0; [N], or
    [B, N] one per row of a batch) at each row's output index; `block_size` caps a pass (None: the
    decoder's `width`)."""

    def __init__(self, tokens, block_size: int | None = None):
        self.rule = ScriptRule(block_size=block_size)
        self.params = jnp.asarray(np.asarray(tokens, np.int32))


class OracleDrafter:
    """Proposes the target's own greedy continuation: the greedy output of the prompt, computed once
    (`for_prompts`), as a `ScriptedDrafter` (drafting costs a slice: the speed-up ceiling). Under sampling
    it still scripts the greedy output of the prompt (a drafter, so output stays the target's own)."""

    def __init__(self, graphdef, params, vocab: int, block_size: int | None = None):
        self.graphdef, self.params, self.vocab, self.block_size = graphdef, params, vocab, block_size

    def for_prompts(self, rows, max_new_tokens: int) -> ScriptedDrafter:
        """rows: (ids, positions, vision or None) per prompt → one script per row, [B, max_new_tokens]."""
        prompts = [{"ids": np.asarray(ids, np.int32), "positions": np.asarray(positions),
                    **({"vision": vision} if vision is not None else {})} for ids, positions, vision in rows]
        out = generate_ids(self.params, self.graphdef, prompts, max_new_tokens=max_new_tokens, stop_ids=(),
                           vocab=self.vocab)
        scripts = np.zeros((len(out), max_new_tokens), np.int32)
        for row, tokens in enumerate(out):
            scripts[row, :len(tokens)] = tokens
        return ScriptedDrafter(scripts, self.block_size)


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
