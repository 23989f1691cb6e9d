"""A LoRA run's checkpoint holds its trained leaves, their optimizer state and its base's fingerprints
(`training/adapter_checkpoint.py`): the pieces, on a tiny LoRA model's real layout, and a meta-schema-2
LoRA checkpoint (it held the base too) that still restores and evaluates, and is refused a resume.

`tests/fixtures/schema2_lora/` is a LoRA workdir trained one step by the code of commit 8b2a399 (the last
before adapter-only checkpoints): `python -m valen_jax.train --config=configs/vflash.py:tiny,lora
--config.model.dim=16 --config.model.mlp_dim=32 --config.model.num_layers=1 --config.model.num_heads=2
--config.model.num_kv_heads=1 --config.model.head_dim=8 --config.model.vision.dim=16
--config.model.vision.mlp_dim=32 --config.model.vision.num_heads=2 --config.model.lora.rank=2
--config.train.steps=1 --config.eval.at_end=False --workdir=/tmp/schema2/lora` in an export of that commit
at /tmp/old8b, and that code's `evaluate --max-examples=4` report on data/smoke/vflash/eval.jsonl
(`report.json`). Only `checkpoints/` and `tokenizer/` are kept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.fixture_runs import read_training_data_here
from valen_jax.evaluation.report import evaluate_workdir
from valen_jax.models import lora, sharding
from valen_jax.models.config import ModelConfig
from valen_jax.training import adapter_checkpoint, checkpoint
from valen_jax.training.step import TrainLayout

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "schema2_lora"
EVAL = ROOT / "data" / "smoke" / "vflash" / "eval.jsonl"
TRAINED_ON = "/tmp/old8b/data/smoke/vflash/recipe.json"  # the checkout the fixture was trained in


def test_the_fingerprint_tells_a_changed_word_and_a_permutation_apart():
    x = jnp.arange(1.0, 65.0, dtype=jnp.float32).reshape(8, 8)
    base = adapter_checkpoint.fingerprints({"w": x})["w"]
    one_word = adapter_checkpoint.fingerprints({"w": x.at[3, 5].add(1e-6)})["w"]
    swapped = adapter_checkpoint.fingerprints({"w": x.at[0, 0].set(x[7, 7]).at[7, 7].set(x[0, 0])})["w"]
    assert len(base) == 16 and one_word[:8] != base[:8] and one_word[8:] != base[8:]
    assert swapped[:8] == base[:8] and swapped[8:] != base[8:]  # the plain sum cannot see a swap; the hash can
    # Constant arrays (norm scales) and the other dtypes a base holds get a non-trivial hash too.
    for value in (jnp.ones((64,), jnp.float32), jnp.ones((4, 16), jnp.bfloat16), jnp.arange(32, dtype=jnp.uint8)):
        assert adapter_checkpoint.fingerprints({"w": value})["w"][8:] != "00000000"


def _layout(score_head: bool = False) -> TrainLayout:
    cfg = ModelConfig(vocab_size=64, dim=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32,
                      scan_layers=False, score_head=score_head, lora=lora.LoraConfig(rank=2, targets=("q", "down")))
    train = ml_collections.ConfigDict({
        "learning_rate": 1e-3, "warmup_steps": 1, "steps": 4, "end_learning_rate_fraction": 0.1, "decay": "cosine",
        "adam_b1": 0.9, "adam_b2": 0.95, "weight_decay": 0.1, "grad_clip_norm": 1.0, "param_groups": [],
        "vision_lr_multiplier": 1.0})
    return TrainLayout.from_config(cfg, train, sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}))


@pytest.mark.parametrize("score_head", [False, True])
def test_the_saved_state_holds_the_adapters_the_head_and_moments_for_them_alone(score_head):
    layout = _layout(score_head)
    saved = checkpoint.paths_of(layout.saved_abstract_state())
    params = sorted(p[len("params/"):] for p in saved if p.startswith("params/"))
    adapters = [f"layers/{i}/{group}/{name}{suffix}" for i in range(2) for group, name in (("attn", "q"), ("mlp", "down"))
                for suffix in (lora.SUFFIX_A, lora.SUFFIX_B)]
    assert params == sorted(adapters + (["score_head/bias", "score_head/kernel"] if score_head else []))
    # Adam's moments (mu, nu) exist for the trained leaves only: nothing of the base in the optimizer state.
    moments = sorted(p.split("/mu/", 1)[1] for p in saved if "/mu/" in p)
    assert moments == params
    assert all(p.rsplit("/", 1)[-1] == "count" or "/mu/" in p or "/nu/" in p
               for p in saved if p.startswith("opt_state/"))
    full = checkpoint.paths_of(layout.abstract_state())
    assert "params/embed" in full and "params/embed" not in saved and "params/layers/0/attn/q" not in saved


def test_a_rebuilt_base_that_differs_is_refused_naming_the_first_leaf_and_both_fingerprints():
    layout = _layout()
    params = jax.tree.map(lambda s: jnp.full(s.shape, 0.5, s.dtype), layout.param_shapes)
    record = adapter_checkpoint.base_record(params, layout.saved_paths, "", 7)
    assert sorted(record["leaves"]) == sorted(set(checkpoint.paths_of(params)) - layout.saved_paths)
    trained = adapter_checkpoint.select(params, lambda p: p in layout.saved_paths)
    adapter_checkpoint.check_base(record, adapter_checkpoint.with_trained(params, trained), "run: checkpoint 4")
    changed = jax.tree.map(lambda x: x, params)
    changed["layers"][1]["attn"]["q"] = params["layers"][1]["attn"]["q"].at[0, 0, 0].set(0.25)
    changed["layers"][1]["mlp"]["down"] = params["layers"][1]["mlp"]["down"] * 2
    with pytest.raises(checkpoint.CheckpointError) as refused:
        adapter_checkpoint.check_base(record, changed, "run: checkpoint 4")
    message = str(refused.value)
    found = adapter_checkpoint.fingerprints({"q": changed["layers"][1]["attn"]["q"]})["q"]
    assert "\n" not in message and message.startswith("run: checkpoint 4: the base rebuilt from the fresh base of seed 7")
    assert f"leaf layers/1/attn/q has fingerprint {found}, the checkpoint recorded " \
           f"{record['leaves']['layers/1/attn/q']}" in message


@pytest.fixture
def legacy(tmp_path) -> Path:
    shutil.copytree(FIXTURE / "checkpoints", tmp_path / "lora" / "checkpoints")
    shutil.copytree(FIXTURE / "tokenizer", tmp_path / "lora" / "tokenizer")
    return tmp_path / "lora"


@pytest.mark.slow
def test_a_schema_2_lora_checkpoint_holding_its_base_evaluates_to_the_report_its_own_code_wrote(legacy, monkeypatch):
    mgr = checkpoint.manager(legacy, read_only=True)
    try:
        meta = checkpoint.restore_meta(mgr, 1)
    finally:
        mgr.close()
    assert meta["model"]["lora"]["rank"] == 2 and adapter_checkpoint.BASE_KEY not in meta
    assert "params/embed (2176, 16) float32" in meta["state_layout"]  # schema 2: the base is in its state
    read_training_data_here(monkeypatch, TRAINED_ON)
    report = evaluate_workdir(legacy, EVAL, max_examples=4)
    expected = json.loads((FIXTURE / "report.json").read_text())
    for key in ("loss", "accuracy", "target_tokens", "metrics", "examples"):
        assert report[key] == expected[key], key
    assert np.isfinite(report["loss"])


@pytest.mark.slow
def test_a_schema_2_lora_checkpoint_is_refused_a_resume_in_one_line(legacy):
    from tests.train_runs import run_train

    mgr = checkpoint.manager(legacy, read_only=True)
    try:
        config = checkpoint.restore_meta(mgr, 1)["config"]
    finally:
        mgr.close()
    model = {k: config["model"][k] for k in ("dim", "mlp_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim")}
    result = run_train("configs/vflash.py:tiny,lora", legacy, *(f"--config.model.{k}={v}" for k, v in model.items()),
                       "--config.model.vision.dim=16", "--config.model.vision.mlp_dim=32",
                       "--config.model.vision.num_heads=2", "--config.model.lora.rank=2", "--config.train.steps=2",
                       "--config.eval.at_end=False", check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "checkpoint 1 is a LoRA checkpoint from before adapter-only checkpoints" in line, result.stderr[-3000:]
    assert "--config.model.lora.init_adapter=FOLDER" in line
    assert sorted(p.name for p in (legacy / "checkpoints").iterdir()) == ["1"]  # nothing written over it
