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
        order = jnp.argsort(-logits, axis=-1, stable=True)
        ranked = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        keep_ranked = before < sampling.top_p
        keep = jnp.put_along_axis(jnp.zeros(logits.shape, bool), order, keep_ranked, axis=-1, inplace=False)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def sample(logits, keys, sampling: Sampling, vocab: int):
    """int32 [B]: the next token of each row from logits [B, V] and one PRNG key per row [B].

    Greedy is `argmax`, whose ties go to the first index (the uncached decoder's rule)."""
    logits = mask_vocab(logits, vocab)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, sampling)
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
