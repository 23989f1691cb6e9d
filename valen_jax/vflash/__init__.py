"""VFlash's block drafter as a feature (seed 004): its training task here; the drafter model
(`valen_jax.models.drafter`), speculative decoding (`valen_jax.decoding`), its evaluation
(`valen_jax.evaluation.speculative`) and `python -m valen_jax.regenerate` are still in their rooms
and move here next (issue 26, item 4)."""
