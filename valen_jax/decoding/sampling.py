"""How the next token is chosen from the logits: greedy, temperature, top-k and top-p (nucleus).

Everything runs in f32 on the device, one PRNG key per row. The filters compose in the order HF's
`generate` applies its logits warpers: temperature, then top-k, then top-p; the kept logits are then
sampled by `jax.random.categorical`, which renormalises over what is left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax); > 0: sample softmax(logits / temperature)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off (nucleus: smallest set with mass >= top_p)

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"Sampling.temperature={self.temperature!r}: must be a finite number >= 0 "
                             f"(0 is greedy decoding)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"Sampling.top_k={self.top_k!r}: must be an integer >= 0 (0 turns it off)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or \
                not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p={self.top_p!r}: must be in (0, 1] (1 turns it off)")
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            # Greedy ignores the filters; saying so beats a run that silently is not what was asked.
            raise ValueError(f"Sampling(top_k={self.top_k}, top_p={self.top_p}) needs temperature > 0: "
                             f"temperature 0 is greedy decoding, which takes no filters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def mask_vocab(logits, vocab: int):
    """f32 logits with ids >= `vocab` (embedding rows past the tokenizer) at -inf: never produced."""
    logits = logits.astype(jnp.float32)
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits, -jnp.inf)


def filter_logits(logits, sampling: Sampling):
    """f32 logits [..., V] divided by the temperature, with what top-k and top-p drop at -inf.

    top-k keeps exactly the k largest (ties broken towards the lower id, as `lax.top_k`); top-p keeps
    the smallest set of most likely tokens whose mass reaches top_p: a token stays when the mass of
    the tokens ranked before it is still below top_p, so the most likely one always stays."""
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k:
        k = min(sampling.top_k, logits.shape[-1])
        _, kept = jax.lax.top_k(logits, k)
        keep = jnp.zeros(logits.shape, bool)
        keep = jnp.put_along_axis(keep, kept, True, axis=-1, inplace=False)
        logits = jnp.where(keep, logits, -jnp.inf)
    if sampling.top_p < 1:
        logits = _nucleus(logits, sampling.top_p)
    return logits


def _nucleus(logits, top_p):
    """logits [..., V] with what top-p drops at -inf (`filter_logits`); `top_p` a number, or an array
    broadcasting against [..., 1] (`filter_rows`): the same operations either way, so the same tokens."""
    order = jnp.argsort(-logits, axis=-1, stable=True)
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_ranked = before < top_p
    keep = jnp.put_along_axis(jnp.zeros(logits.shape, bool), order, keep_ranked, axis=-1, inplace=False)
    return jnp.where(keep, logits, -jnp.inf)


def sample(logits, keys, sampling: Sampling, vocab: int):
    """int32 [B]: the next token of each row from logits [B, V] and one PRNG key per row [B].

    Greedy is `argmax`, whose ties go to the first index (the uncached decoder's rule). A `RowSampling`:
    each row its own (`sample_rows`)."""
    if isinstance(sampling, RowSampling):
        return sample_rows(logits, keys, sampling, vocab)
    logits = mask_vocab(logits, vocab)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, sampling)
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)


@dataclass(frozen=True)
class SamplingKind:
    """What a program choosing tokens for rows of different `Sampling`s must contain (`RowSampling`): the
    numbers are per-row arrays, so a server compiles one program per kind (at most 5: greedy, or sampled
    with or without each filter), not one per distinct temperature, top-k or top-p a client sends (each a
    compile that stalls every slot, and a program kept for the server's life), and serves rows of
    different samplings in one call. Each filter sorts every row's vocabulary, so it is compiled in only
    where some row asks for it."""

    sampled: bool = False  # some row has temperature > 0 (else argmax only)
    top_k: bool = False  # some row has top-k
    top_p: bool = False  # some row has top-p

    @classmethod
    def of(cls, samplings) -> SamplingKind:
        samplings = list(samplings)
        return cls(sampled=any(not s.greedy for s in samplings), top_k=any(s.top_k > 0 for s in samplings),
                   top_p=any(s.top_p < 1 for s in samplings))


def sampling_rows(samplings, size: int) -> RowSampling:
    """Each row's numbers as host arrays [size] (temperature f32, 0 for greedy; top_k int32, 0 for off; top_p
    f32, 1 for off) and the kind that covers them; rows past `samplings` (or None in it) are greedy."""
    temperature, top_k, top_p = np.zeros(size, np.float32), np.zeros(size, np.int32), np.ones(size, np.float32)
    for row, sampling in enumerate(samplings):
        if sampling is not None:
            temperature[row], top_k[row], top_p[row] = sampling.temperature, sampling.top_k, sampling.top_p
    return RowSampling(SamplingKind.of(s for s in samplings if s is not None), temperature, top_k, top_p)


def sample_rows(logits, keys, rows: RowSampling, vocab: int):
    """int32 [B]: each row's next token as `sample` chooses it for that row's own `Sampling`, with its own
    key: the same operations on the same values (a row without a filter skips it, as `filter_logits`
    does), so a seeded row draws what `generate` draws."""
    logits = mask_vocab(logits, vocab)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not rows.kind.sampled:
        return greedy
    drawn = jax.vmap(jax.random.categorical)(keys, filter_rows(logits, rows)).astype(jnp.int32)
    return jnp.where(rows.temperature > 0, drawn, greedy)


def filter_rows(logits, rows: RowSampling):
    """`filter_logits` with the numbers per row: logits f32 [..., V], `rows`' numbers of shape [...] (a
    greedy row, temperature 0, is divided by 1: its filtered logits are not used)."""
    temperature, top_k, top_p = rows.temperature, rows.top_k, rows.top_p
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1)[..., None]
    if rows.kind.top_k:
        order = jnp.argsort(-scaled, axis=-1, stable=True)  # ties towards the lower id, as lax.top_k
        within = jnp.arange(scaled.shape[-1]) < jnp.where(top_k > 0, top_k, scaled.shape[-1])[..., None]
        keep = jnp.put_along_axis(jnp.zeros(scaled.shape, bool), order, within, axis=-1, inplace=False)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    if rows.kind.top_p:
        scaled = jnp.where((top_p < 1)[..., None], _nucleus(scaled, top_p[..., None]), scaled)
    return scaled


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class RowSampling:
    """Each row's own sampling (`sampling_rows` builds it on the host), passed to a compiled program whole:
    the numbers are its arrays, `kind` is static (in the pytree's structure), so new numbers compile
    nothing (`decoding.loop.Passes`, where a `Sampling` is the whole batch's; `sample_rows`). Its leaves
    are per row ([B]), or scalars for one row under `vmap` (`verification.accept_pass`)."""

    kind: SamplingKind
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @property
    def greedy(self) -> bool:
        """No row samples (statically): the program is argmax only."""
        return not self.kind.sampled

    def tree_flatten(self):
        return (self.temperature, self.top_k, self.top_p), self.kind

    @classmethod
    def tree_unflatten(cls, kind, leaves):
        return cls(kind, *leaves)
