"""Orbax checkpoints holding everything evaluation and prediction need (DESIGN, "Checkpoints").

Each step directory holds three items: `state` (params, optimizer state, step), `data` (the
Grain iterator state of this process) and `meta` (JSON: model config, `media_kwargs`,
tokenizer fingerprint, shard manifest, full config, project version). The tokenizer files
live once in `WORKDIR/tokenizer/`, checked against the fingerprint in `meta` on every load.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from data_pipeline.tokenizer import TokenizerFingerprint, fingerprint

ITEMS = ("state", "data", "meta")


class CheckpointError(ValueError):
    """A workdir whose checkpoint cannot serve this run (missing, mismatched fingerprints)."""


def checkpoint_dir(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / "checkpoints"


def tokenizer_dir(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / "tokenizer"


def manager(workdir: str | Path, max_to_keep: int | None = None, read_only: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=not read_only,
        create=not read_only,
        read_only=read_only,
    )
    return ocp.CheckpointManager(checkpoint_dir(workdir), item_names=ITEMS, options=options)


def save(mgr: ocp.CheckpointManager, step: int, state: Any, iterator: grain.DatasetIterator,
         meta: dict[str, Any], force: bool = False) -> bool:
    return mgr.save(step, force=force, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(iterator),
        meta=ocp.args.JsonSave(meta),
    ))


def restore_meta(mgr: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    return mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


def restore_state(mgr: ocp.CheckpointManager, step: int, abstract_state: Any,
                  iterator: grain.DatasetIterator | None = None) -> Any:
    """Restore params/optimizer into the shardings of `abstract_state`; the iterator in place."""
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if iterator is not None:
        items["data"] = grain.checkpoint.CheckpointRestore(iterator)
    return mgr.restore(step, args=ocp.args.Composite(**items)).state


def abstract_with(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def save_tokenizer(workdir: str | Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Keep the run's tokenizer in the workdir so evaluate/predict need nothing else."""
    target = tokenizer_dir(workdir)
    if jax.process_index() != 0:
        return
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def load_tokenizer(workdir: str | Path, expected: dict[str, str]) -> PreTrainedTokenizerBase:
    path = tokenizer_dir(workdir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: missing; the workdir was not written by valen_jax.train")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    found = fingerprint(tokenizer).to_json()
    if found != expected:
        raise CheckpointError(f"{path}: tokenizer fingerprint {found} differs from the checkpoint's {expected}")
    return tokenizer


def fingerprint_of(tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    return fingerprint(tokenizer).to_json()


__all__ = ["TokenizerFingerprint", "CheckpointError", "manager", "save", "restore_meta", "restore_state",
           "abstract_with", "save_tokenizer", "load_tokenizer", "fingerprint_of", "checkpoint_dir"]
