"""The mesh a restored model runs on: the training run's (`config.mesh`), fitted to the devices here."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import jax
from jax.sharding import Mesh

from valen_jax.models import sharding

log = logging.getLogger(__name__)


def fitted_mesh_shape(saved: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """The training run's mesh (`config.mesh`) on the `num_devices` here.

    The model axes keep their training sizes where the devices allow, so a model that needed FSDP
    or tensor parallelism to fit is split the same way at evaluation, not replicated whole; the
    data axis takes the devices left over. With fewer devices than an axis needs, that axis shrinks
    to the largest divisor that fits (tensor first, then fsdp), which `evaluation_mesh` logs. A
    `-1` axis means "the rest of the devices", here as in training.
    """
    # A run records the mesh it chose (training.mesh_choice); unset keys are filled as a mesh without a
    # memory size to choose by (data parallel).
    requested = sharding.choose_mesh(saved, num_devices)[0]
    rest = [axis for axis, size in requested.items() if size == -1]
    if len(rest) > 1:
        raise sharding.ShardingError(f"saved mesh {requested}: at most one axis may be -1")
    fitted, left = {}, int(num_devices)
    for axis in ("tensor", "fsdp", "data"):  # model axes first: they decide the memory per device
        if requested[axis] != -1:
            fitted[axis] = math.gcd(requested[axis], left)
            left //= fitted[axis]
    if rest:
        fitted[rest[0]] = left
    else:
        fitted["data"] *= left  # more devices than training had: the spare ones split the batch
    return {axis: fitted[axis] for axis in sharding.MESH_AXES}


def evaluation_mesh(saved: Mapping[str, int], devices=None) -> Mesh:
    """A mesh over `devices` (default: all) shaped like the training run's (`fitted_mesh_shape`)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = fitted_mesh_shape(saved, len(devices))
    for axis in ("fsdp", "tensor"):
        if saved[axis] is not None and int(saved[axis]) not in (-1, shape[axis]):
            log.warning("the model was trained with mesh.%s=%s; %d devices here allow %d, so each device "
                        "holds a larger part of the parameters", axis, saved[axis], len(devices), shape[axis])
    return sharding.make_mesh(shape, devices)
