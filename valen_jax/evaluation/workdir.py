"""What evaluators read besides the run (`valen_jax.run`: the checkpoint's model, tokenizer, row layout
and config): the data as Examples, its format, and the batch layout over the mesh."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from data_pipeline.format_registry import FORMATS
from data_pipeline.shards import Example
from valen_jax.data.shard_cache import ensure_shards
from valen_jax.errors import EvaluationError, UsageError
from valen_jax.models import sharding
from valen_jax.run import ModelRun

log = logging.getLogger(__name__)


def require_score_head(restored: ModelRun, where: str) -> None:
    """Valen questions are scored by the scalar head, which only a run with `loss.weights.branches` > 0
    builds; without it (e.g. a VFlash fine-tune of a VLM) there is nothing to score them with."""
    if not restored.model_cfg.score_head:
        raise EvaluationError(f"{where}: Valen questions are scored by the model's scalar head, and the checkpoint in "
                         f"{restored.workdir} (task {restored.config.task!r}) has none (trained with "
                         "loss.weights.branches=0); train with configs/valen.py, or evaluate data of its own format")


def data_format(restored: ModelRun, fmt: str | None) -> tuple[str, dict]:
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
