"""Compile a config's programs ahead of time for a TPU slice, from any host (no accelerator needed).

    python -m valen_jax.compile --config=configs/vflash.py:tiny --topology=v5e:2x2
    python -m valen_jax.compile --config=configs/prepared.py:hf --config.model.init_from=benchmarks/shapes/qwen2.5-7b \
        --topology=v5p-64 --config.data.seq_len=8192 --config.data.global_batch=32 --programs=train_step \
        --output=report.json

The mesh is the one `train` would build on the slice (`valen_jax/training/mesh_choice.py`): the
`config.mesh` keys as set, or with none set, data parallel when the replicated params, gradients and
optimizer state fit half of one chip's HBM, else FSDP over the slice (the 7B full fine-tune above:
`mesh data=1 fsdp=32`), logged in one line with why.

Needs `libtpu` (`pip install 'valen-jax[tpu]'`): its compile-only devices stand in for the slice. Every
program is traced under a mesh of those devices, so `attention=auto` picks splash as it would on the slice
(DESIGN: choices by target, not host). Programs (`--programs`, default all): the train step of the
config's mode through the task's own `compile` (token LM, Valen scoring, VL rows with patches, the
`vflash` drafter step, the `reinforce` update), the evaluation forward, the engine's generation (prefill +
decode loop) at the evaluation batch, the speculative block loop's prefill, step and block, and for
`train.mode=reinforce` a rollout's generation and its first update (`rollout`, `first_update`). Model shapes come from the
config or from `model.init_from`'s config.json alone (no weights are read). Prints, per program, memory
per chip (argument, output, temp, alias GiB), XLA's and the loop-aware FLOPs and bytes, the roofline and
MFU bound, the collectives census and whether Pallas (Mosaic) kernels are in it; `--output` writes the
same as JSON. The last line: `fits=… mfu_bound=… temp_gib_per_chip=…`. Exits 1 with one line when a
program does not fit the chip's HBM, naming the shortfall, the largest buffers and the mesh keys to
change (`--config.mesh.data=1 --config.mesh.fsdp=-1` where the mesh replicates the state). Slice names (`v5e-8`,
`v5p-64`, `v6e-16`, `v4-8`, or libtpu's `v5e:2x2`) and the chip table: `valen_jax/tasks/aot.py`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# Compile-only TPU devices need no TPU runtime: without this, JAX on a host without a TPU would try to
# start one from libtpu (and log its failure) before the first compile. Set before JAX is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a machine-wide lockfile (/tmp/libtpu_lockfile) meant for processes that open real TPU chips;
# compile-only devices open none, so several compiles (or a compile beside a test run) may share libtpu.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import app, flags
from ml_collections import config_flags

from data_pipeline.cli_paths import PathError, check_path
from data_pipeline.tokenizer import TokenizerError
from valen_jax.cli import log_setup as cli_logging
from valen_jax.data.assemble import AssemblyError
from valen_jax.errors import ConfigError
from valen_jax.models.sharding import ShardingError
from valen_jax.tasks import aot
from valen_jax.training.checkpoint import CheckpointError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/vflash.py[:tiny]")
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU slice: v5e-8, v5p-64, v6e-16, v4-8 or v5e:2x2")
_SLICES = flags.DEFINE_integer("slices", 1, "Number of such slices (multi-slice, over DCN)")
_OUTPUT = flags.DEFINE_string("output", None, "Write the report as JSON here")
_PROGRAMS = flags.DEFINE_list("programs", None, "Compile only these (default: all): " + ", ".join(aot.PROGRAMS))

# As train.py: the user's input, said in full by the message, is one line; anything else a traceback.
USER_ERRORS = (ConfigError, PathError, TokenizerError, AssemblyError, ShardingError, CheckpointError,
               aot.LibtpuMissing)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli_logging.configure(timestamps=True)
    if _TOPOLOGY.value is None:
        raise app.UsageError("--topology is required, e.g. --topology=v5e-8")
    try:
        check_path("--config", config_flags.get_config_filename(flags.FLAGS["config"]))
        if _OUTPUT.value:
            check_path("--output", _OUTPUT.value)
        only = tuple(_PROGRAMS.value) if _PROGRAMS.value else None
        unknown = sorted(set(only or ()) - set(aot.PROGRAMS))
        if unknown:
            raise ConfigError(f"--programs: unknown {', '.join(unknown)}; known: {', '.join(aot.PROGRAMS)}")
        report = aot.compile_for(_CONFIG.value, aot.parse_slice(_TOPOLOGY.value, _SLICES.value), only)
    except (*USER_ERRORS, aot.DoesNotFit) as error:
        sys.exit(f"{type(error).__name__}: {error}")
    t = report["topology"]
    print(f"{t['name']} ({t['topology_name']}, {t['chips']} x {t['device_kind']}), mesh {report['mesh']}, "
          f"train.mode={report['mode']}, attention={report['attention']['asked']}->{report['attention']['chosen']}, "
          f"{report['model']['params']:,} params (one layer {report['model']['layer_param_gib']:.3f} GiB), "
          f"decode batch {report['decode_batch']}, model FLOPs per step {report['model_flops_per_step']:.3e}")
    for program in report["programs"]:
        print(aot.summary_line(program))
    if _OUTPUT.value:
        Path(_OUTPUT.value).write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.flush()
    try:
        aot.check_fits(report)
    except aot.DoesNotFit as error:
        print(aot.last_line(report))
        sys.stdout.flush()
        sys.exit(f"DoesNotFit: {error}")
    print(aot.last_line(report))


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
