"""Generation with a KV cache: `generate_ids` (engine.py) and the choice of each next token (sampling.py)."""

from valen_jax.decoding.engine import generate_ids
from valen_jax.decoding.sampling import Sampling

__all__ = ["Sampling", "generate_ids"]
