"""Join a multi-process JAX job when the environment describes one; a single process does nothing.

Must run before anything touches a JAX backend (device lists, arrays, jit): the backend is built
once, and only a backend built after `jax.distributed.initialize` sees the other processes' devices.

Where the job description comes from, first match wins:
  1. `VALEN_COORDINATOR` (host:port of process 0), `VALEN_NUM_PROCESSES`, `VALEN_PROCESS_ID`:
     set by `launch/local.py` and `launch/gke.yaml`, for places JAX cannot detect on its own.
  2. A cluster JAX's own `jax.distributed.initialize()` detects (jax/_src/clusters in JAX 0.10:
     Open MPI, SLURM, Cloud TPU VM / GKE TPU), when it reports more than one process.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger("valen_jax.cli.distributed")

ENV_COORDINATOR = "VALEN_COORDINATOR"
ENV_NUM_PROCESSES = "VALEN_NUM_PROCESSES"
ENV_PROCESS_ID = "VALEN_PROCESS_ID"


class DistributedError(RuntimeError):
    """A multi-process job described incompletely or inconsistently."""


def explicit_job(environ=os.environ) -> tuple[str, int, int] | None:
    """(coordinator, process count, process id) from the VALEN_* variables, or None when none is set."""
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    given = {name: environ.get(name) for name in names}
    if not any(given.values()):
        return None
    missing = [name for name, value in given.items() if not value]
    if missing:
        raise DistributedError(f"multi-process job: {', '.join(missing)} not set (set all of {', '.join(names)})")
    count, index = int(given[ENV_NUM_PROCESSES]), int(given[ENV_PROCESS_ID])
    if not 0 <= index < count:
        raise DistributedError(f"{ENV_PROCESS_ID}={index} is outside 0..{count - 1}")
    return given[ENV_COORDINATOR], count, index


def detected_cluster() -> str | None:
    """Name of the cluster JAX would auto-detect with more than one process, or None.

    Uses JAX's own detectors, in JAX's order, so this agrees with what `initialize()` will find;
    a one-process allocation (a single-host TPU VM, `srun -n1`) is left alone like a laptop.
    The module is private, hence the guarded import: without it only VALEN_* jobs are joined.
    """
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - a JAX that moved its cluster detectors
        log.warning("jax._src.clusters not found: only %s-described jobs are joined", ENV_COORDINATOR)
        return None
    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method or not env.is_env_present():
            continue
        return env.name if env.get_process_count() > 1 else None
    return None


def initialize() -> None:
    """Join the job the environment describes (see the module doc), then log the topology."""
    job = explicit_job()
    cluster = None if job else detected_cluster()
    if job is None and cluster is None:
        return
    # Without cross-process collectives a CPU computation spanning processes fails at run time;
    # gloo (TCP, bootstrapped through the coordinator) needs no MPI. It is JAX 0.10's default, set
    # here so another default cannot silently break CPU jobs; it only affects the CPU backend.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if job is not None:
        coordinator, count, index = job
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=count, process_id=index)
    else:
        jax.distributed.initialize()
    log.info("process %d of %d (%s): %d local devices, %d global (%s)", jax.process_index(),
             jax.process_count(), "VALEN_* environment" if job else cluster, jax.local_device_count(),
             jax.device_count(), jax.devices()[0].platform)

