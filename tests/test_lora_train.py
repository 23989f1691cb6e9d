"""A LoRA run end to end: `configs/chat.py:hf,lora` from a tiny Qwen2 checkpoint built here, on a user's own
chat files, trains its adapters (the loss falls; its checkpoint holds those and their moments, no imported
leaf; the base restored from the HF checkpoint is the imported one, bit for bit; a text checkpoint gets no
vision tower, issue 54), evaluate, predict and generate work on its workdir, it exports as a PEFT adapter,
and once a tensor of that HF checkpoint is changed they refuse it in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.own_data import OWN_EVAL, OWN_TRAIN, write_chat
from tests.test_train_from_hf import _base_model
from tests.train_runs import metrics, run_module, run_train

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.heavy


def _command(module: str, *args: str):
    return run_module(module, *args)


def test_a_lora_run_trains_its_adapters_and_its_workdir_evaluates_generates_and_exports(tmp_path):
    import jax
    import orbax.checkpoint as ocp
    import transformers

    from valen_jax.models import lora
    from valen_jax.run import restore
    from valen_jax.training import checkpoint
    from valen_jax.training.optim import path_of

    base = tmp_path / "base"
    _base_model(base)
    workdir = tmp_path / "run"
    # Short rows: this tokenizer learnt its merges from VFlash prompts only.
    train = write_chat(tmp_path / "own_train.jsonl", [row for row in OWN_TRAIN if "tools" not in row] * 2)
    eval_data = str(write_chat(tmp_path / "own_eval.jsonl", [row for row in OWN_EVAL if "tools" not in row]))
    run_train("configs/chat.py:hf,lora", workdir, f"--config.model.init_from={base}", f"--config.data.tokenizer={base}",
              f"--config.data.train={train}", f"--config.data.eval={eval_data}",
              "--config.train.steps=8", "--config.train.log_every=1", "--config.train.checkpoint_every=8",
              "--config.train.warmup_steps=1", "--config.train.learning_rate=1e-2", "--config.model.dtype=float32",
              "--config.eval.every=0", "--config.eval.at_end=False", "--config.eval.max_examples=2",
              "--config.data.global_batch=4", "--config.model.lora.rank=4", "--config.data.seq_len=512")
    losses = [m["loss"] for m in metrics(workdir)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.05, losses
    # The saved tree (Orbax's own metadata of the state item): adapters and their moments; nothing of the
    # imported base, and no vision tower (a text checkpoint gets none).
    saved = checkpoint.paths_of(ocp.PyTreeCheckpointer().metadata(workdir / "checkpoints" / "8" / "state")
                                .item_metadata.tree)
    params = [p for p in saved if p.startswith("params/")]
    assert params and all(lora.is_adapter(p) for p in params), params
    trained = ("/lora_", "_lora_a", "_lora_b")
    assert all(any(t in p for t in trained) or p.endswith("/count") for p in saved if p.startswith("opt_state/")), saved
    moments = {p.split(f"/{m}/", 1)[1] for p in saved for m in ("mu", "nu") if f"/{m}/" in p}
    assert {p[len("params/"):] for p in params} <= moments
    meta = json.loads((workdir / "checkpoints" / "8" / "meta" / "metadata").read_text())
    assert meta["lora_base"]["init_from"] == str(base) and "layers/attn/q" in meta["lora_base"]["leaves"]
    run = restore(workdir, devices=jax.devices()[:1])
    assert run.model_cfg.lora == lora.LoraConfig(rank=4, alpha=32.0) and run.model_cfg.vision is None
    # The imported decoder weight is unchanged after 8 steps; its adapter moved.
    hf_q = transformers.AutoModelForCausalLM.from_pretrained(base).state_dict()["model.layers.0.self_attn.q_proj.weight"]
    ours = {path_of(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(run.params)[0]}
    np.testing.assert_array_equal(ours["layers/attn/q"][0].reshape(64, -1).T, hf_q.numpy())
    assert np.abs(ours["layers/attn/q_lora_b"]).max() > 0

    _command("valen_jax.evaluate", f"--workdir={workdir}", f"--data={eval_data}", f"--output={tmp_path / 'r.json'}")
    assert "metrics" in json.loads((tmp_path / "r.json").read_text()) or (tmp_path / "r.json").stat().st_size > 0
    _command("valen_jax.generate", f"--workdir={workdir}", f"--data={eval_data}", f"--output={tmp_path / 'a.jsonl'}",
             "--max-new-tokens=4")
    assert (tmp_path / "a.jsonl").read_text().strip()
    _command("valen_jax.predict", f"--workdir={workdir}", f"--data={eval_data}", f"--output={tmp_path / 'p.jsonl'}")
    assert (tmp_path / "p.jsonl").read_text().strip()
    # A text checkpoint's run has no tower of our own: it exports as a PEFT adapter (refused before issue 54).
    _command("valen_jax.export", f"--workdir={workdir}", f"--output={tmp_path / 'adapter'}", "--adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()

    # One tensor of the HF checkpoint the adapters were trained on changes: every command refuses the base.
    from safetensors.torch import load_file, save_file
    tensors = load_file(base / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.weight"][0, 0] += 0.5
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    for module, output in (("valen_jax.evaluate", "r2.json"), ("valen_jax.predict", "p2.jsonl")):
        refused = run_module(module, f"--workdir={workdir}", f"--data={eval_data}", f"--output={tmp_path / output}",
                             check=False)
        line = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode == 1 and f"checkpoint 8: the base rebuilt from config.model.init_from={str(base)!r} " \
            "differs from the one the adapters were trained on: leaf layers/attn/q has fingerprint " in line, \
            refused.stderr[-2000:]
        assert meta["lora_base"]["leaves"]["layers/attn/q"] in line and not (tmp_path / output).exists()
