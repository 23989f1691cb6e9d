"""Restoring one checkpoint step of a workdir: a model run, or a drafter run holding its target's model run.

Every restore here reads the params alone (the optimizer moments stay on disk: twice the params'
memory) and verifies them against their save-time digests: CorruptCheckpoint names a damaged step,
with no fallback to another one. A LoRA checkpoint holds its trained leaves alone: the base is rebuilt
from the run's `config.model.init_from` (or its seed) and checked against the fingerprints its meta
recorded before the adapters go on it (`training.adapter_checkpoint`); a LoRA checkpoint of meta schema 2
holds the base too and is read whole. A run's weights are identified by those digests
(`checkpoint.params_identity`), never by gathering the weights.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from valen_jax.data.assemble import RowSpec
from valen_jax.models import drafter as block_drafter
from valen_jax.models import sharding
from valen_jax.models.build import lora_base
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import abstract_model, per_layer
from valen_jax.run.mesh import evaluation_mesh
from valen_jax.training import adapter_checkpoint, checkpoint

log = logging.getLogger(__name__)


@dataclass
class ModelRun:
    """One checkpoint step of a model's workdir (or, in training, the run's own live params), ready to run."""

    workdir: Path
    step: int | None  # None: the run's own params during training
    config: ml_collections.ConfigDict  # the full training config, as saved in `meta`
    model_cfg: ModelConfig
    tokenizer: object
    fingerprint: dict[str, str]
    spec: RowSpec
    mesh: Mesh
    graphdef: object
    params: object
    identity: str | None = None  # checkpoint.params_identity of the step's weights (None: the run's own, in training)

    @property
    def media_kwargs(self) -> dict:
        """The image processing the model was trained with (its row layout's)."""
        return self.spec.media_kwargs

    @property
    def shardings(self):
        """The params' shardings (a pytree like `params`), as they were laid out (arrays or abstract ones)."""
        return jax.tree.map(lambda leaf: leaf.sharding, self.params)


@dataclass
class DrafterRun:
    """One checkpoint step of a vflash workdir: the drafter and the target it was trained against."""

    workdir: Path
    step: int
    config: ml_collections.ConfigDict  # the drafter run's training config
    cfg: block_drafter.DrafterConfig
    graphdef: object
    params: object
    target: ModelRun
    record: dict  # meta.drafter.target: workdir, step, params_identity, tokenizer


def restore(workdir: str | Path, step: int | None = None, devices=None) -> ModelRun | DrafterRun:
    """The workdir's checkpoint at `step` (default: the latest): a DrafterRun for a vflash run's drafter,
    else a ModelRun; on `devices` (default: all), as the training config's mesh splits the params."""
    if holds_drafter(workdir, step):
        return restore_drafter(workdir, step, devices)
    return restore_model(workdir, step, devices)


def restore_model(workdir: str | Path, step: int | None = None, devices=None, *, mesh: Mesh | None = None
                  ) -> ModelRun:
    """The model of the workdir's checkpoint `step` (default: the latest), laid out on `mesh`, or on
    `devices` (default: all) as the training config's mesh splits it. A drafter's checkpoint is refused:
    it holds no model to decode with (its target does)."""
    workdir = Path(workdir).resolve()
    mgr = checkpoint.manager(workdir, read_only=True)
    try:
        step = checkpoint.select_step(mgr, workdir, step)
        meta = checkpoint.restore_meta(mgr, step)
        if "drafter" in meta:  # a vflash run's state is its drafter; the model to decode with is its target
            raise checkpoint.CheckpointError(
                f"{workdir}: checkpoint {step} holds a vflash block drafter, not a model to decode with; "
                f"`python -m valen_jax.evaluate` evaluates it by speculative decoding against its target "
                f"({meta['drafter']['target']['workdir']}), which is the workdir to predict or generate with")
        config = ml_collections.ConfigDict(meta["config"])
        fingerprint = meta["tokenizer"]["fingerprint"]
        tokenizer = checkpoint.load_tokenizer(workdir, fingerprint)
        model_cfg = ModelConfig.from_json(meta["model"])
        mesh = mesh if mesh is not None else evaluation_mesh(config.mesh, devices)
        graphdef, abstract = abstract_model(model_cfg)
        shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
        wanted = checkpoint.abstract_with(nnx.to_pure_dict(abstract), shardings)
        base = meta.get(adapter_checkpoint.BASE_KEY)
        if base is not None:  # a LoRA checkpoint: its trained leaves alone
            held = adapter_checkpoint.saved_paths(meta)
            wanted = adapter_checkpoint.select(wanted, lambda path: path in held)
        params = checkpoint.restore_params_verified(mgr, step, meta, wanted)
    finally:
        mgr.close()
    if base is not None:
        params = _on_base(workdir, step, config, model_cfg, tokenizer, shardings, base, params)
    spec = RowSpec.of(meta["row"]["seq_len"], meta["row"]["max_patches"], tokenizer, model_cfg,
                      meta["media_kwargs"])
    return ModelRun(workdir, step, config, model_cfg, tokenizer, fingerprint, spec, mesh, graphdef, params,
                    checkpoint.params_identity(meta, f"{workdir}: checkpoint {step}"))


def decoding_layout(run: ModelRun) -> ModelRun:
    """`run` with its decoder laid out per layer (`transformer.per_layer`) for the programs that decode: a run
    trained with `scan_layers` (the `hf` variant's default) stacks every layer's weights, which each decode step
    would copy out again. Called after the checks that read the checkpoint's layout (a drafter's target check),
    on runs whose stacked params the caller then drops; the weights and their identity are unchanged."""
    if not run.model_cfg.scan_layers:
        return run
    cfg, graphdef, params = per_layer(run.model_cfg, run.params, run.mesh)
    log.info("%s: decoding with the %d scanned layers laid out per layer", run.workdir, cfg.num_layers)
    return dataclasses.replace(run, model_cfg=cfg, graphdef=graphdef, params=params)


def restore_start(workdir: str | Path, where: str, fingerprint: dict, mesh: Mesh, *, first: str,
                  vocabulary: str = "", check: Callable[[Path], None] | None = None) -> ModelRun:
    """The latest checkpoint of another run's workdir that this run starts from or trains against (a
    reinforcement run's policy, a drafter's target), laid out on this run's `mesh`, refused naming the
    config key `where`: no checkpoints yet (`first`: what to train there), what `check(workdir)` refuses
    before anything is restored, an unreadable step, or a tokenizer other than this run's (`vocabulary`:
    why that matters, appended)."""
    workdir = Path(workdir).resolve()
    if not checkpoint.checkpoint_dir(workdir).is_dir():
        raise checkpoint.CheckpointError(f"{where}: no {checkpoint.checkpoint_dir(workdir)}; {first}")
    if check is not None:
        check(workdir)
    try:
        run = restore_model(workdir, mesh=mesh)
    except checkpoint.CheckpointError as error:
        raise checkpoint.CheckpointError(f"{where}: {error}") from None
    if run.fingerprint != fingerprint:
        raise checkpoint.CheckpointError(f"{where}: trained with tokenizer {run.fingerprint}; this run's "
                                         f"config.data.tokenizer gives {fingerprint}{vocabulary}")
    return run


def _on_base(workdir: Path, step: int, config, model_cfg: ModelConfig, tokenizer, shardings, base: dict,
             trained: dict) -> dict:
    """A LoRA checkpoint's `trained` leaves on its base, rebuilt as the run's start built it and refused
    unless every frozen leaf has the fingerprint its meta recorded (`training.adapter_checkpoint`)."""
    params = lora_base(config, model_cfg, tokenizer, shardings, base["seed"])
    adapter_checkpoint.check_base(base, params, f"{workdir}: checkpoint {step}")
    return adapter_checkpoint.with_trained(params, trained)


def restore_drafter(workdir: str | Path, step: int | None = None, devices=None, *,
                    target: ModelRun | None = None) -> DrafterRun:
    """The drafter at `step` (default: the latest) and its target, refused unless the target's params are
    the ones recorded at training (`check_target`) and share the drafter's tokenizer. `target`: a model
    already restored to decode with (a server's workdir), checked instead of restoring the recorded one."""
    workdir = Path(workdir).resolve()
    mgr = checkpoint.manager(workdir, read_only=True)
    try:
        step = checkpoint.select_step(mgr, workdir, step)
        meta = checkpoint.restore_meta(mgr, step)
        if "drafter" not in meta:
            raise checkpoint.CheckpointError(f"{workdir}: checkpoint {step} holds no drafter (not a vflash run)")
        record = meta["drafter"]["target"]
        if target is None:
            target = _recorded_target(workdir, step, record, devices)
        else:
            check_target(workdir, step, record, target)
        if target.fingerprint != meta["tokenizer"]["fingerprint"]:
            raise checkpoint.CheckpointError(
                f"{workdir}: drafter tokenizer {meta['tokenizer']['fingerprint']}, its target {target.workdir} "
                f"step {target.step} has {target.fingerprint}")
        cfg = block_drafter.DrafterConfig.from_json(meta["drafter"]["config"])
        graphdef, abstract = block_drafter.abstract_drafter(cfg)
        shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, target.mesh))
        params = checkpoint.restore_params_verified(
            mgr, step, meta, checkpoint.abstract_with(nnx.to_pure_dict(abstract), shardings))
    finally:
        mgr.close()
    return DrafterRun(workdir, step, ml_collections.ConfigDict(meta["config"]), cfg, graphdef, params, target, record)


def _recorded_target(workdir: Path, step: int, record: dict, devices) -> ModelRun:
    try:
        target = restore_model(record["workdir"], int(record["step"]), devices)
    except (checkpoint.CheckpointError, FileNotFoundError, ValueError) as err:
        raise checkpoint.CheckpointError(f"{_trained_against(workdir, step, record)}, which cannot be restored: "
                                         f"{err}") from err
    check_target(workdir, step, record, target)
    return target


def holds_drafter(workdir: str | Path, step: int | None = None) -> bool:
    """Whether the workdir's checkpoint `step` (default: the latest) is a vflash run's drafter."""
    workdir = Path(workdir).resolve()
    mgr = checkpoint.manager(workdir, read_only=True)
    try:
        return "drafter" in checkpoint.restore_meta(mgr, checkpoint.select_step(mgr, workdir, step))
    finally:
        mgr.close()


def target_record(target: ModelRun) -> dict:
    """What a drafter's checkpoint records of its target (meta.drafter.target): where, which step, the
    weights' identity (from the digests its save recorded and its restore verified) and the tokenizer."""
    return {"workdir": str(target.workdir), "step": target.step, "params_identity": target.identity,
            "tokenizer": target.fingerprint}


def check_target(workdir: Path, step: int, record: dict, target: ModelRun) -> None:
    """Refuse a target whose weights are not the ones the drafter at `workdir` `step` recorded. The target
    is its weights: the same weights found in a moved or copied workdir are the same target (a warning)."""
    if not checkpoint.same_weights(record, target.identity, target.params):
        raise checkpoint.CheckpointError(
            f"{_trained_against(workdir, step, record)}; {target.workdir} step {target.step} now holds other weights "
            f"(params identity {target.identity}): the target changed since the drafter trained, so its "
            "acceptance would describe other weights; train the drafter again (train.mode=vflash) against the "
            "target as it is")
    if Path(record["workdir"]) != Path(target.workdir):
        log.warning("%s: checkpoint %d was trained against the same target weights in %s; now read from %s",
                    workdir, step, record["workdir"], target.workdir)


def _trained_against(workdir: Path, step: int, record: dict) -> str:
    return (f"{workdir}: checkpoint {step} is a drafter for target {record['workdir']} step {record['step']} "
            f"({_weights(record)})")


def _weights(record: dict) -> str:
    if "params_identity" in record:
        return f"params identity {record['params_identity']}"
    return f"params sha256 {record['params_sha256']}"  # a drafter saved before meta schema 2
