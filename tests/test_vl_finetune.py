"""Issue 13 end to end: a tiny Qwen2.5-VL checkpoint (tests/vl_checkpoints.py) fine-tuned through the real
CLIs — `valen_jax.train --config=configs/vflash.py:hf` on the smoke recipe with the vision tower frozen
through `train.param_groups`, then `valen_jax.evaluate` and `valen_jax.export` on the workdir — and the
exported directory loaded by transformers gives our restored model's logits on a training row with images.
A second run, `configs/valen.py:hf` on the same checkpoint (images and a video clip), is answered by
`valen_jax.predict`.

One VFlash run (module fixture) serves the tests before the last; the checks are split so a failure names
its stage.
"""

from __future__ import annotations

import json
import math
import subprocess

import numpy as np
import pytest

from tests.train_runs import ROOT, metrics, run_module, run_train
from valen_jax.run import restore_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.heavy

FAMILY = "qwen2_5_vl"
STEPS = 3
EVAL = ROOT / "data/smoke/vflash/eval.jsonl"
VALEN = ROOT / "data/smoke/valen/train.jsonl"
FROZEN_TOWER = '({"pattern": "vision/.*", "frozen": True},)'


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return run_module(module, *args, timeout=600)


@pytest.fixture(scope="module")
def base(vl_checkpoint):
    """(directory, info) of the tiny checkpoint every run here starts from (the run's shared one: read only)."""
    return vl_checkpoint(FAMILY)


@pytest.fixture(scope="module")
def run(base, tmp_path_factory):
    """(base checkpoint directory, its info, trained workdir, train CLI result)."""
    base, info = base
    workdir = tmp_path_factory.mktemp("finetune")
    # f32 so the logit comparison is exact to 1e-4; a learning rate that moves f32 weights in 3 steps.
    # seq_len 256: the tiny BPE tokenizer spells the smoke texts in more tokens (longest row 251).
    result = run_train("configs/vflash.py:hf", workdir, f"--config.model.init_from={base}",
                       f"--config.data.tokenizer={base}", f"--config.train.steps={STEPS}",
                       f"--config.train.checkpoint_every={STEPS}", "--config.train.log_every=1",
                       "--config.train.warmup_steps=1", "--config.train.learning_rate=1e-3",
                       f"--config.train.param_groups={FROZEN_TOWER}", "--config.model.dtype=float32",
                       "--config.data.global_batch=4", "--config.data.seq_len=256", f"--config.eval.every={STEPS}",
                       "--config.eval.at_end=True", "--config.eval.max_examples=2", "--config.eval.batch_size=2",
                       "--config.eval.max_new_tokens=4", timeout=900)
    return base, info, workdir, result


def test_the_run_starts_from_the_vl_checkpoint_and_keeps_its_processor(run):
    base, info, workdir, result = run
    logged = metrics(workdir)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m["loss"]) for m in logged)
    from valen_jax.training import checkpoint
    meta = checkpoint.restore_meta(checkpoint.manager(workdir, read_only=True), STEPS)
    model = meta["model"]
    hf_config = json.loads((base / "config.json").read_text())
    assert model["vision"]["family"] == FAMILY and model["vision"]["window_size"] == 32
    assert model["mrope_section"] == hf_config["text_config"]["rope_parameters"]["mrope_section"]
    assert (model["image_pad_id"], model["video_pad_id"]) == (info["image_token_id"], info["video_token_id"])
    # The checkpoint's own vision tokens are used, not added again; the primitive numbers are added.
    assert model["vocab_size"] >= info["vocab_size"] + 1001
    image = json.loads((base / "preprocessor_config.json").read_text())
    video = json.loads((base / "video_preprocessor_config.json").read_text())
    kwargs, sources = meta["media_kwargs"], meta["media_kwargs_sources"]
    assert (kwargs["min_pixels"], kwargs["max_pixels"]) == (image["size"]["shortest_edge"], image["size"]["longest_edge"])
    assert list(kwargs["image_mean"]) == image["image_mean"] and list(kwargs["image_std"]) == image["image_std"]
    assert (kwargs["fps"], kwargs["min_frames"], kwargs["max_frames"]) == (video["fps"], video["min_frames"],
                                                                            video["max_frames"])
    assert kwargs["video_pixels_per"] == "frame"  # Qwen2VLVideoProcessor bounds each frame
    assert set(sources.values()) == {"preprocessor_config.json", "video_preprocessor_config.json"}
    report = json.loads((workdir / "eval" / f"report-{STEPS}.json").read_text())
    assert report["examples"] == 2 and math.isfinite(report["loss"])
    # Evaluation during training (eval.every) and the end-of-run report: one path, same params, same number.
    assert logged[-1]["eval_loss"] == pytest.approx(report["loss"], abs=1e-6)


def test_evaluate_restores_and_runs_the_finetuned_vlm(run, tmp_path):
    _, _, workdir, _ = run
    output = tmp_path / "report.json"
    _cli("valen_jax.evaluate", f"--workdir={workdir}", f"--data={EVAL}", f"--output={output}",
         "--max_examples=2", "--max_new_tokens=4", "--batch_size=2")
    report = json.loads(output.read_text())
    assert report["format"] == "vflash" and report["step"] == STEPS and report["examples"] == 2
    assert math.isfinite(report["loss"]) and report["target_tokens"] > 0
    assert report["generation"]["answers"] == 2


def test_predict_refuses_a_checkpoint_without_the_valen_head(run):
    """predict answers Valen questions with the scalar head; a VFlash fine-tune has none and says so
    (in this process: the CLI is this call and an argparse line, and a subprocess costs a JAX start-up)."""
    from valen_jax.predict import predict_workdir

    with pytest.raises(ValueError, match="scalar head.*loss.weights.branches=0"):
        predict_workdir(run[2], VALEN, fmt="valen")


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    _, _, workdir, _ = run
    out = tmp_path_factory.mktemp("export") / "hf"
    _cli("valen_jax.export", f"--workdir={workdir}", f"--output={out}")
    return out


def _state_dict(directory):
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(directory, attn_implementation="eager")
    return {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}


def test_the_export_states_the_runs_processor_settings(run, exported):
    """Another run started from the export (init_from) reads the media_kwargs this one trained with."""
    from valen_jax.data.vision_processor import processor_media_kwargs
    from valen_jax.training import checkpoint

    meta = checkpoint.restore_meta(checkpoint.manager(run[2], read_only=True), STEPS)
    stated = {key: value for key, (value, _) in processor_media_kwargs(exported).items()}
    assert stated == {key: tuple(v) if isinstance(v, list) else v for key, v in meta["media_kwargs"].items()}


def test_the_export_states_the_tokenizers_special_ids(exported):
    """transformers falls back to Qwen's hub ids (151643...) for ids config.json omits: outside this vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(exported)
    config = AutoConfig.from_pretrained(exported)
    assert (config.text_config.eos_token_id, config.text_config.pad_token_id) == (tokenizer.eos_token_id,
                                                                                  tokenizer.pad_token_id)
    assert config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_end_token_id == tokenizer.convert_tokens_to_ids("<|vision_end|>")
    assert max(config.vision_start_token_id, tokenizer.eos_token_id) < config.text_config.vocab_size


def test_frozen_tower_is_bitwise_the_checkpoints_and_the_decoder_trained(run, exported):
    base = _state_dict(run[0])
    trained = _state_dict(exported)
    assert set(trained) == set(base)
    vision = [name for name in base if ".visual." in f".{name}"]
    assert vision, sorted(base)[:10]
    changed_vision = [name for name in vision if not np.array_equal(base[name], trained[name])]
    assert changed_vision == []
    # Every decoder projection moved (a k bias may not: attention is blind to it, its gradient is ~0).
    projections = [name for name in base if ".layers." in name and name.endswith("proj.weight") and name not in vision]
    assert len(projections) == 2 * 7  # 2 layers × q, k, v, o, gate, up, down
    unchanged = [name for name in projections if np.array_equal(base[name], trained[name])]
    assert unchanged == []


def _training_row(workdir):
    """(ModelRun, the assembled row, media grids) of the training example with the most images."""
    from data_pipeline import examples as contract
    from data_pipeline.shards import Example
    from valen_jax.data.assemble import assemble, expand_media_slots
    from valen_jax.data.shard_cache import ensure_shards

    restored = restore_model(workdir)
    config = restored.config
    shard_set = ensure_shards(config.data.format, config.data.train, workdir / "shards", config.data.tokenizer,
                              restored.fingerprint, config.data.train_options.to_dict())
    source = shard_set.source()
    examples = [Example.from_bytes(source[i]) for i in range(len(shard_set))]
    example = max(examples, key=lambda e: len(contract.media_headers(e)))
    assert len(contract.media_headers(example)) >= 1
    grids = [media.grid for media in expand_media_slots(example, restored.spec).media]
    return restored, assemble(example, restored.spec), grids


def test_exported_model_gives_our_logits_in_transformers(run, exported):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from valen_jax.training.step import vision_inputs

    workdir = run[2]
    restored, row, grids = _training_row(workdir)
    length = int(row["segment_ids"].sum())
    patches = int((row["patch_segments"] > 0).sum())
    assert restored.model_cfg.mrope_section is not None and np.asarray(row["positions"]).shape[-1] == 3

    with jax.set_mesh(restored.mesh):
        model = nnx.merge(restored.graphdef, restored.params)
        batch = {k: jnp.asarray(v[None]) for k, v in row.items()}
        ours = np.asarray(model(batch["tokens"], batch["positions"], batch["segment_ids"], vision_inputs(batch)))[0]

    hf_model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        exported, attn_implementation="eager").float().eval()
    ids = row["tokens"][:length].astype(np.int64)
    image = restored.model_cfg.image_pad_id
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.tensor(ids[None]),
                          mm_token_type_ids=torch.tensor((ids == image).astype(np.int64)[None]),
                          pixel_values=torch.tensor(row["patches"][:patches]),
                          image_grid_thw=torch.tensor(grids)).logits[0].numpy()
    assert theirs.shape == (length, restored.model_cfg.vocab_size)
    np.testing.assert_allclose(ours[:length], theirs, atol=1e-4, rtol=0)


def test_a_valen_fine_tune_of_the_vlm_answers_every_question_with_the_predict_cli(base, tmp_path):
    """configs/valen.py:hf on the same checkpoint (the smoke records hold images and a video clip), then
    predict. seq_len fits the training rows (valen_fit: 363 tokens) but not every inference row: a
    question without a label is not trained on yet is answered (503 tokens), so predict grows its rows."""
    workdir = tmp_path / "valen"
    run_train("configs/valen.py:hf", workdir, f"--config.model.init_from={base[0]}",
              f"--config.data.tokenizer={base[0]}", "--config.train.steps=1", "--config.train.checkpoint_every=1",
              "--config.train.warmup_steps=0", "--config.model.dtype=float32", "--config.eval.every=0",
              "--config.eval.at_end=False", "--config.data.seq_len=384", "--config.data.max_patches=64",
              "--config.data.max_questions=3", "--config.data.max_candidates=5", timeout=900)
    answers = tmp_path / "answers.jsonl"
    _cli("valen_jax.predict", f"--workdir={workdir}", f"--data={VALEN}", f"--output={answers}")
    lines = [json.loads(line) for line in answers.read_text().splitlines()]
    records = [json.loads(line) for line in VALEN.read_text().splitlines() if line.strip()]
    assert [line["record_id"] for line in lines] == [r["meta"]["record_id"] for r in records]
    assert '"type": "video_url"' in VALEN.read_text()  # a whole clip went through the tower and M-RoPE
    for line, record in zip(lines, records, strict=True):
        assert set(line["answers"]) == set(record["request"]["questions"])
        for answer in line["answers"].values():
            assert math.isclose(sum(answer["probabilities"].values()), 1.0, abs_tol=1e-9)

