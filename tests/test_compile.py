"""`python -m valen_jax.compile` (issue 28): the train step compiled ahead of time for a TPU slice
from this CPU host, through compile-only devices. Needs `libtpu` (the `tpu` extra); skipped without it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("libtpu")

from valen_jax.errors import ConfigError  # noqa: E402
from valen_jax.tasks import aot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _command(*args: str, prelude: str = "pass") -> subprocess.CompletedProcess:
    # runpy so a prelude can change the process first (hide libtpu); absl parses sys.argv.
    code = (f"import sys, runpy; {prelude}; sys.argv = ['valen_jax.compile', *{list(args)!r}]; "
            "runpy.run_module('valen_jax.compile', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    output = tmp_path_factory.mktemp("aot") / "report.json"
    done = _command("--config=configs/vflash.py:tiny", "--topology=v5e:2x2", "--config.model.attention=auto",
                    f"--output={output}")
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(output.read_text())


@pytest.mark.heavy  # every program of the tiny config compiled for TPU (~33 s); the fast tier keeps the NF4 compile
def test_tiny_compiles_for_v5e_with_splash(tiny):
    done, report = tiny
    assert report["topology"]["name"] == "v5e:2x2" and report["topology"]["chips"] == 4
    assert "v5" in report["topology"]["device_kind"].lower()
    assert report["topology"]["chip"] == {"hbm_bytes": 16 * aot.GIB, "peak_bf16_flops": 197e12,
                                          "hbm_bytes_per_second": 819e9}
    assert report["attention"] == {"asked": "auto", "chosen": "splash"}
    programs = {p["program"]: p for p in report["programs"]}
    # every program but a reinforcement run's own two (tested below)
    assert list(programs) == [name for name in aot.PROGRAMS if name not in aot.REINFORCE_PROGRAMS]
    for program in programs.values():
        memory = program["gib_per_chip"]
        assert set(memory) == {"argument", "output", "temp", "alias", "total"}
        assert all(memory[key] > 0 for key in ("argument", "total")), program["program"]
        assert memory["total"] < program["hbm_gib_per_chip"] == 16 and program["fits"] is True
        assert program["hlo_bytes_accessed"] > 0 and program["roofline_seconds"] > 0
        assert set(program["collectives"]) == set(aot.COLLECTIVES)
    train = programs["train_step"]
    # attention=auto under a TPU mesh is splash: its Pallas kernel lowers to a Mosaic custom call.
    assert train["pallas_mosaic"] is True and train["gib_per_chip"]["temp"] > 0
    # Data parallel over 4 chips: the gradients are all-reduced, outside any loop (no scan in :tiny).
    reduced = train["collectives"]["all-reduce"]
    assert reduced["count"] > 0 and reduced["bytes"] > 0 and reduced["outside_loops"]["count"] == reduced["count"]
    assert 0 < train["mfu_bound"] <= 1 and train["model_flops"] == report["model_flops_per_step"]
    # The speculative answers are compiled too: one while loop on the device, its trip count data-dependent.
    assert programs["spec_answer"]["gib_per_chip"]["total"] > 0
    assert any(loop["trip"] is None for loop in programs["spec_answer"]["loops"])
    assert report["batch"]["tokens"] == [8, 192]
    assert "train_step: fits=True" in done.stdout and "pallas_mosaic=True" in done.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("fits=True mfu_bound=0.") and " temp_gib_per_chip=" in last and "attention=splash" in last


def test_loop_aware_flops_count_every_layer():
    """XLA's cost_analysis counts a scanned body once; the HLO figures count it trip-count times."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from valen_jax.tasks import aot_hlo

    mesh = Mesh(aot.topology_devices(aot.parse_slice("v5e:2x2")), ("x",))

    def layers(w, x):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

    figures = {}
    for count in (2, 8):
        w = jax.ShapeDtypeStruct((count, 512, 512), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "x")))
        x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("x")))
        compiled = jax.jit(layers).lower(w, x).compile()
        figures[count] = (compiled.cost_analysis()["flops"], aot_hlo.analyse(compiled.as_text()))
    per_layer = 2 * 16 * 512 * 512  # 16 rows per chip
    assert figures[8][1].flops == pytest.approx(8 * per_layer, rel=0.01)
    assert figures[2][1].flops == pytest.approx(2 * per_layer, rel=0.01)
    assert figures[8][0] < 2 * per_layer  # what XLA says: one body's worth
    assert [loop["trip"] for loop in figures[8][1].loops] == [8]
    gathered = figures[8][1].collectives["all-gather"]  # FSDP-style: one weight gathered per layer
    assert gathered["inside_loops"]["count"] == 1 and gathered["bytes"] == pytest.approx(8 * 512 * 512 * 2)


# Issue 54: a model whose replicated train state (f32 weights, gradients and two moments: 26 GiB for these
# 1.6B parameters) exceeds a v5e chip's 16 GiB.
OVERSIZE = ("--config=configs/vflash.py:tiny", "--topology=v5e:2x2", "--config.model.dim=8192",
            "--config.model.mlp_dim=32768", "--programs=train_step")


@pytest.mark.heavy  # a subprocess that compiles for TPU: tens of CPU seconds
def test_oversize_model_is_refused_naming_the_hbm_and_the_mesh_keys():
    done = _command(*OVERSIZE, "--config.mesh.data=-1")  # data parallel, asked for by name
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("DoesNotFit: train_step does not fit v5e:2x2") and "16 GiB HBM per chip" in last
    assert last.endswith("the mesh (data=4 fsdp=1 tensor=1) keeps 4 copies of the params and optimizer state; "
                         "shard them over the 4 devices with --config.mesh.data=1 --config.mesh.fsdp=-1")


@pytest.mark.heavy  # a subprocess that compiles one 1.6B-parameter train step for TPU: minutes of CPU
def test_a_model_too_big_to_replicate_gets_fsdp_by_default_and_fits(tmp_path):
    """The mesh keys left unset: the replicated state does not fit half of a v5e chip, so the default mesh is
    FSDP over the slice, said in the log, and the step fits (data parallel it does not: the test above)."""
    output = tmp_path / "report.json"
    done = _command(*OVERSIZE, f"--output={output}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1} and report["programs"][0]["fits"] is True
    chosen = next(line for line in done.stderr.splitlines() if "mesh_choice.py" in line)
    assert "mesh data=1 fsdp=4 tensor=1 over 4 x TPU v5 lite: config.mesh unset: FSDP over the 4 devices" in chosen
    assert "--config.mesh.data=1 --config.mesh.fsdp=-1 sets this" in chosen


def test_the_default_mesh_is_chosen_by_the_targets_memory_and_recorded_in_the_config(caplog):
    """`train` and the compile build their mesh in `training.mesh_choice.training_mesh`: unset keys are chosen
    from the model's train state against the target devices' memory, not the host's."""
    import logging

    from data_pipeline.tokenizer import load_tokenizer
    from valen_jax.training import mesh_choice

    def chat_tiny():
        spec = importlib.util.spec_from_file_location("chat_mesh_cfg", ROOT / "configs/chat.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config("tiny")

    devices = aot.topology_devices(aot.parse_slice("v5e:2x2"))
    tokenizer = load_tokenizer(chat_tiny().data.tokenizer, chat_tiny().data.template_family)
    for device_bytes, expected, recorded in ((16 * aot.GIB, {"data": 4, "fsdp": 1, "tensor": 1}, (-1, 1, 1)),
                                             (2 ** 20, {"data": 1, "fsdp": 4, "tensor": 1}, (1, -1, 1))):
        config = chat_tiny()
        assert (config.mesh.data, config.mesh.fsdp, config.mesh.tensor) == (None, None, None)
        state = mesh_choice.train_state_bytes(config, mesh_choice.trained_model(config, tokenizer))
        assert state > 2 ** 20  # a few MiB: more than half of the 1 MiB device
        with caplog.at_level(logging.INFO, logger="valen_jax.training.mesh_choice"):
            mesh = mesh_choice.training_mesh(config, lambda c=config, t=tokenizer: mesh_choice.trained_model(c, t),
                                             devices, device_bytes=device_bytes)
        assert dict(mesh.shape) == expected
        # written back, so the checkpoint's config records the mesh evaluation lays the model out on
        assert (config.mesh.data, config.mesh.fsdp, config.mesh.tensor) == recorded
        assert "TPU v5 lite" in caplog.records[-1].getMessage()
    # A key the user set is kept, whatever the memory: the model is not looked at.
    config = chat_tiny()
    config.mesh.tensor = 2
    mesh = mesh_choice.training_mesh(config, lambda: pytest.fail("a set mesh needs no model"), devices,
                                     device_bytes=2 ** 20)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}


@pytest.mark.heavy  # a subprocess that compiles for TPU: tens of CPU seconds
def test_without_libtpu_one_line():
    done = _command("--config=configs/vflash.py:tiny", "--topology=v5e:2x2", prelude="sys.modules['libtpu'] = None")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("LibtpuMissing: libtpu is not installed") and "valen-jax[tpu]" in last
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("name", "topology", "bounds", "config"), [
    ("v5e-8", "v5e:2x4", (2, 2, 1), "default"),
    ("v5e:2x2", "v5e:2x2", (2, 2, 1), "default"),
    ("v6e-16", "v6e:4x4", (2, 2, 1), "default"),
    ("v5p-8", "v5p:2x2x1", (2, 2, 1), "megacore"),
    ("v5p-64", "v5p:2x4x4", (2, 2, 1), "megacore"),
    ("v4-8", "v4:2x2x1", (2, 2, 1), "megacore"),
])
def test_slice_names(name, topology, bounds, config):
    target = aot.parse_slice(name)
    assert (target.topology_name, target.chips_per_host_bounds, target.chip_config) == (topology, bounds, config)


@pytest.mark.parametrize("name", ["v9x-8", "v5e-6", "v5e", "v5e:2xq"])
def test_unknown_slice_names_are_refused(name):
    with pytest.raises(ConfigError, match="--topology"):
        aot.parse_slice(name)


@pytest.mark.heavy  # a subprocess that compiles for TPU: tens of CPU seconds
def test_valen_branch_trees_compile_with_splash(tmp_path):
    # Branch trees are splash's two passes merged by log-sum-exp, with their own custom VJP.
    output = tmp_path / "valen.json"
    done = _command("--config=configs/valen.py:tiny", "--topology=v5e:2x2", "--programs=train_step,spec_answer",
                    f"--output={output}")
    assert done.returncode == 0, done.stderr[-3000:]
    train, step = json.loads(output.read_text())["programs"]
    assert (train["program"], step["program"]) == ("train_step", "spec_answer")
    assert train["pallas_mosaic"] is True and train["fits"] is True and step["fits"] is True


@pytest.mark.heavy  # a subprocess that compiles for TPU: ~15 CPU seconds
def test_a_reinforcement_step_compiles_its_rollout_and_both_updates(tmp_path):
    # train.mode=reinforce: the update (train_step), the rollout's generation (each prompt prefilled once for
    # its group) and a rollout's first update (which makes the old log-probabilities).
    output = tmp_path / "rl.json"
    done = _command("--config=configs/reinforce.py:tiny", "--topology=v5e:2x2",
                    "--programs=train_step,rollout,first_update", f"--output={output}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(output.read_text())
    assert [p["program"] for p in report["programs"]] == ["train_step", "rollout", "first_update"]
    assert all(p["fits"] for p in report["programs"]) and report["mode"] == "reinforce"
    # 4 prompts x G 4 rows of 24 tokens; the loss reads each row's 4-token completion window only
    assert report["batch"]["tokens"] == [16, 24] and report["batch"]["targets"] == [16, 4]
    assert "old_logp" in report["batch"]  # the later updates' input; the first update makes it
    # ... laid out as the batch (`compile_step`'s per_row_metrics): no all-gather more than a later update.
    train, _, first = report["programs"]
    assert first["collectives"] == train["collectives"]
    done = _command("--config=configs/vflash.py:tiny", "--topology=v5e:2x2", "--programs=rollout")
    assert done.returncode != 0 and "--programs: train.mode=ar has no rollout" in done.stderr


@pytest.mark.heavy  # two subprocesses that compile the decoding programs for TPU: ~25 CPU seconds
def test_a_scanned_model_decodes_per_layer_as_its_runs_do(tmp_path):
    # A run decodes a scan_layers model from its per-layer copy (`run.handle.decoding_layout`), so the
    # decoding programs compiled for the scanned config are the unscanned config's: the same bytes and flops.
    # Over the stacked weights each step would copy its layer's slices out first (more bytes accessed).
    figures = {}
    for scanned in (True, False):
        output = tmp_path / f"scan_{scanned}.json"
        done = _command("--config=configs/vflash.py:tiny", "--topology=v5e:2x2", "--programs=generate,spec_answer",
                        f"--config.model.scan_layers={scanned}", f"--output={output}")
        assert done.returncode == 0, done.stderr[-3000:]
        figures[scanned] = {p["program"]: (p["hlo_bytes_accessed"], p["hlo_flops"], p["gib_per_chip"]["argument"])
                            for p in json.loads(output.read_text())["programs"]}
    assert list(figures[True]) == ["generate", "spec_answer"]
    assert figures[True] == figures[False]


def test_nf4_dequantise_needs_no_padded_temporaries():
    """Unpacking a 7B MLP weight's NF4 codes on a v5e chip asks temporaries of the order of the weight.
    Interleaving the two nibbles of a byte with `stack(axis=-1)` made an [n, 2] array whose size-2 minor
    axis XLA:TPU pads to 128 lanes: 16 GiB of temporaries for this one weight (24 to 27 GiB for QLoRA 7B's
    step, README's LoRA section); `nf4.dequantise` must not."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from valen_jax.models import nf4

    mesh = Mesh(aot.topology_devices(aot.parse_slice("v5e:1x1")), ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    shape = (3584, 18944)  # Qwen2.5-7B's gate/up projection
    size = shape[0] * shape[1]
    codes = jax.ShapeDtypeStruct((size // 2,), jnp.uint8, sharding=replicated)
    absmax = jax.ShapeDtypeStruct((size // nf4.BLOCK,), jnp.float32, sharding=replicated)
    compiled = jax.jit(lambda c, a: nf4.dequantise(c, a, shape, jnp.bfloat16)).lower(codes, absmax).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    # 3.0 weights of temporaries with libtpu 0.0.42 (jax 0.10.2), 4.0 with 0.0.48 and 0.0.50 (jax 0.11.2,
    # 0.12.0.1); the padded layout asked 128.
    assert temp <= 5 * size * 2, f"{temp / 2 ** 30:.2f} GiB of temporaries for a {size * 2 / 2 ** 30:.2f} GiB weight"
