"""Ahead-of-time compile for a TPU slice from any host: the train step of a config, compiled for
compile-only TPU devices (`jax.experimental.topologies`, needs `libtpu`), with what the executable says
about itself (memory per chip, FLOPs, collectives, Pallas kernels). `python -m valen_jax.compile` is the
command; this is its library.

Slice names (`--topology`) are the Cloud TPU names, mapped as MaxText's `accelerator_to_spec_map` does:
the number after the generation counts TensorCores for v4 and v5p (two per chip, one megacore device)
and chips for v5e and v6e (one core each). A `gen:AxB[xC]` name is a topology as libtpu spells it.

    name       topology_name   chips  hosts of        HBM/chip
    v5e-N      v5e:AxB         N      2x2x1 chips     16 GiB
    v6e-N      v6e:AxB         N      2x2x1 chips     32 GiB
    v5p-N      v5p:AxBxC       N/2    2x2x1 chips     95 GiB
    v4-N       v4:AxBxC        N/2    2x2x1 chips     32 GiB

Per chip (the `CHIPS` table): HBM, peak bf16 FLOP/s and HBM bandwidth, from each generation's Cloud TPU
page (the "system architecture" tables): v4 https://cloud.google.com/tpu/docs/v4 (32 GiB, 275 TFLOP/s,
1,200 GB/s), v5e https://cloud.google.com/tpu/docs/v5e (16 GiB, 197 TFLOP/s, 819 GB/s), v5p
https://cloud.google.com/tpu/docs/v5p (95 GiB, 459 TFLOP/s, 2,765 GB/s), v6e Trillium
https://cloud.google.com/tpu/docs/v6e (32 GiB, 918 TFLOP/s, 1,640 GB/s).

Programs: the train step of the config's mode (`train.mode=ar`: token LM or Valen scoring, VL rows with
their patches when the model has a tower; `vflash`: the drafter step against an abstract target), then
the evaluation forward and the decoding programs (`aot_programs`). Per program: memory per chip, XLA's
FLOPs and bytes, the loop-aware FLOPs and bytes and the collectives census of its HLO (`aot_hlo`), a
roofline step time max(FLOPs / peak, bytes / bandwidth) and, for the train step, the MFU bound
(model FLOPs / peak) / roofline time.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import time
from pathlib import Path

import jax

from data_pipeline.tokenizer import load_tokenizer
from valen_jax.config.schema import check_batch_split, validate_config
from valen_jax.data.assemble import RowSpec
from valen_jax.data.packing import PackingSpec
from valen_jax.data.pipeline import TokenAssembly
from valen_jax.data.valen_rows import ValenAssembly
from valen_jax.data.vision_processor import media_kwargs_of
from valen_jax.errors import ConfigError
from valen_jax.models import attention, sharding
from valen_jax.models.build import model_config
from valen_jax.models.config import ModelConfig
from valen_jax.run import ModelRun
from valen_jax.tasks import aot_hlo, aot_programs
from valen_jax.tasks.reinforce import MODE as MODE_REINFORCE
from valen_jax.tasks.reinforce import ReinforceTask
from valen_jax.tasks.token_lm import TokenLMTask
from valen_jax.tasks.valen import ValenTask
from valen_jax.training import checkpoint, mesh_choice
from valen_jax.training.metrics import attention_flops_per_step, model_flops_per_step
from valen_jax.training.step import TrainLayout
from valen_jax.training.task import Setup
from valen_jax.vflash.task import DrafterTask

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
    hbm_bytes: int
    peak_bf16_flops: float  # per second, dense
    hbm_bytes_per_second: float


# Per chip, by generation (sources: the module docstring). A v4/v5p chip is one megacore device.
CHIPS = {"v4": Chip(32 * GIB, 275e12, 1200e9), "v5e": Chip(16 * GIB, 197e12, 819e9),
         "v5p": Chip(95 * GIB, 459e12, 2765e9), "v6e": Chip(32 * GIB, 918e12, 1640e9)}
HBM_PER_CHIP = {generation: chip.hbm_bytes for generation, chip in CHIPS.items()}
COLLECTIVES = aot_hlo.COLLECTIVES
REINFORCE_PROGRAMS = ("rollout", "first_update")  # train.mode=reinforce's only (`aot_programs`)
PROGRAMS = ("train_step", "eval_forward", "generate", "spec_answer", *REINFORCE_PROGRAMS)
# Generations whose slice name counts TensorCores (two per chip, one megacore device each).
_CORES_IN_NAME = {"v4", "v5p"}
_CHIP_CONFIG = {"v4": "megacore", "v5p": "megacore", "v5e": "default", "v6e": "default"}
# Chip grids of the slice shapes Cloud TPU offers: 2-D (v5e, v6e) and 3-D (v4, v5p) tori.
_GRID_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_GRID_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
            256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)}


class LibtpuMissing(RuntimeError):
    """No `libtpu` on this host: TPU programs cannot be compiled here."""


class DoesNotFit(RuntimeError):
    """A compiled program needs more HBM per chip than the slice's chips have."""


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str  # as given
    generation: str
    topology_name: str  # libtpu's, e.g. "v5e:2x2"
    chips_per_host_bounds: tuple[int, int, int]
    chip_config: str
    slices: int = 1

    @property
    def chip(self) -> Chip:
        return CHIPS[self.generation]

    @property
    def hbm_bytes(self) -> int:
        return self.chip.hbm_bytes


def parse_slice(name: str, slices: int = 1) -> Slice:
    """`v5e-8`, `v5p-64`, `v6e-16`, `v4-8` (Cloud TPU names) or `v5e:2x2` (libtpu's) → a Slice."""
    if slices < 1:
        raise ConfigError(f"--slices={slices} must be ≥ 1")
    known = ", ".join(sorted(HBM_PER_CHIP))
    if ":" in name:
        generation, shape = name.split(":", 1)
        try:
            grid = tuple(int(x) for x in shape.split("x"))
        except ValueError:
            raise ConfigError(f"--topology={name!r}: the shape after ':' is AxB or AxBxC") from None
    else:
        generation, _, count = name.partition("-")
        if not count.isdigit():
            raise ConfigError(f"--topology={name!r}: expected e.g. v5e-8, v5p-64, v6e-16 or v5e:2x2")
        chips = int(count) // 2 if generation in _CORES_IN_NAME else int(count)
        table = _GRID_3D if generation in _CORES_IN_NAME else _GRID_2D
        if generation in HBM_PER_CHIP and chips not in table:
            raise ConfigError(f"--topology={name!r}: no {generation} slice of {chips} chips; sizes: "
                              + ", ".join(f"{generation}-{c * 2 if generation in _CORES_IN_NAME else c}"
                                          for c in table))
        grid = table.get(chips, ())
        shape = "x".join(str(x) for x in grid)
    if generation not in HBM_PER_CHIP:
        raise ConfigError(f"--topology={name!r}: unknown TPU generation {generation!r}; known: {known}")
    bounds = tuple(min(g, b) for g, b in zip((*grid, 1, 1)[:3], (2, 2, 1), strict=True))
    return Slice(name, generation, f"{generation}:{shape}", bounds, _CHIP_CONFIG[generation], slices)


def topology_devices(target: Slice) -> list:
    """Compile-only devices of the slice (no chip is claimed; nothing can run on them)."""
    if importlib.util.find_spec("libtpu") is None:
        raise LibtpuMissing("libtpu is not installed, so TPU programs cannot be compiled on this host: "
                            "pip install 'valen-jax[tpu]' (the libtpu that jax[tpu] pins for the installed jax)")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology_name,
                                            chip_config_name=target.chip_config,
                                            chips_per_host_bounds=target.chips_per_host_bounds,
                                            num_slices=target.slices)
    return list(topology.devices)


def open_compile_task(config, mesh):
    """The config's task, its batch shapes, the model's layout (for the programs besides the train step),
    the assembly and the row spec, all without training data or weights.

    `tasks.modes.open_task` needs the converted shards (the token task counts distinct records for
    overlong=skip, the Valen task picks its kind from the shards and checks every record against the
    row limits) and, for `vflash`, the target's checkpoint; none of that changes a shape, so the task is
    constructed here directly, from the config's data format, with a `vflash` target whose parameters are
    abstract (the config's model is the target's architecture, as `model.init_from` or the model keys say)."""
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.template_family)
    if config.train.mode == "vflash":
        model_cfg = target_model(config)
    else:
        model_cfg = model_config(config, tokenizer)
    media_kwargs, _ = media_kwargs_of(config, model_cfg.vision)
    eval_spec = RowSpec.from_config(config, tokenizer, model_cfg, media_kwargs)
    setup = Setup(config, None, tokenizer, {}, mesh)
    model_layout = TrainLayout.from_config(model_cfg, config.train, mesh)
    if config.train.mode == "vflash":
        # The target's run handle with abstract params: its shapes and shardings, no weights read.
        params = checkpoint.abstract_with(model_layout.param_shapes, model_layout.param_shardings)
        target = ModelRun(Path(config.model.target_from), None, config, model_cfg, tokenizer, {}, eval_spec, mesh,
                          model_layout.graphdef, params)
        task = DrafterTask(setup, target, None)
    elif config.train.mode == "ar":
        task = (ValenTask if config.data.format == "valen" else TokenLMTask)(setup, model_cfg, None)
    elif config.train.mode == MODE_REINFORCE:
        # The policy's architecture is the config's (an rl.from_workdir start has the same shapes as its config).
        task = ReinforceTask(setup, model_cfg, None, None)
    else:
        raise ConfigError(f"config.train.mode={config.train.mode!r}: the ahead-of-time compile knows ar, vflash "
                          f"and {MODE_REINFORCE}")
    spec = task.row_spec(eval_spec)
    valen = config.data.format == "valen"
    assembly = (ValenAssembly.from_config(config, training=True) if valen
                else TokenAssembly(PackingSpec.from_config(config)))
    # A reinforcement step's batch is its rollout's rows, not the data stream's prompts.
    batch_shapes = (task.rollout_shapes() if config.train.mode == MODE_REINFORCE
                    else assembly.batch_shapes(spec, int(config.data.global_batch)))
    return task, batch_shapes, model_layout, assembly, eval_spec


def target_model(config) -> ModelConfig:
    """A `vflash` run's target architecture: its `model.target_from` workdir's latest checkpoint meta (JSON,
    as `vflash.task.restore_target` reads it; no weights)."""
    return mesh_choice.checkpoint_model(config.model.target_from)


def _buffers_of(error: str, count: int = 6) -> str:
    """The TPU compiler's own list of the largest allocations from its out-of-memory report, shortened."""
    lines = [line.strip() for line in error.splitlines()]
    picked = []
    for i, line in enumerate(lines):
        if line.startswith("Size:"):
            what = next((x for x in lines[i + 1:i + 4] if x.startswith("Shape:") or x.startswith("Operator:")), "")
            picked.append(f"{line.removeprefix('Size: ')} {what}")
    return "; ".join(picked[:count])


def program_report(name: str, compiled, seconds: float, target: Slice, model_flops: float | None,
                   chips: int, kernel_flops: float = 0.0) -> dict:
    """Memory per chip, XLA's cost, the loop-aware HLO figures and census, the roofline (module docstring).

    `kernel_flops`: the program's attention FLOPs (all chips), added to the HLO's count when its attention
    is a Pallas kernel, whose custom call XLA counts as nothing (remat's recompute of it is still left out,
    so the bound is a little optimistic with remat=full)."""
    memory = compiled.memory_analysis()
    sizes = {key: int(getattr(memory, f"{key}_size_in_bytes")) for key in ("argument", "output", "temp", "alias")}
    # Donated state is both argument and output: alias bytes are counted once (as MaxText sums them).
    total = sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    text = compiled.as_text()
    hlo = aot_hlo.analyse(text)
    chip = target.chip
    pallas = "tpu_custom_call" in text
    # The model's own count per chip is a floor on the compute side.
    flops = max(hlo.flops + (kernel_flops / chips if pallas else 0.0), (model_flops or 0.0) / chips)
    roofline = max(flops / chip.peak_bf16_flops, hlo.bytes_accessed / chip.hbm_bytes_per_second)
    return {
        "program": name,
        "gib_per_chip": {**{key: value / GIB for key, value in sizes.items()}, "total": total / GIB},
        "hbm_gib_per_chip": target.hbm_bytes / GIB,
        "fits": total <= target.hbm_bytes,
        "spare_fraction": 1.0 - total / target.hbm_bytes,
        "xla_flops": float(cost.get("flops", 0.0)),
        "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "hlo_flops": hlo.flops,
        "hlo_bytes_accessed": hlo.bytes_accessed,
        "loops": hlo.loops,
        "roofline_seconds": roofline,
        "bound_by": "compute" if flops / chip.peak_bf16_flops >= hlo.bytes_accessed / chip.hbm_bytes_per_second
        else "memory",
        "model_flops": model_flops,
        "mfu_bound": (model_flops / chips / chip.peak_bf16_flops) / roofline if model_flops and roofline else None,
        "collectives": hlo.collectives,
        "largest_all_gather_gib": hlo.largest_all_gather_bytes / GIB,
        "largest_values": hlo.largest_values,
        # Pallas kernels lower to Mosaic custom calls on TPU (splash attention among them).
        "pallas_mosaic": pallas,
        "compile_seconds": seconds,
    }


def _layer_param_bytes(layout) -> float:
    """Bytes of one decoder layer's weights (the scanned stack's leaves divided by their layer count)."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(layout.param_shapes)[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        if "layers" in keys and leaf.ndim >= 2:
            total += math.prod(leaf.shape[1:]) * leaf.dtype.itemsize
    return total


def compile_for(config, target: Slice, only: tuple[str, ...] | None = None) -> dict:
    """The report of compiling `config`'s programs for `target` (`only`: the names to compile, the train
    step `train_step`; all by default): the slice, the mesh, the attention chosen, and per program its
    memory, cost, roofline and collectives (see `program_report`)."""
    validate_config(config)
    devices = topology_devices(target)
    # The mesh `train` would build on the slice: the unset mesh keys chosen by the slice's HBM, not the host's.
    mesh = mesh_choice.training_mesh(
        config, lambda: mesh_choice.trained_model(config, load_tokenizer(config.data.tokenizer,
                                                                         config.data.template_family)),
        devices, device_bytes=target.hbm_bytes)
    check_batch_split(config, mesh)
    task, batch_shapes, model_layout, assembly, eval_spec = open_compile_task(config, mesh)
    layout = task.layout()
    with jax.set_mesh(mesh):
        chosen = attention.resolve(str(config.model.attention), int(config.data.seq_len))
    rows = aot_programs.decode_batch(config, mesh)
    seq_len, train_rows = int(config.data.seq_len), int(config.data.global_batch)
    eval_flops = model_flops_per_step(task.model_cfg, rows, seq_len) / 3  # forward: a third
    steps = [("train_step", lambda: task.compile(layout, batch_shapes), float(task.flops_per_step()),
              attention_flops_per_step(task.model_cfg, train_rows, seq_len) if config.train.mode == "ar" else 0.0)]
    steps += [(name, thunk, eval_flops, attention_flops_per_step(task.model_cfg, rows, seq_len) / 3)
              if name == "eval_forward" else (name, thunk, None, 0.0)
              for name, thunk in aot_programs.programs(config, task, model_layout, assembly, eval_spec)]
    missing = sorted(set(only or ()) - {name for name, *_ in steps})
    if missing:
        raise ConfigError(f"--programs: train.mode={config.train.mode} has no {', '.join(missing)} "
                          f"({' and '.join(REINFORCE_PROGRAMS)} are train.mode=reinforce's)")
    programs = []
    for name, thunk, flops, kernel_flops in steps:
        if only is not None and name not in only:
            continue
        start = time.perf_counter()
        try:
            compiled = thunk()
        except jax.errors.JaxRuntimeError as error:
            # The TPU compiler itself refuses a program whose buffers exceed the chip's HBM.
            if not mesh_choice.is_out_of_memory(error):
                raise
            detail = str(error).strip().splitlines()[0]
            raise DoesNotFit(f"{name} does not fit {target.name} ({devices[0].device_kind}, "
                             f"{target.hbm_bytes / GIB:.0f} GiB HBM per chip): {detail}; largest allocations: "
                             f"{_buffers_of(str(error)) or 'none listed by the compiler'}; "
                             f"{sharding.memory_advice(dict(mesh.shape), mesh.size)}") from None
        programs.append(program_report(name, compiled, time.perf_counter() - start, target, flops, len(devices),
                                       kernel_flops))
    return {
        "topology": {"name": target.name, "topology_name": target.topology_name, "slices": target.slices,
                     "chips": len(devices), "device_kind": devices[0].device_kind,
                     "chip": dataclasses.asdict(target.chip)},
        "mesh": dict(mesh.shape),
        "mode": str(config.train.mode),
        "attention": {"asked": str(config.model.attention), "chosen": chosen},
        "model": {"dim": task.model_cfg.dim, "num_layers": task.model_cfg.num_layers,
                  "vocab_size": task.model_cfg.vocab_size, "vision": task.model_cfg.vision is not None,
                  "params": int(sum(math.prod(x.shape) for x in jax.tree.leaves(model_layout.param_shapes))),
                  "layer_param_gib": _layer_param_bytes(model_layout) / GIB},
        "batch": {key: list(value.shape) for key, value in batch_shapes.items()},
        "decode_batch": rows,
        # The model's own count (6·N·tokens + attention, all chips) is the MFU numerator.
        "model_flops_per_step": float(task.flops_per_step()),
        "programs": programs,
    }


def check_fits(report: dict) -> None:
    """DoesNotFit naming the first program over the chip's HBM, its shortfall and its largest buffers."""
    for program in report["programs"]:
        if not program["fits"]:
            g, have = program["gib_per_chip"], program["hbm_gib_per_chip"]
            largest = ", ".join(f"{v['name']} {v['shape']} {v['gib']:.2f} GiB" for v in program["largest_values"][:3])
            raise DoesNotFit(f"{program['program']} needs {g['total']:.2f} GiB per chip on {report['topology']['name']} "
                             f"({report['topology']['device_kind']}), which has {have:.0f} GiB HBM per chip: "
                             f"{g['total'] - have:.2f} GiB short (temp {g['temp']:.2f} GiB, arguments "
                             f"{g['argument']:.2f} GiB); largest values: {largest}; "
                             f"{sharding.memory_advice(report['mesh'], report['topology']['chips'])}")


def census_summary(program: dict) -> str:
    """`all-gather=12/3.1GiB(in 10)`: per collective present, its count, bytes per step and how many are in loops."""
    parts = []
    for name, c in program["collectives"].items():
        if c["count"]:
            parts.append(f"{name}={c['count']}/{c['bytes'] / GIB:.2f}GiB(in-loop {c['inside_loops']['count']})")
    return " ".join(parts) or "none"


def summary_line(program: dict) -> str:
    g = program["gib_per_chip"]
    mfu = f" mfu_bound={program['mfu_bound']:.3f}" if program["mfu_bound"] is not None else ""
    return (f"{program['program']}: fits={program['fits']} total={g['total']:.3f}/{program['hbm_gib_per_chip']:.0f} GiB "
            f"per chip (argument={g['argument']:.3f} output={g['output']:.3f} temp={g['temp']:.3f} "
            f"alias={g['alias']:.3f}) xla_flops={program['xla_flops']:.3e} hlo_flops={program['hlo_flops']:.3e} "
            f"hlo_bytes={program['hlo_bytes_accessed']:.3e} roofline_ms={program['roofline_seconds'] * 1e3:.2f} "
            f"({program['bound_by']}){mfu} {census_summary(program)} pallas_mosaic={program['pallas_mosaic']} "
            f"compile_s={program['compile_seconds']:.1f}")


def last_line(report: dict) -> str:
    """The command's last line: every program fits, the train step's MFU bound, the largest temp per chip."""
    programs = report["programs"]
    train = next((p for p in programs if p["program"] == "train_step"), None)
    worst = max(programs, key=lambda p: p["gib_per_chip"]["temp"])
    mfu = f"{train['mfu_bound']:.3f}" if train and train["mfu_bound"] is not None else "n/a"
    return (f"fits={all(p['fits'] for p in programs)} mfu_bound={mfu} "
            f"temp_gib_per_chip={worst['gib_per_chip']['temp']:.3f} ({worst['program']}) "
            f"attention={report['attention']['chosen']} topology={report['topology']['name']}")
