"""metrics.jsonl on resume, peak FLOP/s per device kind, model FLOPs; config checks of issue 7's fields."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from valen_jax.models.config import ModelConfig
from valen_jax.training.metrics import MetricsLog, PeakFlopsError, model_flops_per_step, peak_flops_per_device


def records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_drops_records_past_its_start_and_a_line_cut_by_a_kill(tmp_path):
    log = MetricsLog(tmp_path)
    for step in (1, 2, 3, 4):
        log.write(step, {"loss": float(step)})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"loss": 5.0, "st')  # the kill landed mid-write
    log = MetricsLog(tmp_path, start_step=2)
    log.write(3, {"loss": 30.0})
    log.close()
    assert [(r["step"], r["loss"]) for r in records(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


@pytest.mark.parametrize("kind, flops", [("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5p", 459e12),
                                         ("TPU v6 lite", 918e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                         ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12)])
def test_peak_flops_come_from_the_device_kind(kind, flops):
    device = SimpleNamespace(platform="gpu" if "NVIDIA" in kind else "tpu", device_kind=kind)
    assert peak_flops_per_device(None, device)[0] == flops


def test_peak_flops_config_wins_and_an_unknown_accelerator_must_be_configured():
    unknown = SimpleNamespace(platform="gpu", device_kind="NVIDIA L4")
    assert peak_flops_per_device(1.5e14, unknown) == (1.5e14, "config.train.peak_flops")
    with pytest.raises(PeakFlopsError, match="NVIDIA L4"):
        peak_flops_per_device(None, unknown)


def test_peak_flops_on_cpu_is_measured_in_the_model_s_dtype():
    cpu = SimpleNamespace(platform="cpu", device_kind="cpu")
    flops, source = peak_flops_per_device(None, cpu)
    assert flops > 1e8 and source == "a float32 matmul measured at start-up"
    flops, source = peak_flops_per_device(None, cpu, jnp.bfloat16)
    assert flops > 1e8 and source == "a bfloat16 matmul measured at start-up"


def test_model_flops_agree_with_xla_s_count_of_the_compiled_train_step():
    """Our formula against an independent count: XLA's cost analysis of the real forward+backward+update.

    XLA also counts the elementwise work (norms, softmax, AdamW), so its number is a little higher;
    the window is tight enough that forgetting the backward pass (÷3), the LM head (a third of this
    config's matmuls) or one of the three MLP matrices fails.
    """
    import jax
    import ml_collections
    import numpy as np

    from valen_jax.models import sharding
    from valen_jax.training.step import StepOptions, TrainLayout, make_train_step

    cfg = ModelConfig(vocab_size=1024, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=256)
    batch, seq = 8, 16
    train = ml_collections.ConfigDict(dict(steps=10, learning_rate=1e-3, warmup_steps=1, decay="cosine",
                                           end_learning_rate_fraction=0.1, weight_decay=0.01, adam_b1=0.9,
                                           adam_b2=0.95, grad_clip_norm=1.0, param_groups=[],
                                           vision_lr_multiplier=1.0))
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    layout = TrainLayout.from_config(cfg, train, mesh)
    shapes = {name: jax.ShapeDtypeStruct((batch, seq), dtype) for name, dtype in (
        ("tokens", np.int32), ("targets", np.int32), ("target_weights", np.float32), ("positions", np.int32),
        ("segment_ids", np.int32))}
    shapes.update(patches=jax.ShapeDtypeStruct((batch, 0, 0), np.float32),
                  patch_positions=jax.ShapeDtypeStruct((batch, 0, 3), np.int32),
                  patch_segments=jax.ShapeDtypeStruct((batch, 0), np.int32))
    step = jax.jit(make_train_step(layout.graphdef, layout.tx, layout.schedule, StepOptions()))
    with jax.set_mesh(mesh):
        analysis = step.lower(layout.abstract_state(), shapes).compile().cost_analysis()
    xla_flops = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    ours = model_flops_per_step(cfg, batch=batch, seq=seq)
    assert 1.0 <= xla_flops / ours <= 1.15, (xla_flops, ours)


def _tiny():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("vflash_cfg", Path(__file__).parent.parent / "configs/vflash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny")


@pytest.mark.parametrize("path, value, message", [
    ("train.decay", "exponential", "decay"),
    ("train.grad_accum_steps", 3, "grad_accum_steps"),
    ("train.param_groups", [{"pattern": "embed", "frozen": True, "lr_multiplier": 0.5}], "exactly one"),
    ("train.param_groups", [{"pattern": "embed", "lr": 0.5}], "'pattern' and one of"),
    ("loss.z_loss", -1e-4, "z_loss"),
    ("loss.loss_reduction", "mean", "state_mean"),
    ("loss.weights", {"tokens": 1.0, "branches": 0.0}, "exactly"),
    ("loss.weights", {"tokens": 0.0, "branches": 0.0, "drafter": 0.0}, "nothing would be trained"),
    ("loss.weights", {"tokens": -1.0, "branches": 0.0, "drafter": 0.0}, "≥ 0"),
    ("model.param_dtype", "bfloat16", "master weights"),
    ("model.dtype", "float16", "dtype"),
    ("eval.every", -1, "eval.every"),
    # Issue 19: `--config.train.learning_rate=nan` and negative rates used to train (NaN at every step).
    ("train.learning_rate", float("nan"), "config.train.learning_rate must be a finite number, got nan"),
    ("train.learning_rate", float("inf"), "config.train.learning_rate must be a finite number"),
    ("train.learning_rate", -3e-3, r"config.train.learning_rate must be a finite number > 0"),
    ("train.learning_rate", 0.0, r"learning_rate must be a finite number > 0 \(freeze"),
    ("train.end_learning_rate_fraction", 1.5, r"end_learning_rate_fraction must be a finite number in \[0, 1\]"),
    ("train.weight_decay", -0.01, "weight_decay must be a finite number ≥ 0"),
    ("train.adam_b1", float("nan"), "adam_b1 must be a finite number, got nan"),
    ("train.adam_b2", 1.0, r"adam_b2 must be a finite number in \[0, 1\)"),
    ("train.grad_clip_norm", 0.0, "grad_clip_norm must be a finite number > 0"),
    ("train.grad_clip_norm", "1.0", "grad_clip_norm must be a finite number"),
    ("train.warmup_steps", -1, "warmup_steps must be ≥ 0"),
    ("train.peak_flops", float("inf"), "peak_flops must be a finite number"),
])
def test_impossible_config_values_fail_at_start_up(path, value, message):
    from valen_jax.config.schema import ConfigError, validate_config
    config = _tiny()
    group, key = path.split(".")
    with config.unlocked():
        del config[group][key]
        config[group][key] = value
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


@pytest.mark.parametrize("name", ["vflash", "chat", "vakforge"])
@pytest.mark.parametrize("variant", ["", "tiny", "hf"])
def test_every_config_and_variant_validates(name, variant):
    import importlib.util
    from pathlib import Path

    from valen_jax.config.schema import validate_config
    spec = importlib.util.spec_from_file_location(f"{name}_cfg", Path(__file__).parent.parent / f"configs/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(variant)
    validate_config(config)
    assert config.data.format == {"vflash": "recipe", "chat": "chat", "vakforge": "vakforge"}[name]
    assert dict(config.loss.weights) == {"tokens": 1.0, "branches": 0.0, "drafter": 0.0}


def test_non_finite_values_are_written_as_strict_json_null_and_named(tmp_path):
    # Issue 19: `NaN` was written bare, which strict JSON readers refuse.
    log = MetricsLog(tmp_path)
    log.write(1, {"loss": float("nan"), "grad_norm": float("inf"), "accuracy": 0.5})
    log.close()
    line = (tmp_path / "metrics.jsonl").read_text()

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    record = json.loads(line, parse_constant=refuse)
    assert record == {"step": 1, "loss": None, "grad_norm": None, "accuracy": 0.5,
                      "nonfinite": {"loss": "nan", "grad_norm": "inf"}}
