"""Evaluation of a trained workdir, or of a run during training.

    workdir   restore a checkpoint (params only, on the training config's mesh) and read the data
    hosts     which examples a process evaluates; sums added across processes before any ratio
    tokens    the one teacher-forced path (per-example sums) and greedy decoding over token rows
    valen, vflash, chat   one evaluator per record family: evaluate(restored, examples, options), summary(report)
    registry  the table of those evaluators, keyed by the format registry's family
    options   what a caller chooses about one evaluation (a leaf: evaluators and registry read it)
    (a vflash workdir, drafter and frozen target: `valen_jax.vflash.evaluation`)
    periodic  evaluation every `config.eval.every` steps, through the same code
    metrics   the formulas each family's evaluator sums

The CLIs are `valen_jax.evaluate` and `valen_jax.predict`.
"""
