"""The mesh a run trains on, for `train` and the ahead-of-time compile alike: `config.mesh` where the user
set it, else data parallel or FSDP by whether the replicated train state fits one of the TARGET's devices
(`sharding.choose_mesh`; DESIGN: choices by target, not host). The choice is logged in one line, and
written back into `config.mesh` (a `-1` axis for "the rest"), so the checkpoint's config records the mesh
the run had and evaluation lays the model out the same way (`run.mesh.fitted_mesh_shape`).

A memory refusal on that mesh (`refused_for_memory`) is one line naming the mesh keys to change.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from valen_jax.models import sharding
from valen_jax.models.build import model_config
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import abstract_model
from valen_jax.training import checkpoint
from valen_jax.training.optim import build_optimizer, frozen_mask, groups_of

log = logging.getLogger(__name__)


class DeviceMemoryError(sharding.ShardingError):
    """A run whose programs or state do not fit the devices' memory on its mesh."""


def _bytes(tree) -> int:
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)
               if hasattr(leaf, "dtype"))


def train_state_bytes(config, model_cfg: ModelConfig) -> int:
    """Bytes of one replicated copy of what a step holds beside its activations: the params, the trained
    ones' gradients and optimizer state (shapes only, nothing allocated). A `vflash` run trains a drafter
    of a few layers against a frozen target (`model_cfg`): the target's params alone. A reinforcement run
    with `rl.kl_coef` > 0 keeps a frozen reference copy too."""
    params = nnx.to_pure_dict(abstract_model(model_cfg)[1])
    total = _bytes(params)
    mode = str(config.train.mode)
    if mode == "vflash":
        return total
    tx, _ = build_optimizer(config.train, params, model_cfg.lora)
    total += _bytes(jax.eval_shape(tx.init, params))
    groups = groups_of(config.train, params, model_cfg.lora)
    if groups:
        frozen = frozen_mask(params, groups)
        total += sum(_bytes(leaf) for leaf, off in zip(jax.tree.leaves(params), jax.tree.leaves(frozen),
                                                       strict=True) if not off)
    else:
        total += _bytes(params)  # a gradient per param
    if "rl" in config and float(config.rl.kl_coef) > 0:
        total += _bytes(params)
    return total


def checkpoint_model(workdir) -> ModelConfig:
    """The architecture of `workdir`'s latest checkpoint, from its meta (JSON; no weights read)."""
    workdir = Path(workdir).resolve()
    mgr = checkpoint.manager(workdir, read_only=True)
    try:
        meta = checkpoint.restore_meta(mgr, checkpoint.select_step(mgr, workdir))
    finally:
        mgr.close()
    return ModelConfig.from_json(meta["model"])


def trained_model(config, tokenizer) -> ModelConfig:
    """The architecture a run of `config` holds: a `vflash` run's target (`model.target_from`), a
    reinforcement run's starting workdir (`rl.from_workdir`), else the config's (`model.init_from` or the
    model keys)."""
    if str(config.train.mode) == "vflash":
        return checkpoint_model(config.model.target_from)
    if "rl" in config and config.rl.from_workdir:
        return checkpoint_model(config.rl.from_workdir)
    return model_config(config, tokenizer)


def device_memory(device: jax.Device) -> int | None:
    """The memory XLA may use on `device` (a local one), or None where the runtime reports none (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def training_mesh(config, model_cfg: Callable[[], ModelConfig], devices: Sequence[jax.Device] | None = None,
                  device_bytes: int | None = None) -> Mesh:
    """The run's mesh over `devices` (default: all): config.mesh as set, or chosen (module docstring).
    `model_cfg` is called only when the choice needs the state's size; `device_bytes`: one device's memory,
    the target's (default: what the first local device reports)."""
    devices = list(devices if devices is not None else jax.devices())
    kind = devices[0].device_kind
    requested = {axis: config.mesh[axis] for axis in sharding.MESH_AXES}
    unset = all(value is None for value in requested.values())
    if unset and device_bytes is None:
        device_bytes = device_memory(next(d for d in devices if d.process_index == jax.process_index()))
    state = train_state_bytes(config, model_cfg()) if unset and device_bytes and len(devices) > 1 else None
    shape, why = sharding.choose_mesh(requested, len(devices), state, device_bytes, kind)
    mesh = sharding.make_mesh(shape, devices)
    for axis in sharding.MESH_AXES:
        config.mesh[axis] = shape[axis]
    log.info("mesh data=%d fsdp=%d tensor=%d over %d x %s: %s", *(mesh.shape[a] for a in sharding.MESH_AXES),
             len(devices), kind, why)
    return mesh


def is_out_of_memory(error: BaseException) -> bool:
    """Whether XLA refused a program or an allocation for the devices' memory."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


@contextmanager
def refused_for_memory(config) -> Iterator[None]:
    """Inside: XLA's out-of-memory error becomes one DeviceMemoryError line naming the mesh keys to change
    (`config.mesh` as `training_mesh` resolved it, over all devices)."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if not is_out_of_memory(error):
            raise
        detail = str(error).strip().splitlines()[0]
        shape = sharding.mesh_shape({axis: config.mesh[axis] for axis in sharding.MESH_AXES}, jax.device_count())
        raise DeviceMemoryError(f"{detail[:400]}; {sharding.memory_advice(shape, jax.device_count())}") from None
