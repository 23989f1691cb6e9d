"""Speculative atomic decoding metrics (issue 16) as sums, per group (`overall`, `entry:<recipe entry>`).

Every figure is formed in `report()` from sums that hosts add first (`hosts.sum_stats`), as for the
other formats' stats. Per answer `add` takes the decoder's `BlockStats` (verify passes inside announced
blocks) and the timings of the same answer decoded target-only and speculatively.

Conventions (TAU_CONVENTION is written into the report):
- tau: tokens committed per target verification pass inside announced blocks, the target's bonus token
  INCLUDED: an oracle drafter on a block of B tokens commits B + 1 in one pass; a drafter that is never
  right commits 1 per pass (the bonus), as target-only decoding does; a plain step inside a block after
  its drafting stopped (`loop.PATIENCE` passes in a row accepted nothing) counts as a pass of one token;
- stopped: blocks (announced spans) whose drafting stopped so; undrafted: the tokens plain steps committed
  in them afterwards (not in `passes`, `committed`, acceptance or the histogram);
- acceptance k (1..B, B the drafter's block size): of the passes that drafted position k, the fraction
  that had it accepted; acceptance is a prefix (k accepted only if 1..k-1 were);
- histogram 0..B: verify passes by number of drafted tokens accepted; it sums to `passes`;
- spelling: outside blocks, the verify passes that checked an `atomic_decoding` call's fixed text
  (`announcements.spelled_drafts`) and the tokens they committed (bonus included), apart from the block
  figures above (serving's `usage` reports the same two counts as `spelling_passes`/`spelling_tokens`);
- ms per token of whole answers (prompt to end, the prefill included): target-only = the compiled
  engine's time for the answer / its tokens; speculative = the decode loop's time for the same answer
  (one program: plain steps and announced blocks together, so blocks are not timed apart) / its tokens;
  speedup = target-only / speculative time of the same answers.
"""

from __future__ import annotations

import numpy as np

from valen_jax.evaluation.metrics import OVERALL, GroupedSums, ratio

TAU_CONVENTION = ("tokens committed per target verification pass inside announced blocks, the bonus token "
                  "included (an oracle drafter on a block of B tokens gives B + 1, a drafter never right gives 1); "
                  "a plain step in a block whose drafting stopped counts as a pass of one token")


class BlockSums(GroupedSums):
    """Speculative decoding sums for a drafter of `block_size` B (histogram 0..B, acceptance 1..B)."""

    def __init__(self, block_size: int):
        if int(block_size) < 1:
            raise ValueError(f"block_size must be ≥ 1, got {block_size}")
        self.block_size = int(block_size)
        # The fields depend on B, so they are the instance's (GroupedSums reads self.FIELDS).
        self.FIELDS = self.fields(self.block_size)
        super().__init__()

    @staticmethod
    def fields(block_size: int) -> tuple[str, ...]:
        return ("answers", "identical", "passes", "committed",
                *(f"drafted_{k}" for k in range(1, block_size + 1)),
                *(f"accepted_{k}" for k in range(1, block_size + 1)),
                *(f"histogram_{n}" for n in range(block_size + 1)),
                "spelling_passes", "spelling_committed", "stopped", "undrafted",
                "target_only_block_tokens", "answer_tokens", "target_only_seconds", "speculative_seconds")

    def _config(self) -> dict:
        return {"block_size": self.block_size}

    @classmethod
    def from_vector(cls, vector, keys, **config):
        # GroupedSums.from_vector sizes blocks by the class's FIELDS; here they are the instance's.
        vector, stats = np.asarray(vector, np.float64), cls(**config)
        width = len(stats.FIELDS)
        if vector.shape != (len(keys) * width,):
            raise ValueError(f"vector of shape {vector.shape} does not hold {len(keys)} groups of {width} sums")
        for i, key in enumerate(keys):
            block = vector[i * width:(i + 1) * width]
            if block.any():
                stats._row(key)[:] = block
        return stats

    def add(self, blocks, *, identical: bool, target_only_block_tokens: int, answer_tokens: int,
            target_only_seconds: float, speculative_seconds: float, entry: str | None = None) -> None:
        """One answer: `blocks` its speculative decoding's `BlockStats`, whether its output equals
        target-only greedy, the block tokens target-only greedy wrote, and the answer's tokens and its two
        whole-answer timings."""
        too_long = [k for k in blocks.drafted_at if not 1 <= k <= self.block_size]
        if too_long:
            raise ValueError(f"draft positions {too_long} outside 1..{self.block_size} (the drafter's block size)")
        amounts = {"answers": 1, "identical": float(identical), "passes": blocks.passes,
                   "committed": blocks.committed, "spelling_passes": blocks.spelling_passes,
                   "spelling_committed": blocks.spelling_committed, "stopped": blocks.stopped,
                   "undrafted": blocks.undrafted,
                   "target_only_block_tokens": target_only_block_tokens, "answer_tokens": answer_tokens,
                   "target_only_seconds": target_only_seconds, "speculative_seconds": speculative_seconds}
        amounts.update({f"drafted_{k}": n for k, n in blocks.drafted_at.items()})
        amounts.update({f"accepted_{k}": n for k, n in blocks.accepted_at.items()})
        amounts.update({f"histogram_{n}": passes for n, passes in blocks.histogram.items()})
        self._add([OVERALL] if entry is None else [OVERALL, f"entry:{entry}"], **amounts)

    def _metrics(self, s: dict[str, float]) -> dict:
        block = range(1, self.block_size + 1)
        target_only = ratio(1e3 * s["target_only_seconds"], s["answer_tokens"])
        speculative = ratio(1e3 * s["speculative_seconds"], s["answer_tokens"])
        return {
            "answers": int(s["answers"]),
            "identical": ratio(s["identical"], s["answers"]),
            "passes": int(s["passes"]),
            "committed": int(s["committed"]),
            "tau": ratio(s["committed"] + s["undrafted"], s["passes"] + s["undrafted"]),
            "acceptance": {str(k): ratio(s[f"accepted_{k}"], s[f"drafted_{k}"]) for k in block},
            "histogram": [int(s[f"histogram_{n}"]) for n in range(self.block_size + 1)],
            "spelling": {"passes": int(s["spelling_passes"]), "tokens": int(s["spelling_committed"])},
            "stopped": {"spans": int(s["stopped"]), "undrafted_tokens": int(s["undrafted"])},
            "target_only_block_tokens": int(s["target_only_block_tokens"]),
            "answer_tokens": int(s["answer_tokens"]),
            "ms_per_token": {"target_only": target_only, "speculative": speculative},
            "speedup": None if target_only is None or not speculative else target_only / speculative,
        }

    def report(self) -> dict:
        """{"overall": metrics, "by_entry": {name: metrics}}; conventions in the module docstring."""
        return self._grouped_report(["entry"], self._metrics)
