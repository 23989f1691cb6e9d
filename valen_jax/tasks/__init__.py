"""Training modes behind the Task protocol (`valen_jax.training.task`), one module each: `token_lm`
(next-token prediction on token data), `valen` (scored branches); `modes` names them for
`config.train.mode` (the drafter's task lives with its feature, in `valen_jax.vflash.task`)."""
