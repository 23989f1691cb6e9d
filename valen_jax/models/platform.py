"""The platform a program is being built for: that of the mesh it is traced under.

Kernel choices (`attention.resolve`), kernel guards (`attention_accel`) and remat offload read this,
never `jax.default_backend()`, so a train step traced under a mesh of compile-only TPU devices
(`jax.experimental.topologies`, the ahead-of-time compile) picks and checks what the TPU runs, from a
CPU host. Without a mesh (`jax.set_mesh`) the program runs on the default backend's devices.
"""

from __future__ import annotations

import jax


def target_platform() -> str:
    """"cpu", "gpu" or "tpu": the abstract mesh's device platform (inside `jit` too), else the default
    backend's (a mesh never mixes platforms)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.abstract_device is not None:
        return mesh.abstract_device.platform
    return jax.default_backend()
