"""The training loop: one run of any training mode, resumable, from a validated config.

`run(config, workdir, open_task)` converts the run's data into `WORKDIR/shards/` (and the eval data
into `WORKDIR/eval_shards/`) when needed, opens the mode's Task (`valen_jax.training.task`), resumes
from the workdir's latest intact checkpoint of the same setup (or starts fresh), then steps, logs
(`metrics.jsonl`, TensorBoard), evaluates as the task says, and checkpoints asynchronously every
`train.checkpoint_every` steps, at the end and on SIGTERM. Nothing here depends on the mode.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import valen_jax
from data_pipeline.tokenizer import load_tokenizer
from valen_jax.config.schema import check_batch_split, validate_config
from valen_jax.data.assemble import RowSpec
from valen_jax.data.pipeline import build_dataset
from valen_jax.data.prepared_checks import check_prepared_run
from valen_jax.data.references import resolve_config_data
from valen_jax.data.separation import check_separation
from valen_jax.data.shard_cache import config_shards, summary
from valen_jax.data.vision_processor import media_kwargs_of
from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig, dtype_of
from valen_jax.training import checkpoint, mesh_choice, workdir_lock
from valen_jax.training.metrics import MetricsLog, peak_flops_per_device
from valen_jax.training.preflight import check_run_data
from valen_jax.training.progress import FinishedSteps
from valen_jax.training.startup import StartUp, start_up
from valen_jax.training.task import Evaluation, Setup, Task

log = logging.getLogger("valen_jax.train")

OpenTask = Callable[[Setup, object], Task]
# A mode's checks of the config and its raw data before any device is claimed (seed 003's refusals of a
# reinforcement run): `valen_jax.tasks.modes.preflight`.
Preflight = Callable[[object], None]


class NonFiniteLoss(RuntimeError):
    """The training loss went NaN or infinite: the run stops instead of training on (issue 19)."""


class Preempted:
    """SIGTERM (preemption) or SIGINT (Ctrl-C) asks the loop to checkpoint the step in flight and stop;
    the command then exits 128 + the signal (143, 130), so a scheduler never reads a stop as success. A
    second Ctrl-C aborts at once (KeyboardInterrupt): Orbax writes a step into a temporary directory and
    renames it only when complete, so the checkpoints before it stay intact. The handlers the process had
    come back when the run ends."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {signum: signal.signal(signum, self._handle) for signum in (signal.SIGTERM, signal.SIGINT)}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        if signum == signal.SIGINT:
            log.warning("Ctrl-C: the step in flight is checkpointed, then the run stops (Ctrl-C again aborts)")

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def task_identity(config) -> dict:
    """What a workdir trains, which a resume must not change: the task, its data format and training mode."""
    return {"task": config.task, "data.format": config.data.format, "train.mode": config.train.mode}


def check_same_task(workdir: Path, step: int, saved: dict, config) -> None:
    """Refuse to continue checkpoint `step` (meta `saved`) with a config of another task, naming both."""
    saved_config = saved["config"]
    recorded = {"task": saved_config.get("task"), "data.format": saved_config["data"]["format"],
                "train.mode": saved_config["train"]["mode"]}
    wanted = task_identity(config)
    if recorded != wanted:
        differ = ", ".join(f"{key}={recorded[key]!r} (this config: {wanted[key]!r})"
                           for key in wanted if recorded[key] != wanted[key])
        raise checkpoint.CheckpointError(f"{workdir}: checkpoint {step} trains another task: {differ}; "
                                         "use another --workdir for this config")


def _check_latest_task(workdir: Path, config) -> None:
    """check_same_task on the latest checkpoint whose meta reads, before anything is written to the workdir.
    (A damaged latest step is restore_intact's to report; every step it restores is checked again.)"""
    if not checkpoint.checkpoint_dir(workdir).is_dir():
        return
    mgr = checkpoint.manager(workdir, read_only=True)
    try:
        for step in sorted(mgr.all_steps(), reverse=True):
            try:
                saved = checkpoint.restore_meta(mgr, step)
            except checkpoint.CheckpointError:
                raise
            except Exception:  # noqa: BLE001 - a damaged meta: restore_intact reports and skips it
                continue
            check_same_task(workdir, step, saved, config)
            return
    finally:
        mgr.close()


def run(config, workdir: str | Path, open_task: OpenTask, preflight: Preflight | None = None) -> dict:
    """Train `config` in `workdir` with the task `open_task(setup, train_set)` gives; the run's result.
    `preflight(config)`: the mode's refusals, after the data references resolve and before any device."""
    validate_config(config)
    workdir = Path(workdir).resolve()
    # Seed 003: registry references resolved (a resumed run: to the versions its checkpoint recorded)
    # before any device is claimed; an unknown one is refused here.
    references = resolve_config_data(config, workdir)
    # Issue 54: the eval set is the user's (or off), and image rows meet a model that accepts images.
    check_run_data(config)
    if preflight is not None:  # the mode's own refusals first (a reinforcement run refuses prepared rows whole)
        preflight(config)
    check_prepared_run(config)  # seed 003: before any device is claimed (ensure_shards asks JAX for processes)
    # A refused start-up (nothing to train, a mesh, a compile, a resume of another setup) leaves the workdir
    # as it was: what it wrote before the refusal is removed (valen_jax.training.startup).
    with start_up(workdir) as note:
        workdir.mkdir(parents=True, exist_ok=True)
        # Before anything is written there: a second trainer on this workdir is refused (issue 19).
        with workdir_lock.exclusive(workdir), note.undone_on_error(), mesh_choice.refused_for_memory(config):
            return _train(config, workdir, references, open_task, note)


def compatibility_check(workdir: Path, fingerprint: dict, model_cfg: ModelConfig, train_manifest, task: Task):
    """check_meta for restore_intact: a checkpoint of another setup is an error, never a fallback."""

    def check(step: int, saved: dict) -> None:
        check_same_task(workdir, step, saved, task.config)
        task.check_resume(step, saved)
        if saved["tokenizer"]["fingerprint"] != fingerprint:
            raise checkpoint.CheckpointError(
                f"{workdir}: checkpoint {step} was trained with tokenizer {saved['tokenizer']['fingerprint']}, "
                f"this run uses {fingerprint}")
        shards = saved["shards"]["train"]["tokenizer"]["fingerprint"]
        if shards != train_manifest.fingerprint:
            raise checkpoint.CheckpointError(
                f"{workdir}: checkpoint {step} was trained on shards made with tokenizer {shards}; "
                f"this run's train shards were made with {train_manifest.fingerprint}")
        if ModelConfig.from_json(saved["model"]) != model_cfg:
            raise checkpoint.CheckpointError(f"{workdir}: checkpoint {step} has another model config")

    return check


def _train(config, workdir: Path, references: dict | None, open_task: OpenTask, note: StartUp) -> dict:
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.template_family)
    fingerprint = checkpoint.fingerprint_of(tokenizer)
    mesh = mesh_choice.training_mesh(config, lambda: mesh_choice.trained_model(config, tokenizer))
    _check_latest_task(workdir, config)  # before the shards are written there
    # Both sets convert with the config's converter options, template family included (shard_cache).
    train_set = config_shards(config, "train", workdir / "shards", fingerprint)
    log.info("train shards: %s", summary(train_set))
    # Seed 003: train and eval kept apart, checked on the shards before the step compiles. The eval
    # shards land where evaluation during and after training reads them (WORKDIR/eval_shards).
    # data.eval=None: a run without evaluation (valen_jax.data.run_checks.check_eval_data).
    overlap = {}
    if config.data.eval is not None:
        eval_set = config_shards(config, "eval", workdir / "eval_shards", fingerprint)
        overlap = check_separation(train_set, eval_set, allow_overlap=bool(config.data.allow_overlap),
                                   train_name=str(config.data.train), eval_name=str(config.data.eval))
    task = open_task(Setup(config, workdir, tokenizer, fingerprint, mesh), train_set)
    model_cfg = task.model_cfg
    task.check_trainable()  # counted on the shards, before anything is compiled or checkpointed
    # Seed 000: unset media_kwargs come from the base model's processor files (smoke defaults from scratch).
    media_kwargs, media_sources = media_kwargs_of(config, model_cfg.vision)
    task.check_media(media_kwargs)
    log.info("media_kwargs: %s", ", ".join(f"{k}={v} ({media_sources[k]})" for k, v in media_kwargs.items()))

    check_batch_split(config, mesh)
    layout = task.layout()
    spec = RowSpec.from_config(config, tokenizer, model_cfg, media_kwargs)  # evaluation's rows
    train_spec = task.row_spec(spec)
    assembly = task.assembly(train_spec)
    # MFU's peak, before the data loader's threads start: on a CPU it is a matmul timed on the same cores,
    # which the loader's prefetch would share (a run measured 117 GFLOP/s there, 219 on an idle host).
    peak, peak_source = peak_flops_per_device(config.train.peak_flops, dtype=dtype_of(config.model.dtype))
    dataset = build_dataset(train_set, train_spec, assembly, global_batch=config.data.global_batch,
                            seed=config.train.seed, shuffle=config.data.shuffle, repeat=True,
                            workers=config.data.workers, training=True, media_log_dir=workdir)
    batch_shapes = assembly.batch_shapes(train_spec, config.data.global_batch)
    iterator = iter(dataset)

    mgr = checkpoint.manager(workdir, max_to_keep=config.train.keep_checkpoints,
                             compress=bool(config.train.checkpoint_compression))
    # A checkpoint holds `layout.saved(state)`: the whole state, or a LoRA run's without its frozen base.
    restored = checkpoint.restore_intact(mgr, workdir, layout.saved_abstract_state(), iterator,
                                         compatibility_check(workdir, fingerprint, model_cfg, train_set.manifest, task),
                                         allow_fresh_start=bool(config.train.allow_fresh_start))
    if restored is not None:
        state = task.resumed_state(layout, restored[1], restored[0], restored[2])
        log.info("resumed from step %d", restored[0])
    else:
        checkpoint.save_tokenizer(workdir, tokenizer)
        checkpoint.save_source(workdir, config.model.init_from, tokenizer)  # what the export writes back
        params = task.initial_params(layout)
        opt_state = jax.jit(layout.tx.init, out_shardings=layout.state_shardings["opt_state"])(params)
        state = {"params": params, "opt_state": opt_state,
                 "step": jax.device_put(jnp.zeros((), jnp.int32), layout.replicated)}
    meta = {
        "schema_version": checkpoint.META_SCHEMA,
        "project_version": valen_jax.__version__,
        "model": model_cfg.to_json(),
        "media_kwargs": media_kwargs, "media_kwargs_sources": media_sources,
        "tokenizer": {"fingerprint": fingerprint, "source": str(config.data.tokenizer)},
        "shards": {"train": train_set.manifest.data},
        **({"data_references": references} if references else {}),
        **({"train_eval_overlap": overlap} if overlap else {}),
        "row": {"seq_len": spec.seq_len, "max_patches": spec.max_patches},
        "config": json.loads(config.to_json_best_effort()),
        "state_layout": checkpoint.state_layout(layout.saved_abstract_state()),
        **task.meta(),  # after the state: a LoRA run's records the base it holds
    }

    started = time.perf_counter()
    compiled = task.compile(layout, batch_shapes)
    train_step = task.step_function(compiled)
    log.info("compiled the train step in %.1fs", time.perf_counter() - started)
    _print_memory(compiled)
    flops_per_step = task.flops_per_step()
    log.info("MFU against %.3g FLOP/s per device × %d devices, from %s; %.3g model FLOPs per step",
             peak, jax.device_count(), peak_source, flops_per_step)
    # Built (eval data converted and checked) at start-up, when an evaluation falls within the run; a run
    # without eval data (data.eval=None) evaluates nothing, whatever its mode.
    evaluation = task.evaluation(layout, spec) if config.data.eval is not None else Evaluation()

    step = int(state["step"])
    note.started()  # from here the workdir holds this run's results: metrics, checkpoints, reports
    metrics_log = MetricsLog(workdir, start_step=step)
    preempted = Preempted()
    first_step = step
    losses = []
    window = _Window(step)
    bar = tqdm(total=config.train.steps, initial=step, desc="train", disable=jax.process_index() != 0,
               dynamic_ncols=True)
    finished = FinishedSteps(bar)  # the bar counts steps the device finished, one behind dispatch
    try:
        while step < config.train.steps:
            local = next(iterator)
            window.tokens += int(np.sum(local["segment_ids"] > 0)) * jax.process_count()
            batch = sharding.global_batch({k: local[k] for k in batch_shapes}, mesh)
            state, metrics = train_step(state, batch)
            step += 1
            finished.dispatched(metrics)
            evaluate_now = evaluation.periodic is not None and step % int(config.eval.every) == 0
            if (step % config.train.log_every == 0 or step == config.train.steps or step == first_step + 1
                    or evaluate_now):
                finished.flush()  # reading the metrics back waits for this step anyway
                values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                values.update(window.rates(step, config.data.global_batch * config.data.seq_len, flops_per_step,
                                           peak * jax.device_count()))
                values["examples_seen"] = step * config.data.global_batch
                if step == first_step + 1:  # allowed overlap (config.data.allow_overlap), once per run
                    values.update({f"overlap_{kind}": float(count) for kind, count in overlap.items()})
                if evaluate_now:
                    values.update(evaluation.periodic(state["params"]))
                losses.append((step, values["loss"]))
                metrics_log.write(step, values)
                if not math.isfinite(values["loss"]):
                    _stop_on_non_finite_loss(step, values["loss"], mgr, metrics_log)
                bar.set_postfix({k: f"{values[k]:.3f}" for k in ("loss", "accuracy") if k in values})
                window = _Window(step)  # after evaluation, so its time does not count as training
            if step % config.train.checkpoint_every == 0 or step == config.train.steps or preempted.requested:
                # Never a checkpoint of non-finite weights (reading the loss waits for the step, which the
                # save's copy off the devices does anyway).
                if not math.isfinite(loss := float(metrics["loss"])):
                    _stop_on_non_finite_loss(step, loss, mgr, metrics_log)
                checkpoint.save(mgr, step, layout.saved(state), iterator, meta, force=True)
            if preempted.requested:
                log.warning("%s: saved step %d, stopping", signal.Signals(preempted.signal).name, step)
                break
    finally:
        preempted.restore()  # the process's own handlers again, whatever ended the loop
    finished.flush()
    bar.close()
    mgr.wait_until_finished()
    metrics_log.close()
    result = {"workdir": str(workdir), "step": step, "checkpoint": str(checkpoint.checkpoint_dir(workdir) / str(step)),
              "losses": losses, "preempted": preempted.requested, "stop_signal": preempted.signal, **task.result()}
    if evaluation.at_end is not None and not preempted.requested:
        result["report"] = str(evaluation.at_end(state["params"], step))
    mgr.close()
    _log_evaluated(config, result)
    return result


def _log_evaluated(config, result: dict) -> None:
    """The log's last line says what the run evaluated (issue 54: no silent default eval set)."""
    data = config.data
    if data.eval is None:
        log.info("evaluated: nothing (config.data.eval=None)")
    elif "report" in result:
        log.info("evaluated: config.data.eval=%s (config.data.eval_format=%s) at step %d; report %s", data.eval,
                 data.eval_format, result["step"], result["report"])
    else:
        every = int(config.eval.every)
        log.info("evaluated: config.data.eval=%s (config.data.eval_format=%s) %s; no end-of-run report "
                 "(config.eval.at_end=%s)", data.eval, data.eval_format,
                 f"every {every} steps (eval_* in metrics.jsonl)" if every > 0 else "never (config.eval.every=0)",
                 config.eval.at_end)


def _print_memory(compiled) -> None:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    parts = [f"{f.replace('_size_in_bytes', '')}={getattr(analysis, f) / 2**20:.1f}MiB"
             for f in fields if hasattr(analysis, f)]
    log.info("train step memory per device: %s", " ".join(parts))


def _stop_on_non_finite_loss(step: int, loss: float, mgr, metrics_log: MetricsLog) -> None:
    """Stop without checkpointing `step`: the update that came with a non-finite loss has made the weights
    non-finite, so every later step would be too, and its checkpoints would push the last good ones out
    of `keep_checkpoints`. The saves already started finish first."""
    mgr.wait_until_finished()
    metrics_log.close()
    raise NonFiniteLoss(f"step {step}: the training loss is {loss}; stopped without checkpointing this step "
                        f"(latest checkpoint: step {mgr.latest_step()}). Lower config.train.learning_rate or "
                        "config.train.grad_clip_norm, or check the data, then resume from that checkpoint")


class _Window:
    """Throughput over the steps since the last log line."""

    def __init__(self, step: int):
        self.step, self.tokens, self.start = step, 0, time.perf_counter()

    def rates(self, step: int, slots_per_step: int, flops_per_step: float, peak_flops: float) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        steps = step - self.step
        return {"tokens_per_second": self.tokens / elapsed, "step_time_s": elapsed / steps,
                "mfu": flops_per_step * steps / elapsed / peak_flops,
                "padding_fraction": 1.0 - self.tokens / (steps * slots_per_step)}
