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

HBM per chip: Cloud TPU system architecture pages (v4: 32 GiB, v5e: 16 GiB, v5p: 95 GiB, v6e
Trillium: 32 GiB), https://cloud.google.com/tpu/docs/system-architecture-tpu-vm.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import time

import jax

from data_pipeline.tokenizer import load_tokenizer
from valen_jax.config.schema import check_batch_split, validate_config
from valen_jax.data.assemble import RowSpec
from valen_jax.data.packing import PackingSpec
from valen_jax.data.pipeline import TokenAssembly
from valen_jax.data.valen_rows import ValenAssembly
from valen_jax.data.vision_processor import media_kwargs_of
from valen_jax.errors import ConfigError
from valen_jax.models import sharding
from valen_jax.models.build import model_config
from valen_jax.tasks.token_lm import TokenLMTask
from valen_jax.tasks.valen import ValenTask
from valen_jax.training.task import Setup

GIB = 1024 ** 3
# HBM per chip in bytes, by generation (sources: the module docstring).
HBM_PER_CHIP = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB}
# Generations whose slice name counts TensorCores (two per chip, one megacore device each).
_CORES_IN_NAME = {"v4", "v5p"}
_CHIP_CONFIG = {"v4": "megacore", "v5p": "megacore", "v5e": "default", "v6e": "default"}
# Chip grids of the slice shapes Cloud TPU offers: 2-D (v5e, v6e) and 3-D (v4, v5p) tori.
_GRID_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_GRID_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
            256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# An HLO instruction's opcode (sync or async start), never its `%name` or an `-done`.
_OPCODE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


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
    def hbm_bytes(self) -> int:
        return HBM_PER_CHIP[self.generation]


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
                            "pip install 'valen-jax[tpu]' (libtpu==0.0.42.*, the pin of jax[tpu]==0.10.2)")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology_name,
                                            chip_config_name=target.chip_config,
                                            chips_per_host_bounds=target.chips_per_host_bounds,
                                            num_slices=target.slices)
    return list(topology.devices)


def open_compile_task(config, mesh):
    """The config's model task and its batch shapes, without its training data.

    `tasks.modes.open_task` needs the converted shards (the token task counts distinct records for
    overlong=skip, the Valen task picks its kind from the shards and checks every record against the
    row limits); none of that changes a shape, so the task is constructed here directly, from the
    config's data format, and its assembly likewise (TokenAssembly's and ValenAssembly's batch shapes
    depend on the row spec and the config alone)."""
    if config.train.mode != "ar":
        raise ConfigError(f"config.train.mode={config.train.mode!r}: the ahead-of-time compile covers the model's "
                          "own train step (train.mode=ar) so far; the VFlash drafter step is not compiled yet")
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.template_family)
    model_cfg = model_config(config, tokenizer)
    media_kwargs, _ = media_kwargs_of(config, model_cfg.vision)
    valen = config.data.format == "valen"
    kind = ValenTask if valen else TokenLMTask
    task = kind(Setup(config, None, tokenizer, {}, mesh), model_cfg, None)
    spec = task.row_spec(RowSpec.from_config(config, tokenizer, model_cfg, media_kwargs))
    assembly = (ValenAssembly.from_config(config, training=True) if valen
                else TokenAssembly(PackingSpec.from_config(config)))
    return task, assembly.batch_shapes(spec, int(config.data.global_batch))


def collective_counts(hlo_text: str) -> dict[str, int]:
    counts = dict.fromkeys(COLLECTIVES, 0)
    for opcode in _OPCODE.findall(hlo_text):
        counts[opcode] += 1
    return counts


def program_report(name: str, compiled, seconds: float, target: Slice) -> dict:
    memory = compiled.memory_analysis()
    sizes = {key: int(getattr(memory, f"{key}_size_in_bytes")) for key in ("argument", "output", "temp", "alias")}
    # Donated state is both argument and output: alias bytes are counted once (as MaxText sums them).
    total = sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    text = compiled.as_text()
    return {
        "program": name,
        "gib_per_chip": {**{key: value / GIB for key, value in sizes.items()}, "total": total / GIB},
        "hbm_gib_per_chip": target.hbm_bytes / GIB,
        "fits": total <= target.hbm_bytes,
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "collectives": collective_counts(text),
        # Pallas kernels lower to Mosaic custom calls on TPU (splash attention among them).
        "pallas_mosaic": "tpu_custom_call" in text,
        "compile_seconds": seconds,
    }


def compile_for(config, target: Slice) -> dict:
    """The report of compiling `config`'s train step for `target`: the slice, the mesh, the attention
    asked for, and per program its memory, cost and collectives (see `program_report`)."""
    validate_config(config)
    devices = topology_devices(target)
    mesh = sharding.make_mesh(config.mesh, devices=devices)
    check_batch_split(config, mesh)
    task, batch_shapes = open_compile_task(config, mesh)
    layout = task.layout()
    start = time.perf_counter()
    try:
        compiled = task.compile(layout, batch_shapes)
    except jax.errors.JaxRuntimeError as error:
        # The TPU compiler itself refuses a program whose buffers exceed the chip's HBM.
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        detail = str(error).strip().splitlines()[0]
        raise DoesNotFit(f"train_step does not fit {target.name} ({devices[0].device_kind}, "
                         f"{target.hbm_bytes / GIB:.0f} GiB HBM per chip): {detail}") from None
    programs = [program_report("train_step", compiled, time.perf_counter() - start, target)]
    return {
        "topology": {"name": target.name, "topology_name": target.topology_name, "slices": target.slices,
                     "chips": len(devices), "device_kind": devices[0].device_kind},
        "mesh": dict(mesh.shape),
        "attention": str(config.model.attention),
        "model": {"dim": task.model_cfg.dim, "num_layers": task.model_cfg.num_layers,
                  "vocab_size": task.model_cfg.vocab_size,
                  "params": int(sum(math.prod(x.shape) for x in jax.tree.leaves(layout.param_shapes)))},
        "batch": {key: list(value.shape) for key, value in batch_shapes.items()},
        # XLA's `flops` (per program, per chip) counts a scanned layer loop's body once and a Pallas
        # kernel as nothing; the model's own count (6·N·tokens + attention, all chips) is the MFU numerator.
        "model_flops_per_step": float(task.flops_per_step()),
        "programs": programs,
    }


def check_fits(report: dict) -> None:
    """DoesNotFit naming the first program over the chip's HBM and its shortfall."""
    for program in report["programs"]:
        if not program["fits"]:
            need, have = program["gib_per_chip"]["total"], program["hbm_gib_per_chip"]
            raise DoesNotFit(f"{program['program']} needs {need:.2f} GiB per chip on {report['topology']['name']} "
                             f"({report['topology']['device_kind']}), which has {have:.0f} GiB HBM per chip: "
                             f"{need - have:.2f} GiB short (temp {program['gib_per_chip']['temp']:.2f} GiB, "
                             f"arguments {program['gib_per_chip']['argument']:.2f} GiB)")


def summary_line(program: dict) -> str:
    g = program["gib_per_chip"]
    census = " ".join(f"{key}={value}" for key, value in program["collectives"].items())
    return (f"{program['program']}: fits={program['fits']} total={g['total']:.3f}/{program['hbm_gib_per_chip']:.0f} GiB "
            f"per chip (argument={g['argument']:.3f} output={g['output']:.3f} temp={g['temp']:.3f} "
            f"alias={g['alias']:.3f}) flops={program['flops']:.3e} {census} "
            f"pallas_mosaic={program['pallas_mosaic']} compile_s={program['compile_seconds']:.1f}")
