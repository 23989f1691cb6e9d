"""The TPU runtime for the commands: started on a host with TPU chips, never on one without.

libtpu is installed on hosts without TPU chips too: the `tpu` extra (in `test`) brings it for
`python -m valen_jax.compile`'s compile-only devices. With JAX_PLATFORMS unset, JAX then tries every
registered backend, TPU included, and libtpu's start-up on a host without chips writes five lines of
errors to stderr before JAX drops the backend quietly, ahead of every command's own output.
"""

from __future__ import annotations

import os


def skip_without_chips() -> None:
    """Unregister JAX's TPU backend when this host has no TPU chips and nobody asked for one.

    Call before the first JAX computation (backends start lazily, on first use). Pinning JAX_PLATFORMS to
    cpu instead would take a GPU host's backend away; only the TPU backend is dropped, so GPU and CPU hosts
    keep what JAX picks. Compile-only TPU devices (jax.experimental.topologies) load libtpu on their own,
    without this backend, so the ahead-of-time compile is unaffected.
    """
    # A platform list the user set (env or config) is theirs to keep, and JAX_FORCE_TPU_INIT is JAX's own
    # override for a TPU that its lookup does not see.
    if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ:
        return
    import jax
    from jax._src import hardware_utils, xla_bridge

    if jax.config.jax_platforms:
        return
    # JAX's own lookup (Google's PCI vendor id with a TPU device id, every generation through TPU7x), the
    # one its Cloud TPU set-up trusts: where it finds no chip, JAX already tells libtpu to skip the TPU
    # metadata query, so this host is treated as having no TPU by JAX itself.
    chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    if chips == 0:
        xla_bridge._backend_factories.pop("tpu", None)
