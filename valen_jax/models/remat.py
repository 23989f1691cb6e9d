"""Rematerialisation policies for the decoder layers (`config.model.remat`), as MaxText offers them.

- `none`: every layer's activations are kept for the backward pass (fastest, most memory).
- `full`: only each layer's input is kept; the whole layer is recomputed in the backward
  (activations O(1 layer) plus the layer inputs).
- `save_dots`: the outputs of the weight matmuls (q/k/v/o and MLP projections, matmuls without
  batch dimensions) are kept, everything else (norms, RoPE, attention, activations) recomputed:
  less recompute than `full` for about the projections' outputs in memory.
- `offload`: the same matmul outputs as `save_dots`, moved to pinned host memory in the forward
  and back in the backward: device memory close to `full`, recompute close to `save_dots`, paid
  in host transfers. GPU and TPU only (a `pinned_host` memory kind); refused on CPU, where JAX
  lowers the transfers to nothing and the policy would silently be `save_dots`.

Every policy computes the same function and gradients; only memory and recompute differ.
"""

from __future__ import annotations

import jax

from valen_jax.errors import ConfigError
from valen_jax.models.platform import target_platform

REMAT_POLICIES = ("none", "full", "save_dots", "offload")


def remat_name(value) -> str:
    """A policy name from a config value; the booleans of older checkpoint metas map to none/full."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in REMAT_POLICIES:
        raise ValueError(f"model remat={value!r}; choose one of {', '.join(REMAT_POLICIES)}")
    return value


def checkpoint_policy(name: str):
    """The `jax.checkpoint` policy of a remat name other than `none` (None: save nothing, `full`)."""
    policies = jax.checkpoint_policies
    if name == "full":
        return None
    if name == "save_dots":
        return policies.dots_with_no_batch_dims_saveable
    if name == "offload":
        check_offload()
        return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise ValueError(f"remat policy {name!r} has no checkpoint policy; choose one of {', '.join(REMAT_POLICIES[1:])}")


# Backends whose lowering turns a transfer to pinned host memory into a real copy. JAX lowers it
# to nothing on CPU (device memory is host memory there), where `offload` would silently be
# `save_dots`: refused instead.
OFFLOAD_PLATFORMS = ("gpu", "tpu")


def check_offload() -> None:
    """Refuse remat='offload' (a ConfigError, at the step's compile) where saved values cannot go to the host:
    on the platform of the mesh the step is traced under (an ahead-of-time TPU target too), not the host's."""
    platform = target_platform()
    if platform not in OFFLOAD_PLATFORMS:
        raise ConfigError(f"config.model.remat='offload' moves saved activations to pinned host memory, which the "
                          f"{platform} backend does not do (offload runs on {' and '.join(OFFLOAD_PLATFORMS)}); use "
                          "remat='save_dots' (the same values kept on the device) or 'full'")
