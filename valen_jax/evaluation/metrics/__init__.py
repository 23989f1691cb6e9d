"""Evaluation metrics per format, accumulated as sums so hosts add them before dividing.

Every statistic here is a sum (counts, summed errors, summed probabilities), kept per *group*:
`overall` and one group per breakdown value (`type:choice`, `domain:traffic`, `entry:boxes_demo`,
`locale:en-US`, …). A ratio is only formed in `report()`, after all hosts' sums are added, so a
multi-host evaluation gives the same numbers as one host reading all the data (a mean of per-host
means would weight hosts by their share of the data instead).

All-reduce pattern (the same for `ValenStats`, `VFlashStats`, `ChatStats`):

    keys = union of every process's stats.group_keys()   # e.g. allgather the JSON of the key list
    total = type(stats).from_vector(all_reduce_sum(stats.to_vector(keys)), keys, **same_config)

`to_vector(keys)` lays out one float64 block of `len(FIELDS)` sums per key, in the given order,
zeros for a group this process never saw; so every process must pass the same key list.
float64 keeps integer counts exact up to 2**53.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

OVERALL = "overall"
# The group value of an observation whose breakdown field is absent or null.
MISSING = "(missing)"


class GroupedSums:
    """Named float64 sums per group; subclasses define `FIELDS` and how `add` fills them."""

    FIELDS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._groups: dict[str, np.ndarray] = {}
        self._index = {name: i for i, name in enumerate(self.FIELDS)}

    # -- accumulation --------------------------------------------------------------------------

    def _row(self, key: str) -> np.ndarray:
        row = self._groups.get(key)
        if row is None:
            row = self._groups[key] = np.zeros(len(self.FIELDS), np.float64)
        return row

    def _add(self, keys: Iterable[str], **amounts: float) -> None:
        """Add each named amount to the same field of every group in `keys`."""
        idx = [self._index[name] for name in amounts]
        vals = np.asarray(list(amounts.values()), np.float64)
        for key in keys:
            self._row(key)[idx] += vals

    @staticmethod
    def _breakdown_keys(breakdown: Mapping[str, str | None] | None, names: Sequence[str],
                        accepted: Sequence[str] | None = None) -> list[str]:
        """The groups one observation adds to: overall, then `name:value` for each of `names` in order
        (MISSING where the value is absent or null). The caller may give only the `accepted` names
        (default: all of `names`); any other name is refused."""
        breakdown = breakdown or {}
        accepted = tuple(names if accepted is None else accepted)
        unknown = sorted(set(breakdown) - set(accepted))
        if unknown:
            raise ValueError(f"breakdown keys must be among {accepted}, got {unknown}")
        return [OVERALL] + [f"{k}:{breakdown.get(k) or MISSING}" for k in names]

    def _config(self) -> dict:
        """Constructor arguments that must match for two stats to be merged."""
        return {}

    # -- combination ---------------------------------------------------------------------------

    def merge(self, other: GroupedSums) -> GroupedSums:
        """Add another stats' sums into this one (in place) and return self."""
        if type(other) is not type(self) or other._config() != self._config():
            raise ValueError(
                f"cannot merge {type(other).__name__}{other._config()} into {type(self).__name__}{self._config()}"
            )
        for key, row in other._groups.items():
            self._row(key)[:] += row
        return self

    def group_keys(self) -> list[str]:
        return sorted(self._groups)

    def to_vector(self, keys: Sequence[str] | None = None) -> np.ndarray:
        """float64 [len(keys) · len(FIELDS)]: the sums of each group in `keys` order (default: sorted own keys)."""
        keys = self.group_keys() if keys is None else list(keys)
        missing = sorted(set(self._groups) - set(keys))
        if missing:
            raise ValueError(f"to_vector keys leave out groups this process has: {missing}")
        zero = np.zeros(len(self.FIELDS), np.float64)
        if not keys:
            return zero[:0]
        return np.concatenate([self._groups.get(k, zero) for k in keys])

    @classmethod
    def from_vector(cls, vector: np.ndarray, keys: Sequence[str], **config):
        """The inverse of `to_vector`: a stats whose groups hold the (summed) vector's blocks."""
        vector = np.asarray(vector, np.float64)
        width = len(cls.FIELDS)
        if vector.shape != (len(keys) * width,):
            raise ValueError(f"vector of shape {vector.shape} does not hold {len(keys)} groups of {width} sums")
        stats = cls(**config)
        for i, key in enumerate(keys):
            block = vector[i * width : (i + 1) * width]
            if block.any():  # a group no process saw stays absent from the report
                stats._row(key)[:] = block
        return stats

    # -- reading -------------------------------------------------------------------------------

    def _sums(self, key: str) -> dict[str, float]:
        row = self._groups.get(key, np.zeros(len(self.FIELDS)))
        return {name: float(row[i]) for name, i in self._index.items()}

    def _grouped_report(self, names: Sequence[str], metrics: Callable[[dict[str, float]], dict]) -> dict:
        """{"overall": metrics(overall sums), "by_<name>": {value: metrics(sums)}} for each breakdown name."""
        out: dict = {OVERALL: metrics(self._sums(OVERALL))}
        for name in names:
            out[f"by_{name}"] = {value: metrics(s) for value, s in self._breakdown(name)}
        return out

    def _breakdown(self, prefix: str) -> list[tuple[str, dict[str, float]]]:
        """(value, sums) of every group named `prefix:value`, sorted by value."""
        head = prefix + ":"
        return [(k[len(head) :], self._sums(k)) for k in self.group_keys() if k.startswith(head)]


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None (JSON null) when nothing was counted."""
    return numerator / denominator if denominator else None


def shown(x: float | None) -> str:
    """A metric for a summary line: 4 decimals, or `n/a` where its denominator was 0 (null)."""
    return "n/a" if x is None else f"{x:.4f}"
