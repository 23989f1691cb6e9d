"""Train a model from a config; resumes from the workdir's latest intact checkpoint.

    python -m valen_jax.train --config=configs/vflash.py --workdir=runs/vflash-smoke
    python -m valen_jax.train --config=configs/vflash.py:tiny --workdir=/tmp/tiny --config.train.steps=4

The run converts its data into `WORKDIR/shards/` when needed, checkpoints asynchronously to
`WORKDIR/checkpoints/` (state, Grain iterator, meta) every `train.checkpoint_every` steps, at the
end and on SIGTERM, writes `metrics.jsonl` and TensorBoard events (loss per objective, learning
rate, gradient norm, tokens/s, MFU, examples seen, padding, and `eval_*` every `eval.every`
steps), and with `eval.at_end` writes `WORKDIR/eval/report-STEP.json`. Running the same command
again continues from the latest checkpoint at the same step and data position, after a SIGTERM
or a `kill -9` alike; a damaged latest checkpoint is reported and the one before it used.

Two training modes (seed 004's --training_mode, `config.train.mode`): `ar` trains the model itself;
`vflash` trains VFlash's block drafter (valen_jax/models/drafter.py) against the frozen target of an
`ar` workdir, restored from its latest checkpoint; the drafter's meta records that target (workdir,
step, sha256 of its params) and `metrics.jsonl` the drafter's loss, per-position accuracy and
expected acceptance length:
    python -m valen_jax.train --config=configs/vflash.py:tiny --workdir=/tmp/target
    python -m valen_jax.train --config=configs/vflash.py:tiny,drafter --workdir=/tmp/drafter \
        --config.model.target_from=/tmp/target
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags
from tqdm import tqdm

import valen_jax
from data_pipeline.cli_paths import PathError, check_path
from data_pipeline.shards import ShardError
from data_pipeline.tokenizer import TokenizerError, load_tokenizer
from valen_jax import checkpoint, cli_logging, distributed, evaluate, sharding, workdir_lock
from valen_jax.config_schema import ConfigError, check_batch_split, validate_config
from valen_jax.data.assemble import AssemblyError, RowSpec
from valen_jax.data.packing import PackingSpec
from valen_jax.data.pipeline import TokenAssembly, build_dataset, component_seed
from valen_jax.data.prepared_checks import check_prepared_run
from valen_jax.data.references import resolve_config_data
from valen_jax.data.separation import check_separation
from valen_jax.data.shard_cache import ensure_shards, summary
from valen_jax.data.sources import mixture_of, sampling_indices
from valen_jax.data.valen_fit import check_training_set
from valen_jax.data.valen_rows import ValenAssembly, is_valen
from valen_jax.data.vision_processor import media_kwargs_of
from valen_jax.evaluation.periodic import PeriodicEval
from valen_jax.evaluation.workdir import Restored
from valen_jax.metrics import MetricsLog, model_flops_per_step, peak_flops_per_device
from valen_jax.models.build import initial_params, model_config
from valen_jax.models.config import ModelConfig
from valen_jax.models.drafter import DrafterConfig, drafter_flops_per_step, init_drafter_params
from valen_jax.models.transformer import abstract_model
from valen_jax.progress import FinishedSteps
from valen_jax.step import DrafterOptions, StepOptions, TrainLayout, make_drafter_train_step, make_train_step

log = logging.getLogger("valen_jax.train")

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/vflash.py[:tiny]")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and reports")


class Preempted:
    """SIGTERM (preemption) asks the loop to checkpoint and stop at the next step boundary."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


def _print_memory(compiled) -> None:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    parts = [f"{f.replace('_size_in_bytes', '')}={getattr(analysis, f) / 2**20:.1f}MiB"
             for f in fields if hasattr(analysis, f)]
    log.info("train step memory per device: %s", " ".join(parts))


def _distinct_records(train_set, seed: int) -> int:
    """Records the training stream can hold, all components together: what overlong=skip counts to stop."""
    return sum(len(np.unique(sampling_indices(shard_set.manifest, component_seed(seed, k))))
               for k, (shard_set, _) in enumerate(mixture_of(train_set)))


@dataclasses.dataclass(frozen=True)
class Target:
    """A `vflash` run's frozen target: an `ar` workdir's latest params, and what identifies them."""

    model_cfg: ModelConfig
    graphdef: object
    params: object
    shardings: object
    media_kwargs: dict
    record: dict  # meta["drafter"]["target"]: workdir, step, params_sha256


def restore_target(config, fingerprint: dict, mesh) -> Target:
    """The target of `config.model.target_from`: an ar run of this tokenizer, its latest step, params verified."""
    workdir = Path(config.model.target_from).resolve()
    where = f"config.model.target_from={workdir}"
    if not checkpoint.checkpoint_dir(workdir).is_dir():
        raise checkpoint.CheckpointError(f"{where}: no {checkpoint.checkpoint_dir(workdir)}; train the ar target "
                                         "there first (train.mode=ar)")
    mgr = checkpoint.manager(workdir, read_only=True)
    try:
        step = checkpoint.select_step(mgr, workdir)
        meta = checkpoint.restore_meta(mgr, step)
        mode = meta["config"]["train"].get("mode", "ar")  # runs from before train.mode were ar runs
        if mode != "ar":
            raise checkpoint.CheckpointError(f"{where}: checkpoint {step} was trained with train.mode={mode}; "
                                             "a drafter's target must be an ar run")
        if meta["tokenizer"]["fingerprint"] != fingerprint:
            raise checkpoint.CheckpointError(
                f"{where}: the target was trained with tokenizer {meta['tokenizer']['fingerprint']}, this run's "
                f"config.data.tokenizer gives {fingerprint}; the drafter must share the target's vocabulary")
        model_cfg = ModelConfig.from_json(meta["model"])
        graphdef, abstract = abstract_model(model_cfg)
        shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
        params = checkpoint.restore_params_verified(
            mgr, step, meta, checkpoint.abstract_with(nnx.to_pure_dict(abstract), shardings))
    finally:
        mgr.close()
    record = {"workdir": str(workdir), "step": step, "params_sha256": checkpoint.params_sha256(params),
              "tokenizer": meta["tokenizer"]["fingerprint"]}
    log.info("target: %s step %d, params sha256 %s", workdir, step, record["params_sha256"])
    return Target(model_cfg, graphdef, params, shardings, meta["media_kwargs"], record)


def _compatibility_check(workdir: Path, fingerprint: dict, model_cfg: ModelConfig, train_manifest,
                         target: Target | None = None):
    """check_meta for restore_intact: a checkpoint of another setup is an error, never a fallback."""

    def check(step: int, saved: dict) -> None:
        if target is not None:
            # The target is its weights: the same params found in a moved or copied workdir are the same target.
            trained_against = saved.get("drafter", {}).get("target") or {}
            if trained_against.get("params_sha256") != target.record["params_sha256"]:
                raise checkpoint.CheckpointError(
                    f"{workdir}: checkpoint {step} is a drafter for target {trained_against}; "
                    f"config.model.target_from now gives {target.record} (other weights)")
            if trained_against["workdir"] != target.record["workdir"]:
                log.warning("%s: checkpoint %d was trained against the same target weights in %s; now read from %s",
                            workdir, step, trained_against["workdir"], target.record["workdir"])
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


def run(config, workdir: str | Path) -> dict:
    validate_config(config)
    workdir = Path(workdir).resolve()
    # Seed 003: registry references resolved (a resumed run: to the versions its checkpoint recorded)
    # before any device is claimed; an unknown one is refused here.
    references = resolve_config_data(config, workdir)
    check_prepared_run(config)  # seed 003: before any device is claimed (ensure_shards asks JAX for processes)
    workdir.mkdir(parents=True, exist_ok=True)
    # Before anything is written there: a second trainer on this workdir is refused (issue 19).
    with workdir_lock.exclusive(workdir):
        return _train(config, workdir, references)


def _train(config, workdir: Path, references: dict | None = None) -> dict:
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.template_family)
    fingerprint = checkpoint.fingerprint_of(tokenizer)
    vflash = config.train.mode == "vflash"
    mesh = sharding.make_mesh(config.mesh)
    target = restore_target(config, fingerprint, mesh) if vflash else None
    model_cfg = target.model_cfg if vflash else model_config(config, tokenizer)
    if vflash:
        log.info("train.mode=vflash: the target's architecture comes from its checkpoint meta; config.model's "
                 "dims, dtype and remat are not read (the drafter's width and heads are the target's)")
    # Seed 000: unset media_kwargs come from the base model's processor files (smoke defaults from scratch).
    media_kwargs, media_sources = media_kwargs_of(config, model_cfg.vision)
    if vflash and json.loads(json.dumps(media_kwargs)) != target.media_kwargs:  # as JSON: tuples are lists there
        # The drafter reads the target's features of the images: they must be processed as the target saw them.
        raise ConfigError(f"config.media_kwargs give {media_kwargs}; the target in config.model.target_from was "
                          f"trained with {target.media_kwargs}")
    log.info("media_kwargs: %s", ", ".join(f"{k}={v} ({media_sources[k]})" for k, v in media_kwargs.items()))
    train_set = ensure_shards(config.data.format, config.data.train, workdir / "shards",
                              config.data.tokenizer, fingerprint, config.data.train_options.to_dict())
    log.info("train shards: %s", summary(train_set))
    # Seed 003: train and eval kept apart, checked on the shards before the step compiles. The eval
    # shards land where evaluation during and after training reads them (WORKDIR/eval_shards).
    eval_set = ensure_shards(config.data.eval_format, config.data.eval, workdir / "eval_shards",
                             config.data.tokenizer, fingerprint, config.data.eval_options.to_dict())
    overlap = check_separation(train_set, eval_set, allow_overlap=bool(config.data.allow_overlap),
                               train_name=str(config.data.train), eval_name=str(config.data.eval))

    check_batch_split(config, mesh)
    drafter_cfg = None
    if vflash:
        try:
            drafter_cfg = DrafterConfig.of(config.model.drafter, model_cfg)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        layout = TrainLayout.for_drafter(drafter_cfg, config.train, mesh)
    else:
        layout = TrainLayout.from_config(model_cfg, config.train, mesh)
    spec = RowSpec.from_config(config, tokenizer, model_cfg, media_kwargs)
    # The drafter's rows also mark the primitive blocks (`draft_block`); evaluation rows stay as they are.
    train_spec = dataclasses.replace(spec, draft_blocks=True) if vflash else spec
    unlabeled = None  # Valen: training records without a labeled question, dropped and reported (seed 000)
    if vflash and is_valen(train_set):
        raise ConfigError("config.train.mode=vflash trains on token data with primitive blocks (seed 004); "
                          f"config.data.format={config.data.format!r} has none")
    if is_valen(train_set):
        assembly = ValenAssembly.from_config(config, training=True)
        # Every record against the row limits once, before the step compiles: one report, not one stop per limit.
        unlabeled = check_training_set(train_set, spec, assembly.qspec, assembly.overlong).unlabeled
    else:
        assembly = TokenAssembly(dataclasses.replace(PackingSpec.from_config(config),
                                                     records=_distinct_records(train_set, config.train.seed)))
    dataset = build_dataset(train_set, train_spec, assembly, global_batch=config.data.global_batch,
                            seed=config.train.seed, shuffle=config.data.shuffle, repeat=True,
                            workers=config.data.workers, training=True, media_log_dir=workdir)
    batch_shapes = assembly.batch_shapes(train_spec, config.data.global_batch)
    iterator = iter(dataset)

    meta = {
        "project_version": valen_jax.__version__,
        "model": model_cfg.to_json(),
        "media_kwargs": media_kwargs, "media_kwargs_sources": media_sources,
        "tokenizer": {"fingerprint": fingerprint, "source": str(config.data.tokenizer)},
        "shards": {"train": train_set.manifest.data},
        **({"data_references": references} if references else {}),
        **({"train_eval_overlap": overlap} if overlap else {}),
        **({"records_without_labels": unlabeled} if unlabeled is not None else {}),
        "row": {"seq_len": spec.seq_len, "max_patches": spec.max_patches},
        "config": json.loads(config.to_json_best_effort()),
        "state_layout": checkpoint.state_layout(layout.abstract_state()),
        # vflash: `model` is the target's architecture; the state holds the drafter, trained against `target`.
        **({"drafter": {"config": drafter_cfg.to_json(), "target": target.record}} if vflash else {}),
    }
    mgr = checkpoint.manager(workdir, max_to_keep=config.train.keep_checkpoints,
                             compress=bool(config.train.checkpoint_compression))
    restored = checkpoint.restore_intact(mgr, workdir, layout.abstract_state(), iterator,
                                         _compatibility_check(workdir, fingerprint, model_cfg, train_set.manifest,
                                                              target),
                                         allow_fresh_start=bool(config.train.allow_fresh_start))
    if restored is not None:
        state = restored[1]
        log.info("resumed from step %d", restored[0])
    else:
        checkpoint.save_tokenizer(workdir, tokenizer)
        if vflash:
            params = init_drafter_params(drafter_cfg, config.train.seed, layout.param_shardings)
        else:
            params = initial_params(config, model_cfg, tokenizer, layout.param_shardings)
        opt_state = jax.jit(layout.tx.init, out_shardings=layout.state_shardings["opt_state"])(params)
        state = {"params": params, "opt_state": opt_state,
                 "step": jax.device_put(jnp.zeros((), jnp.int32), layout.replicated)}

    batch_shardings = layout.batch_shardings(batch_shapes)
    started = time.perf_counter()
    if vflash:
        # The target's params are an argument, never donated: its arrays are read, never written.
        step_fn = jax.jit(make_drafter_train_step(layout.graphdef, target.graphdef, layout.tx, layout.schedule,
                                                  DrafterOptions.from_config(config)),
                          in_shardings=(layout.state_shardings, batch_shardings, target.shardings),
                          out_shardings=(layout.state_shardings, layout.replicated), donate_argnums=(0,))
        with jax.set_mesh(mesh):
            compiled_drafter = step_fn.lower(layout.abstract_state(), batch_shapes,
                                             checkpoint.abstract_with(target.params, target.shardings)).compile()
        compiled = compiled_drafter

        def train_step(state, batch):
            return compiled_drafter(state, batch, target.params)
    else:
        options = StepOptions.from_config(config, layout.frozen)
        step_fn = jax.jit(make_train_step(layout.graphdef, layout.tx, layout.schedule, options),
                          in_shardings=(layout.state_shardings, batch_shardings),
                          out_shardings=(layout.state_shardings, layout.replicated), donate_argnums=(0,))
        with jax.set_mesh(mesh):
            compiled = step_fn.lower(layout.abstract_state(), batch_shapes).compile()
        train_step = compiled
    log.info("compiled the train step in %.1fs", time.perf_counter() - started)
    _print_memory(compiled)

    peak, peak_source = peak_flops_per_device(config.train.peak_flops)
    if vflash:
        flops_per_step = drafter_flops_per_step(drafter_cfg, model_cfg, config.data.global_batch, config.data.seq_len,
                                                int(config.model.drafter.anchors_per_row))
    else:
        flops_per_step = model_flops_per_step(model_cfg, config.data.global_batch, config.data.seq_len)
    log.info("MFU against %.3g FLOP/s per device × %d devices, from %s; %.3g model FLOPs per step",
             peak, jax.device_count(), peak_source, flops_per_step)
    # Built (eval data converted and checked) at start-up, when an evaluation falls within the run.
    # The run in the shape evaluate restores a workdir to; each evaluation fills in the params of the moment.
    # (vflash evaluates nothing yet: config_schema refuses eval.every and eval.at_end there.)
    own = None if vflash else Restored(workdir, None, config, model_cfg, tokenizer, fingerprint, spec, mesh,
                                       layout.graphdef, None)
    evaluator = PeriodicEval(own) if own is not None and 0 < int(config.eval.every) <= int(config.train.steps) else None

    step = int(state["step"])
    metrics_log = MetricsLog(workdir, start_step=step)
    preempted = Preempted()
    first_step = step
    losses = []
    window = _Window(step)
    bar = tqdm(total=config.train.steps, initial=step, desc="train", disable=jax.process_index() != 0,
               dynamic_ncols=True)
    finished = FinishedSteps(bar)  # the bar counts steps the device finished, one behind dispatch
    while step < config.train.steps:
        local = next(iterator)
        window.tokens += int(np.sum(local["segment_ids"] > 0)) * jax.process_count()
        batch = sharding.global_batch({k: local[k] for k in batch_shapes}, mesh)
        state, metrics = train_step(state, batch)
        step += 1
        finished.dispatched(metrics)
        evaluate_now = evaluator is not None and step % int(config.eval.every) == 0
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
                values.update(evaluator(state["params"]))
            losses.append((step, values["loss"]))
            metrics_log.write(step, values)
            if not math.isfinite(values["loss"]):
                _stop_on_non_finite_loss(step, values["loss"], mgr, metrics_log)
            bar.set_postfix(loss=f"{values['loss']:.3f}", acc=f"{values['accuracy']:.3f}")
            window = _Window(step)  # after evaluation, so its time does not count as training
        if step % config.train.checkpoint_every == 0 or step == config.train.steps or preempted.requested:
            # Never a checkpoint of non-finite weights (reading the loss waits for the step, which the
            # save's copy off the devices does anyway).
            if not math.isfinite(loss := float(metrics["loss"])):
                _stop_on_non_finite_loss(step, loss, mgr, metrics_log)
            checkpoint.save(mgr, step, state, iterator, meta, force=True)
        if preempted.requested:
            log.warning("SIGTERM: saved step %d, stopping", step)
            break
    finished.flush()
    bar.close()
    mgr.wait_until_finished()
    metrics_log.close()
    result = {"workdir": str(workdir), "step": step, "checkpoint": str(checkpoint.checkpoint_dir(workdir) / str(step)),
              "losses": losses, "preempted": preempted.requested}
    if unlabeled is not None:
        result["records_without_labels"] = unlabeled
    if own is not None and config.eval.at_end and not preempted.requested:
        report_path = workdir / "eval" / f"report-{step}.json"
        with jax.set_mesh(mesh):
            report = evaluate.evaluate_params(dataclasses.replace(own, step=step, params=state["params"]),
                                              config.data.eval)
        evaluate.write_report(report, report_path)
        result["report"] = str(report_path)
    mgr.close()
    return result


class NonFiniteLoss(RuntimeError):
    """The training loss went NaN or infinite: the run stops instead of training on (issue 19)."""


# Errors about the run's input (config, paths, tokenizer, workdir, data) or its divergence, printed as
# one line by `main`; anything else keeps its traceback.
USER_ERRORS = (ConfigError, PathError, TokenizerError, ShardError, AssemblyError, checkpoint.CheckpointError,
               workdir_lock.WorkdirBusy, NonFiniteLoss)


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


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli_logging.configure(timestamps=True)
    if _WORKDIR.value is None:
        raise app.UsageError("--workdir is required")
    try:
        # Checked before the config file is read (a newline there would only surface in a page of loader errors).
        check_path("--workdir", _WORKDIR.value)
        check_path("--config", config_flags.get_config_filename(flags.FLAGS["config"]))
        distributed.initialize()  # before any JAX backend use; a single-process run is left as it is
        result = run(_CONFIG.value, _WORKDIR.value)
    except USER_ERRORS as error:
        # The user's to fix and said in full by the message: one line, not a traceback burying it.
        sys.exit(f"{type(error).__name__}: {error}")
    if result["losses"]:
        print(f"loss: first logged {result['losses'][0][1]:.4f} (step {result['losses'][0][0]}), "
              f"last {result['losses'][-1][1]:.4f} (step {result['losses'][-1][0]})")
    if "records_without_labels" in result:
        print(f"records without labels (never trained on, media not read): {result['records_without_labels']}")
    print(f"checkpoint: {result['checkpoint']}")
    if "report" in result:
        print(f"evaluation report: {result['report']}")
    sys.stdout.flush()


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
