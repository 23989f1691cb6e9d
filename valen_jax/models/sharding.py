"""Mesh construction and the one table mapping logical axis names to mesh axes.

Modules name their axes (`embed`, `mlp`, `heads`, `vocab`, and for activations `batch`,
`length`, ...); this table decides where they live, so changing parallelism is a config
change (DESIGN, "Logical axes everywhere").

The mesh uses `AxisType.Auto`: shardings are given to `jit` and propagated by GSPMD. JAX 0.10's
`make_mesh` defaults to Explicit axes, which would force sharding-in-types on every op.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Parameters: the embedding dimension is split by fsdp (ZeRO-3 style), the wide dimensions by
# tensor. Activations keep `embed` whole and split the batch over data × fsdp.
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "layers": None,
    "length": None,
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "vocab": "tensor",
    "norm": None,
    "patch": None,
    # A LoRA adapter's rank (A's last axis, B's first) is small: never split. Its other axes are those of
    # the weight it adapts, so it shards like that weight (models/lora.py).
    "lora_rank": None,
    # QLoRA's flat NF4 codes and block maxima (models/nf4.py): replicated, a quarter of the bf16 base.
    "nf4": None,
    "act_embed": None,
    "act_mlp": "tensor",
    "act_heads": "tensor",
    "act_vocab": "tensor",
}


class ShardingError(ValueError):
    """A mesh or rule that does not fit the devices or the parameter shapes."""


def mesh_shape(requested: Mapping[str, int | None], num_devices: int) -> dict[str, int]:
    """Resolve one `-1` entry as "the rest of the devices". Unset (None) entries: as `choose_mesh` fills
    them without a memory size (data parallel); `training.mesh_choice` is what chooses by memory."""
    if any(requested[axis] is None for axis in MESH_AXES):
        requested = choose_mesh(requested, num_devices)[0]
    shape = {axis: int(requested[axis]) for axis in MESH_AXES}
    unknown = [axis for axis, size in shape.items() if size == -1]
    if len(unknown) > 1:
        raise ShardingError(f"mesh {shape}: at most one axis may be -1")
    known = math.prod(size for size in shape.values() if size != -1)
    if unknown:
        if num_devices % known:
            raise ShardingError(f"mesh {shape}: {num_devices} devices are not divisible by {known}")
        shape[unknown[0]] = num_devices // known
    if math.prod(shape.values()) != num_devices:
        raise ShardingError(f"mesh {shape} needs {math.prod(shape.values())} devices, {num_devices} present")
    return shape


# The default mesh's choice (`choose_mesh`): the replicated train state (params, gradients, optimizer state)
# may take at most this share of a device's memory; the rest is for activations and the compiler's
# temporaries (a 0.5B full fine-tune on a 16 GiB v5e chip: 7.9 GiB of state, fits data parallel).
STATE_SHARE = 0.5
DATA_PARALLEL = {"data": -1, "fsdp": 1, "tensor": 1}
FULLY_SHARDED = {"data": 1, "fsdp": -1, "tensor": 1}
FSDP_FLAGS = "--config.mesh.data=1 --config.mesh.fsdp=-1"
GIB = 1024 ** 3


def choose_mesh(requested: Mapping[str, int | None], num_devices: int, state_bytes: float | None = None,
                device_bytes: float | None = None, device_kind: str = "device") -> tuple[dict[str, int], str]:
    """The mesh to build (a `-1` axis takes the rest) and why, in words for the log.

    Keys the user set (`config.mesh`) are kept; with some set, the unset ones are 1, but `data` takes the
    rest of the devices unless a set key already does. With none set, the choice is by memory: data
    parallel when the replicated train state (`state_bytes`: params, gradients, optimizer state) fits in
    STATE_SHARE of one device's memory (`device_bytes`, the target's), else FSDP over every device (a 7B
    full fine-tune holds 16 bytes a parameter, more than a 95 GiB v5p chip). Unknown memory (a CPU) or
    one device: data parallel."""
    given = {axis: requested[axis] for axis in MESH_AXES if requested[axis] is not None}
    if given:
        shape = {"data": 1 if -1 in given.values() else -1, "fsdp": 1, "tensor": 1, **given}
        return {axis: int(shape[axis]) for axis in MESH_AXES}, "as config.mesh sets it"
    if num_devices == 1:
        return dict(DATA_PARALLEL), "config.mesh unset: one device"
    if state_bytes is None or device_bytes is None:
        return dict(DATA_PARALLEL), (f"config.mesh unset: data parallel, since {device_kind} devices report no "
                                     "memory size to choose by")
    state = (f"the replicated train state (params, gradients, optimizer state: {state_bytes / GIB:.1f} GiB) "
             f"{{}} {STATE_SHARE:.0%} of a {device_kind}'s {device_bytes / GIB:.1f} GiB")
    if state_bytes <= STATE_SHARE * device_bytes:
        return dict(DATA_PARALLEL), f"config.mesh unset: data parallel, since {state.format('fits in')}"
    return dict(FULLY_SHARDED), (f"config.mesh unset: FSDP over the {num_devices} devices "
                                 f"({state_bytes / num_devices / GIB:.2f} GiB of state each), since "
                                 f"{state.format('exceeds')}; {FSDP_FLAGS} sets this, --config.mesh.* another")


def memory_advice(shape: Mapping[str, int], num_devices: int) -> str:
    """What to change when a program does not fit the devices' memory on the mesh `shape` (resolved)."""
    split = int(shape["fsdp"]) * int(shape["tensor"])
    if split < num_devices:
        return (f"the mesh (data={shape['data']} fsdp={shape['fsdp']} tensor={shape['tensor']}) keeps "
                f"{num_devices // split} copies of the params and optimizer state; shard them over the "
                f"{num_devices} devices with {FSDP_FLAGS}")
    held = ("one device holds the params and optimizer state" if num_devices == 1 else
            f"the mesh (fsdp={shape['fsdp']} tensor={shape['tensor']}) already shards the params over all "
            f"{num_devices} devices")
    return (f"{held}: fewer rows per device (config.data.global_batch, config.train.grad_accum_steps), shorter "
            "rows (config.data.seq_len), config.model.remat=full or more devices")


def make_mesh(requested: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(requested, len(devices))
    return jax.make_mesh(tuple(shape.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def logical_to_spec(axes: Sequence[str | None], rules: Mapping[str, object] = DEFAULT_RULES) -> PartitionSpec:
    mesh_axes = []
    used: set[str] = set()
    for name in axes:
        if name is None:
            mesh_axes.append(None)
            continue
        if name not in rules:
            raise ShardingError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        target = rules[name]
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        # A mesh axis may shard only one dimension of an array.
        targets = tuple(t for t in targets if t not in used)
        used.update(targets)
        mesh_axes.append(targets[0] if len(targets) == 1 else (targets or None))
    return PartitionSpec(*mesh_axes)


def _fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, where: str) -> PartitionSpec:
    for dim, axes in zip(shape, spec, strict=False):
        if axes is None:
            continue
        size = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
        if dim % size:
            raise ShardingError(f"{where}: dimension {dim} is not divisible by mesh axes {axes} (size {size})")
    return spec


def state_shardings(state: nnx.State, mesh: Mesh, rules: Mapping[str, object] = DEFAULT_RULES):
    """NamedSharding for every variable, from its `logical_axes` metadata (replicated if none)."""

    def one(path, variable):
        axes = variable.get_metadata().get("logical_axes")
        where = "/".join(str(getattr(p, "key", p)) for p in path)
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        if len(axes) != len(variable.get_value().shape):
            raise ShardingError(f"{where}: {len(axes)} logical axes for shape {variable.get_value().shape}")
        return NamedSharding(mesh, _fit_spec(logical_to_spec(axes, rules), variable.get_value().shape, mesh, where))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int, rules: Mapping[str, object] = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Activation sharding hint by logical names; a no-op outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes))


def global_batch(local: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Assemble each process's rows into global arrays sharded on the batch axis."""
    return {name: jax.make_array_from_process_local_data(batch_sharding(mesh, value.ndim), value)
            for name, value in local.items()}
