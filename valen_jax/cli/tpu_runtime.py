"""libtpu on a host without TPU chips: no TPU runtime started, and a quiet load for compile-only devices.

libtpu is installed on hosts without TPU chips too: the `tpu` extra (in `test`) brings it for
`python -m valen_jax.compile`'s compile-only devices. On such a host it wrote five lines of errors to
stderr ahead of every command's own output: with JAX_PLATFORMS unset JAX tries every registered backend,
TPU included, and libtpu's start-up, with no TPU VM metadata to read, complains about the slice's hosts
before JAX drops the backend quietly; `compile` loading it for compile-only devices printed the same.
"""

from __future__ import annotations

import os


def quiet_without_chips() -> None:
    """On a host without TPU chips: unregister JAX's TPU backend, and tell libtpu it is one host.

    Call before the first JAX computation (backends start lazily, on first use) and before compile-only
    devices are made. Pinning JAX_PLATFORMS to cpu instead would take a GPU host's backend away; only the
    TPU backend is dropped, so GPU and CPU hosts keep what JAX picks, and a host with TPU chips is left
    as it is. Compile-only devices (jax.experimental.topologies) load libtpu on their own, without that
    backend, so the ahead-of-time compile is unaffected.
    """
    # JAX_FORCE_TPU_INIT is JAX's own override for a TPU that its lookup does not see.
    if "JAX_FORCE_TPU_INIT" in os.environ:
        return
    import jax
    from jax._src import hardware_utils, xla_bridge

    # JAX's own lookup (Google's PCI vendor id with a TPU device id, every generation through TPU7x), the
    # one its Cloud TPU set-up trusts: where it finds no chip, JAX already tells libtpu to skip the TPU VM
    # metadata query, so JAX itself treats this host as having no TPU.
    chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
    if chips > 0 or (platforms and "tpu" in platforms.split(",")):
        return
    # What the skipped metadata would have said of a one-host slice. libtpu reads these when loaded,
    # for the runtime or for compile-only devices; the compile-only topologies come out the same with
    # them (v5e-8, v5p-64, v6e-16, v4-8: devices, coordinates and process indices compared).
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    # A platform list the user set is theirs (and without "tpu" starts no TPU runtime anyway).
    if not platforms:
        xla_bridge._backend_factories.pop("tpu", None)
