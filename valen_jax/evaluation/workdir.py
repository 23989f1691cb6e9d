"""What evaluate and predict read from a workdir: the checkpoint's model, tokenizer, row layout and
config (DESIGN, "Checkpoints": they need nothing but the workdir), and the data as Examples."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from data_pipeline.format_registry import FORMATS
from data_pipeline.shards import Example
from valen_jax.data.assemble import RowSpec
from valen_jax.data.shard_cache import ensure_shards
from valen_jax.errors import EvaluationError, UsageError
from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import abstract_model
from valen_jax.training import checkpoint

log = logging.getLogger(__name__)

@dataclass
class Restored:
    """One checkpoint step of a workdir, ready to run."""

    workdir: Path
    step: int
    config: ml_collections.ConfigDict  # the full training config, as saved in `meta`
    model_cfg: ModelConfig
    tokenizer: object
    fingerprint: dict[str, str]
    spec: RowSpec
    mesh: Mesh
    graphdef: object
    params: object
    identity: str | None = None  # checkpoint.params_identity of the step's weights (None: the run's own, in training)


def restore(workdir: str | Path, step: int | None = None, devices=None) -> Restored:
    """The workdir's checkpoint at `step` (default: the latest), params only, verified against their
    save-time digests: CorruptCheckpoint names a damaged step (no fallback to another one). The
    params are laid out on `devices` (default: all) as the training config's mesh splits them."""
    workdir = Path(workdir).resolve()
    mgr = checkpoint.manager(workdir, read_only=True)
    step = checkpoint.select_step(mgr, workdir, step)
    meta = checkpoint.restore_meta(mgr, step)
    if "drafter" in meta:  # a vflash run's state is its drafter; the model to decode with is its target
        mgr.close()
        raise checkpoint.CheckpointError(
            f"{workdir}: checkpoint {step} holds a vflash block drafter, not a model to decode with; "
            f"`python -m valen_jax.evaluate` evaluates it by speculative decoding against its target "
            f"({meta['drafter']['target']['workdir']}), which is the workdir to predict or generate with")
    config = ml_collections.ConfigDict(meta["config"])
    fingerprint = meta["tokenizer"]["fingerprint"]
    tokenizer = checkpoint.load_tokenizer(workdir, fingerprint)
    model_cfg = ModelConfig.from_json(meta["model"])
    mesh = evaluation_mesh(config.mesh, devices)
    graphdef, abstract = abstract_model(model_cfg)
    shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
    abstract_params = checkpoint.abstract_with(nnx.to_pure_dict(abstract), shardings)
    try:
        # The params alone: the optimizer moments stay on disk (they would take twice the params' memory).
        params = checkpoint.restore_params_verified(mgr, step, meta, abstract_params)
    finally:
        mgr.close()
    spec = RowSpec.of(meta["row"]["seq_len"], meta["row"]["max_patches"], tokenizer, model_cfg,
                      meta["media_kwargs"])
    return Restored(workdir, step, config, model_cfg, tokenizer, fingerprint, spec, mesh, graphdef, params,
                    checkpoint.params_identity(meta, f"{workdir}: checkpoint {step}"))


def holds_drafter(workdir: str | Path, step: int | None = None) -> bool:
    """Whether the workdir's checkpoint `step` (default: the latest) is a vflash run's drafter."""
    workdir = Path(workdir).resolve()
    mgr = checkpoint.manager(workdir, read_only=True)
    try:
        return "drafter" in checkpoint.restore_meta(mgr, checkpoint.select_step(mgr, workdir, step))
    finally:
        mgr.close()


def require_score_head(restored: Restored, where: str) -> None:
    """Valen questions are scored by the scalar head, which only a run with `loss.weights.branches` > 0
    builds; without it (e.g. a VFlash fine-tune of a VLM) there is nothing to score them with."""
    if not restored.model_cfg.score_head:
        raise EvaluationError(f"{where}: Valen questions are scored by the model's scalar head, and the checkpoint in "
                         f"{restored.workdir} (task {restored.config.task!r}) has none (trained with "
                         "loss.weights.branches=0); train with configs/valen.py, or evaluate data of its own format")


def fitted_mesh_shape(saved: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """The training run's mesh (`config.mesh`) on the `num_devices` here.

    The model axes keep their training sizes where the devices allow, so a model that needed FSDP
    or tensor parallelism to fit is split the same way at evaluation, not replicated whole; the
    data axis takes the devices left over. With fewer devices than an axis needs, that axis shrinks
    to the largest divisor that fits (tensor first, then fsdp), which `evaluation_mesh` logs. A
    `-1` axis means "the rest of the devices", here as in training.
    """
    requested = {axis: int(saved[axis]) for axis in sharding.MESH_AXES}
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
        if int(saved[axis]) not in (-1, shape[axis]):
            log.warning("the model was trained with mesh.%s=%s; %d devices here allow %d, so each device "
                        "holds a larger part of the parameters", axis, saved[axis], len(devices), shape[axis])
    return sharding.make_mesh(shape, devices)


def data_format(restored: Restored, fmt: str | None) -> tuple[str, dict]:
    """The converter format and options for `--data`: `--format` when given, else the checkpoint's
    `data.eval_format`. The config's `data.eval_options` (e.g. vakforge's split) go with its own
    eval format only; another format converts with its defaults."""
    data_cfg = restored.config.data
    chosen = fmt or data_cfg.eval_format
    if chosen not in FORMATS:
        raise UsageError(f"--format={chosen!r}; choose one of {', '.join(FORMATS)}")
    options = dict(data_cfg.eval_options.to_dict()) if chosen == data_cfg.eval_format else {}
    return chosen, options


def load_examples(fmt: str, data: str | Path, workdir: Path, tokenizer_path: str | Path,
                  fingerprint: dict[str, str], options: dict | None, limit: int | None = None
                  ) -> tuple[list[Example], str, int]:
    """(the first `limit` Examples of `data` in data order, the family of records they hold, how many
    the data holds). The family is the format registry's (`data_pipeline.format_registry`: recipe
    shards hold VFlash records); evaluators are found by it.

    `data` is a JSONL/recipe file (converted once into `WORKDIR/eval_shards/`) or a shard directory.
    """
    shard_set = ensure_shards(fmt, Path(data), Path(workdir) / "eval_shards", tokenizer_path,
                              fingerprint, options)
    available = len(shard_set)
    count = available if limit is None else min(available, int(limit))
    source = shard_set.source()
    examples = [Example.from_bytes(source[i]) for i in range(count)]
    return examples, FORMATS[shard_set.manifest.data["format"]].family, available


def stack(rows: list[dict], size: int) -> dict[str, np.ndarray]:
    """Rows stacked into a fixed-size batch; missing rows are all zeros (zero weight, no branch)."""
    padded = rows + [jax.tree.map(np.zeros_like, rows[0])] * (size - len(rows))
    return {k: np.stack([r[k] for r in padded]) for k in rows[0]}


def local_batch_size(batch_size: int, mesh: Mesh) -> int:
    """Rows per process in one global batch of `batch_size` rows split over the batch-sharded devices."""
    devices = mesh.shape["data"] * mesh.shape["fsdp"]
    size = -(-int(batch_size) // devices) * devices  # round up so rows split evenly over devices
    if size != int(batch_size):
        log.info("evaluation batch %d rounded up to %d to split over %d devices", batch_size, size, devices)
    return size // jax.process_count()


def host_local(array: jax.Array, mesh: Mesh) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in the order it supplied them."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    spec = sharding.batch_sharding(mesh, array.ndim).spec
    return np.asarray(multihost_utils.global_array_to_host_local_array(array, mesh, spec))
