"""Reinforcement runs (issue 32): the rewards registry and the group-relative objective.

Only the host-independent parts exist yet: `rewards` (reading the assistant message as the gold
answer, with evaluate's own metric definitions) and `objective` (advantages and the clipped
policy-gradient loss, pure jnp so it is traced into the one compiled update step). The training
mode, rollouts, refusals and the smoke check are not built yet.
"""
