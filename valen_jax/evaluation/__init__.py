"""Evaluation of a trained workdir: restore (`workdir`), the data split over processes (`hosts`),
teacher forcing and greedy decoding over token rows (`tokens`), one evaluator per example kind
(`valen`, `vflash`, `chat`) and the metric formulas they sum (`metrics`). The CLIs are
`valen_jax.evaluate` and `valen_jax.predict`."""
