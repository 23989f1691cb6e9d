"""Reinforcement runs (issue 32): the parts the `reinforce` training mode (`valen_jax.tasks.reinforce`) is
made of — `rewards` (read against the assistant message, with evaluate's own metric definitions),
`objective` (advantages and the clipped policy-gradient loss, pure jnp), `rows` (prompt rows with their gold
answers through the shared data pipeline), `rollout` (sampling by the decode engine, scoring, training rows),
`update` (the compiled update and log-probabilities), `grader`/`grader_model` (a model as grader),
`refusals` (seed 003's, before any device) and `settings` (config.rl's checks, rollout seeds, metrics).
"""
