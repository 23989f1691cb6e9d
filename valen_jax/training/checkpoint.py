"""Orbax checkpoints holding everything evaluation and prediction need (DESIGN, "Checkpoints"),
and the workdir around them: where checkpoints and the tokenizer live, which step to read,
where damaged steps go.

Each step directory holds three items: `state` (params, optimizer state, step), `data` (the
Grain iterator state of this process) and `meta` (JSON: model config, `media_kwargs`,
tokenizer fingerprint, shard manifest, full config, project version, and the digests below).
The tokenizer files live once in `WORKDIR/tokenizer/`, checked against the fingerprint in
`meta` on every load. Beside them `WORKDIR/source/` keeps what an export writes back of the checkpoint the
run started from (`models/hf_source.py`): its config.json, generation_config.json and the chat template the
training template replaced.

Only Orbax's public API is used (`tests/test_checkpoint.py` pins what we rely on, and fails on
an Orbax upgrade that changes it): `state` is a `PyTreeCheckpointHandler` item (its public
`use_compression` option), `meta` a `JsonCheckpointHandler` item whose public `async_save` we
override, `data` Grain's own handler.

Saves are asynchronous: `save` returns once the arrays are copied off the devices, and Orbax
writes them in a background thread into `STEP.orbax-checkpoint-tmp`, renamed to `STEP` only
when every item is written. A kill mid-write leaves a tmp directory that the next run ignores
and deletes. A finished checkpoint can still be damaged later (a truncated or garbled file), and
garbled array bytes read back without error, so `meta` carries a digest of every state array
and of the iterator state; `restore_intact` checks them and falls back to the previous step.

Evaluation and prediction read only `params` (`restore_params_verified`): an Orbax partial
restore of the `state` item that never reads the optimizer moments (twice the params for Adam),
checked against the `params/...` digests alone.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from data_pipeline.tokenizer import TokenizerFingerprint, checkpoint_chat_template, fingerprint
from valen_jax.models import hf_source

log = logging.getLogger(__name__)

ITEMS = ("state", "data", "meta")


class CheckpointError(ValueError):
    """A workdir whose checkpoint cannot serve this run (missing, mismatched fingerprints)."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose files do not read back as what was saved."""


def checkpoint_dir(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / "checkpoints"


def corrupt_dir(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / "checkpoints-corrupt"


def tokenizer_dir(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / "tokenizer"


def source_dir(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / "source"


class _PendingDigests:
    """State digests still being computed on the devices when `save` returns.

    Fetching them in `save` would make the training loop wait for the reduction over every
    state array (a host sync per save); `MetaHandler` fetches them in its background write.
    """

    def __init__(self, paths: list[str], values: Any):
        self.paths, self.values = paths, values

    def resolve(self) -> dict[str, int]:
        return {p: int(d) for p, d in zip(self.paths, jax.tree.leaves(jax.device_get(self.values)), strict=True)}


class MetaHandler(ocp.handlers.JsonCheckpointHandler):
    """The `meta` item: Orbax's JSON handler, written by a thread of its own that first fetches the
    state digests.

    `async_save` returns the write as a commit future, which Orbax's background commit awaits
    before it renames the step directory: a step is final only with its digests written, and the
    save call never waits for them. The item directory exists when the thread starts because
    `manager` turns off Orbax's asynchronous directory creation.
    """

    FILENAME = "metadata"  # the stock handler's default: every checkpoint, old or new, holds this file

    def __init__(self):
        super().__init__(filename=self.FILENAME)
        # One writer thread: meta files are small and written in step order.
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="valen_jax-meta")

    @classmethod
    def typestr(cls) -> str:
        # The file is the stock handler's JSON, so the step metadata names the stock handler: any
        # Orbax reader restores `meta` without valen_jax.
        return ocp.handlers.JsonCheckpointHandler.typestr()

    async def async_save(self, directory, item=None, args=None):
        meta = args.item if args is not None else item
        # A concurrent.futures.Future is an orbax.checkpoint.future.Future (`result`, `cancel`).
        return [self._writer.submit(self._write, directory, meta)]

    def _write(self, directory, meta: dict[str, Any]) -> None:
        digest = meta.get("digest", {})
        if isinstance(digest.get("state"), _PendingDigests):
            meta = {**meta, "digest": {**digest, "state": digest["state"].resolve()}}
        if jax.process_index() == 0:
            (directory / self.FILENAME).write_text(json.dumps(meta))

    def close(self) -> None:
        # CheckpointManager.close() closes every item handler, after waiting for pending saves.
        self._writer.shutdown(wait=True)
        super().close()


def manager(workdir: str | Path, max_to_keep: int | None = None, read_only: bool = False,
            compress: bool = False) -> ocp.CheckpointManager:
    """The workdir's checkpoint manager; `compress` writes state arrays with zstd.

    Orbax compresses every array by default. Trained f32 weights and Adam moments are close to
    incompressible (a trained 144 MiB state wrote 134 MiB compressed: 7% less) while zstd
    multiplies the background writer's CPU time by 2-3, time taken from the host that feeds the
    accelerators (or, on CPU devices, from the step itself). Arrays record their codec, so
    restores read either kind.
    """
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=not read_only,
        # Read-only: the options Orbax would otherwise reset itself, with a warning for each (issue 27).
        save_interval_steps=0 if read_only else 1,
        create=not read_only,
        read_only=read_only,
        # A tmp directory is a save cut short by a crash: never a checkpoint, only clutter.
        cleanup_tmp_directories=not read_only,
        # Item directories made in the save call (a few mkdirs), so MetaHandler's thread can write.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    meta_handler = MetaHandler()
    registry.add("meta", ocp.args.JsonSave, meta_handler)
    registry.add("meta", ocp.args.JsonRestore, meta_handler)
    # The PyTree handler (rather than the standard one, which wraps it) for its compression option
    # and its partial restores; both write the same files. 96 GB in flight: the standard handler's.
    state_handler = ocp.handlers.PyTreeCheckpointHandler(use_compression=compress, save_concurrent_gb=96,
                                                         restore_concurrent_gb=96)
    registry.add("state", ocp.args.PyTreeSave, state_handler)
    registry.add("state", ocp.args.PyTreeRestore, state_handler)
    registry.add("data", grain.checkpoint.CheckpointSave)
    registry.add("data", grain.checkpoint.CheckpointRestore)
    if not read_only:
        return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, handler_registry=registry)
    # Orbax logs "Given directory is read only=DIR" at WARNING for every read_only manager: that is what
    # evaluate/predict/generate/export ask for on every run, not a condition of the directory, and it
    # read like a fault (issue 27). read_only stays (it refuses any save or deletion); only that one
    # record is dropped, only while the manager is built.
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(_drop_read_only_notice)
    try:
        return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, handler_registry=registry)
    finally:
        absl_logger.removeFilter(_drop_read_only_notice)


def _drop_read_only_notice(record: logging.LogRecord) -> bool:
    """A logging filter: False (drop) for Orbax's read-only notice alone."""
    return record.msg != "Given directory is read only=%s"


def select_step(mgr: ocp.CheckpointManager, workdir: str | Path, step: int | None = None) -> int:
    """`step` if the workdir has it, else (None) its latest checkpoint; CheckpointError when absent."""
    steps = sorted(mgr.all_steps())
    if not steps:
        raise CheckpointError(f"{checkpoint_dir(workdir)}: no checkpoint")
    if step is None:
        return steps[-1]
    if int(step) not in steps:
        raise CheckpointError(f"{checkpoint_dir(workdir)}: no checkpoint at step {step}; steps: {steps}")
    return int(step)


def _leaf_digest(x):
    """The wrapping uint32 sum of the array's bits.

    Exact integer arithmetic, so the result does not depend on sharding or reduction order (a
    restore on another mesh verifies alike), and computed without reshaping, so a sharded array
    is never gathered. Any change confined to one word, and random damage with probability
    1 − 2⁻³², changes it; only a permutation of whole words would not. One reduction: integer
    reductions are slow on XLA:CPU, and this runs on every save.
    """
    return jnp.sum(words_of(x), dtype=jnp.uint32)


def words_of(x):
    """The array's bits as uint32 words: one per element of 1, 2 or 4 bytes, two (a trailing axis) of 8."""
    if x.dtype == jnp.bool_ or x.dtype.itemsize == 1:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


_digest = jax.jit(lambda tree: jax.tree.map(_leaf_digest, tree))


def paths_of(tree) -> list[str]:
    """The '/'-joined path of every leaf of `tree`, in its leaves' order."""
    return ["/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def state_digest(state: Any) -> dict[str, int]:
    return _PendingDigests(paths_of(state), _digest(state)).resolve()


def state_layout(abstract_state: Any) -> list[str]:
    """`path shape dtype` of every state array: what a restore needs to find unchanged."""
    return [f"{p} {tuple(x.shape)} {x.dtype}" for p, x in zip(paths_of(abstract_state), jax.tree.leaves(abstract_state),
                                                              strict=True)]


def iterator_digest(iterator: grain.DatasetIterator) -> str:
    return hashlib.sha256(json.dumps(iterator.get_state(), sort_keys=True, default=str).encode()).hexdigest()


def save(mgr: ocp.CheckpointManager, step: int, state: Any, iterator: grain.DatasetIterator,
         meta: dict[str, Any], force: bool = False) -> bool:
    """Start an asynchronous save; the digests in `meta` let a later restore prove the files intact.

    The state digests are dispatched to the devices here (reading the arrays before the next
    step may donate them) and fetched by the background `meta` write (`MetaHandler`).
    """
    pending = _PendingDigests(paths_of(state), _digest(state))
    meta = {**meta, "digest": {"state": pending, "data": iterator_digest(iterator)}}
    return mgr.save(step, force=force, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(state),
        data=grain.checkpoint.CheckpointSave(iterator),
        meta=ocp.args.JsonSave(meta),
    ))


# The layout of `meta`. A meta is migrated to this version when it is read, so readers see one shape:
# 1 (no `schema_version`): written before it was recorded; `config.train.mode` may be missing (ar runs)
#   and a drafter's target record holds `params_sha256` (see `same_weights`);
# 2: `schema_version`; every run records `config.train.mode`; a drafter's target record holds
#   `params_identity` (`params_identity`);
# 3: a LoRA run's `state.params` holds only its trained leaves and `lora_base` records the base they were
#   trained on (`adapter_checkpoint`). A schema-2 LoRA meta reads as it is: no `lora_base`, its state holds
#   the base too (restores read it whole; a resume is refused, `tasks.token_lm`).
META_SCHEMA = 3


def migrate_meta(meta: dict[str, Any], where: str = "checkpoint") -> dict[str, Any]:
    """`meta` as META_SCHEMA lays it out (a copy); a meta from a newer valen_jax is refused."""
    version = int(meta.get("schema_version", 1))
    if version > META_SCHEMA:
        raise CheckpointError(f"{where}: meta schema_version {version} was written by a newer valen_jax (this one "
                              f"reads up to {META_SCHEMA}); upgrade valen_jax to read it")
    meta = json.loads(json.dumps(meta))
    if version < 2 and "config" in meta:
        meta["config"].setdefault("train", {}).setdefault("mode", "ar")  # runs from before train.mode: ar runs
    meta["schema_version"] = META_SCHEMA
    return meta


def restore_meta(mgr: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """Checkpoint `step`'s meta, migrated to META_SCHEMA; a meta that does not read back is CorruptCheckpoint."""
    try:
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as error:  # noqa: BLE001 - any read failure of a finished step's meta is damage
        detail = " ".join(f"{type(error).__name__}: {error}".split())
        raise CorruptCheckpoint(f"{mgr.directory}: checkpoint {step}: meta does not read back ({detail[:300]})") \
            from error
    return migrate_meta(meta, f"{mgr.directory}: checkpoint {step}")


def restore_state(mgr: ocp.CheckpointManager, step: int, abstract_state: Any,
                  iterator: grain.DatasetIterator | None = None) -> Any:
    """Restore params/optimizer into the shardings of `abstract_state`; the iterator in place."""
    items = {"state": ocp.args.PyTreeRestore(item=abstract_state,
                                             restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))}
    if iterator is not None:
        items["data"] = grain.checkpoint.CheckpointRestore(iterator)
    return mgr.restore(step, args=ocp.args.Composite(**items)).state


def restore_params(mgr: ocp.CheckpointManager, step: int, abstract_params: Any) -> Any:
    """Only the `params` subtree of the `state` item, into the shardings of `abstract_params`.

    An Orbax partial restore: leaves of the saved tree missing from the target (`opt_state`,
    `step`) are skipped, neither read nor allocated.
    """
    item = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True)
    return mgr.restore(step, args=ocp.args.Composite(state=args)).state["params"]


def _saved_digests(step: int, meta: dict[str, Any]) -> dict[str, Any] | None:
    digests = meta.get("digest")
    if digests is None:
        log.warning("checkpoint %d has no digests (written by an older valen_jax); not verified", step)
    return digests


def _check_digests(step: int, what: str, expected: dict[str, int], found: dict[str, int]) -> None:
    bad = [p for p, d in expected.items() if found.get(p) != d]
    if bad or set(found) != set(expected):
        raise CorruptCheckpoint(f"checkpoint {step}: {what} arrays differ from their save-time digest: "
                                f"{', '.join(bad[:5]) or 'the set of arrays'}")


def verify(step: int, meta: dict[str, Any], state: Any, iterator: grain.DatasetIterator | None) -> None:
    """Raise CorruptCheckpoint when what was read differs from the digests taken at save time."""
    expected = _saved_digests(step, meta)
    if expected is None:
        return
    _check_digests(step, "state", expected["state"], state_digest(state))
    if iterator is not None and iterator_digest(iterator) != expected["data"]:
        raise CorruptCheckpoint(f"checkpoint {step}: the data iterator state differs from its save-time digest")


def verify_params(step: int, meta: dict[str, Any], params: Any) -> None:
    """`verify` for a params-only restore: the `params/...` digests, every one of them."""
    expected = _saved_digests(step, meta)
    if expected is None:
        return
    _check_digests(step, "params", {p: d for p, d in expected["state"].items() if p.startswith("params/")},
                   state_digest({"params": params}))


def _refuse_other_layout(step: int, saved: list[str], wanted: list[str], what: str) -> None:
    if saved != wanted:
        changed = sorted(set(saved) ^ set(wanted))
        raise CheckpointError(f"checkpoint {step} holds another {what}: {'; '.join(changed[:4])}")


def restore_params_verified(mgr: ocp.CheckpointManager, step: int, meta: dict[str, Any],
                            abstract_params: Any) -> Any:
    """The params of `step`, proven intact against `meta`'s digests (no fallback to another step).

    Raises CheckpointError when the checkpoint holds another params layout (the model changed),
    CorruptCheckpoint when the params do not read back or differ from what was saved.
    """
    if meta.get("state_layout") is not None:
        _refuse_other_layout(step, [line for line in meta["state_layout"] if line.startswith("params/")],
                             state_layout({"params": abstract_params}), "params layout")
    try:
        params = restore_params(mgr, step, abstract_params)
    except Exception as error:  # noqa: BLE001 - any read failure of a finished step is damage
        raise CorruptCheckpoint(f"checkpoint {step}: params do not read back ({type(error).__name__}: "
                                f"{_error_summary(error)})") from error
    verify_params(step, meta, params)
    return params


def quarantine(mgr: ocp.CheckpointManager, workdir: str | Path, step: int) -> Path:
    """Move a corrupt step out of the manager's directory: kept for inspection, never restored again,
    and its step number free for the next save."""
    target = corrupt_dir(workdir) / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    if jax.process_index() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(checkpoint_dir(workdir) / str(step)), str(target))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"valen_jax quarantine {step}")
    mgr.reload()
    return target


def restore_intact(mgr: ocp.CheckpointManager, workdir: str | Path, abstract_state: Any,
                   iterator: grain.DatasetIterator, check_meta: Callable[[int, dict], None],
                   allow_fresh_start: bool = False):
    """(step, state, meta) of the newest checkpoint that reads back intact, or None if there is none.

    `check_meta(step, meta)` raises CheckpointError when the checkpoint belongs to another setup
    (tokenizer, model, optimizer layout): that is the user's mistake to fix, never a reason to
    fall back. A step that fails to read or to verify is logged with a warning naming it, moved
    to `checkpoints-corrupt/`, and the one before it is tried. Checkpoints that all fail are an
    error, not a fresh start, and so is a workdir whose checkpoints a previous run quarantined
    (its `checkpoints/` is empty, `checkpoints-corrupt/` is not): only `allow_fresh_start`
    (`config.train.allow_fresh_start`) turns either into None, i.e. training from step 0. It
    permits, never forces: an intact checkpoint is always resumed.
    """
    steps = sorted(mgr.all_steps(), reverse=True)
    for step in steps:
        try:
            meta = restore_meta(mgr, step)
        except Exception as error:  # noqa: BLE001 - any read failure of a finished step is damage
            _report_corrupt(mgr, workdir, step, error)
            continue
        check_meta(step, meta)
        if meta.get("state_layout") is not None:
            _refuse_other_layout(step, meta["state_layout"], state_layout(abstract_state),
                                 "train-state layout (model, optimizer, param_groups or vision_lr_multiplier "
                                 "changed; a workdir trained before vision_lr_multiplier resumes with "
                                 "--config.train.vision_lr_multiplier=1.0)")
        try:
            state = restore_state(mgr, step, abstract_state, iterator)
            verify(step, meta, state, iterator)
        except Exception as error:  # noqa: BLE001
            _report_corrupt(mgr, workdir, step, error)
            continue
        return step, state, meta
    quarantined = sorted(p.name for p in corrupt_dir(workdir).iterdir()) if corrupt_dir(workdir).is_dir() else []
    if not steps and not quarantined:
        return None  # a new workdir
    found = (f"no intact checkpoint among steps {steps}; the damaged ones are in {corrupt_dir(workdir)}" if steps
             else f"no checkpoint, and {len(quarantined)} damaged one(s) in {corrupt_dir(workdir)} "
                  f"({', '.join(quarantined[:4])})")
    if not allow_fresh_start:
        raise CheckpointError(f"{checkpoint_dir(workdir)}: {found}; training would start again from step 0. "
                              "To do that, pass --config.train.allow_fresh_start=True (or use a new workdir)")
    log.warning("%s: %s; starting from step 0 (config.train.allow_fresh_start)", checkpoint_dir(workdir), found)
    return None


def _error_summary(error: Exception) -> str:
    """The first line of an error's message (Orbax and TensorStore errors run to pages)."""
    return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__


def _report_corrupt(mgr, workdir, step: int, error: Exception) -> None:
    target = quarantine(mgr, workdir, step)
    log.warning("checkpoint %d is corrupt (%s: %s); moved to %s, trying the previous checkpoint",
                step, type(error).__name__, _error_summary(error), target)


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


def save_source(workdir: str | Path, init_from: str, tokenizer: PreTrainedTokenizerBase) -> None:
    """Keep what the export writes back of the run's source checkpoint (`init_from`, "" for none) and of
    the tokenizer's own chat template, read now: by export time the source may be gone or changed."""
    if jax.process_index() != 0:
        return
    target = source_dir(workdir)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    hf_source.keep(staging, str(init_from or ""), checkpoint_chat_template(tokenizer))
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


def params_sha256(params: Any) -> str:
    """sha256 over every parameter's path, dtype, shape and bytes, in path order: the identity of a set of
    weights whatever mesh holds them (a drafter's meta records its target's; issue 16)."""
    digest = hashlib.sha256()
    for path, leaf in zip(paths_of(params), jax.tree.leaves(params), strict=True):
        if not leaf.is_fully_addressable:  # another host holds part of it: gather the whole array here
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        value = jax.device_get(leaf)
        digest.update(f"{path} {value.dtype} {value.shape}\n".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _identity(layout: list[str], digests: dict[str, int], base: dict | None = None) -> str:
    params = {path: digests[path] for path in sorted(digests) if path.startswith("params/")}
    entries = sorted(entry for entry in layout if entry.startswith("params/"))
    held = {"layout": entries, "digests": params, **({"base": base["leaves"]} if base else {})}
    return hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()


def params_identity(meta: dict[str, Any], where: str = "checkpoint") -> str:
    """The identity of a checkpoint's weights read from its meta alone: sha256 over its params' layout
    (path, shape, dtype) and their save-time per-leaf digests (`_leaf_digest`).

    No array is read or gathered, so it costs the same for a 7B target on a pod as for the smoke model;
    `restore_params_verified` proves that the params read back match those digests. The same weights in a
    moved or copied workdir, or saved again at another step, have the same identity. What a leaf digest
    cannot tell apart (a permutation of whole words within one array) no training run produces."""
    digests = (meta.get("digest") or {}).get("state")
    if not digests:
        raise CheckpointError(f"{where}: its meta has no state digests (written by a valen_jax before they were "
                              "recorded), so its weights have no identity; train it again, or resume it once to "
                              "write a checkpoint that has them")
    # A LoRA checkpoint holds the trained leaves alone: the base's fingerprints (meta.lora_base) are its too.
    return _identity(meta.get("state_layout", []), digests, meta.get("lora_base"))


def params_identity_of(params: Any) -> str:
    """`params_identity` of params in memory (the digests computed on the devices, nothing gathered)."""
    state = {"params": params}
    return _identity(state_layout(state), state_digest(state))


def same_weights(record: dict[str, Any], identity: str, params: Any) -> bool:
    """Whether a drafter's record of its target (meta.drafter.target) names the weights of `identity`.
    A drafter saved before records held `params_identity` (meta schema 1) recorded `params_sha256`, the
    sha256 of every byte of the weights: it is compared the old way, gathering the weights once."""
    if "params_identity" in record:
        return record["params_identity"] == identity
    return record.get("params_sha256") == params_sha256(params)


def fingerprint_of(tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    return fingerprint(tokenizer).to_json()


__all__ = ["TokenizerFingerprint", "CheckpointError", "CorruptCheckpoint", "manager", "save", "restore_meta",
           "restore_state", "restore_intact", "restore_params", "restore_params_verified",
           "verify", "verify_params", "state_digest", "state_layout", "abstract_with",
           "save_tokenizer", "save_source", "source_dir", "load_tokenizer", "fingerprint_of", "checkpoint_dir", "params_sha256",
           "params_identity", "params_identity_of", "same_weights", "META_SCHEMA", "migrate_meta"]
