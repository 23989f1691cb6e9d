"""A run with no checkpoint in its workdir starts from the configured HF checkpoint."""

from __future__ import annotations

import json

import pytest

from tests.own_data import OWN_TRAIN, tiny_qwen2, write_chat
from tests.train_runs import metrics, run_train

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


def _base_model(directory):
    from data_pipeline.chat_templates import CHATML

    return tiny_qwen2(directory, [], CHATML)


def test_training_starts_from_an_hf_checkpoint_with_added_tokens(tmp_path):
    base = tmp_path / "base"
    base_vocab = _base_model(base)
    # Seed 000: unset media_kwargs come from the base model's processor files; the config's win.
    (base / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 512, "longest_edge": 2048},
                                                                      "image_mean": [0.25, 0.5, 0.75]}))
    (base / "video_preprocessor_config.json").write_text(json.dumps({"fps": 1.0, "max_frames": 6}))
    workdir = tmp_path / "run"
    # A text checkpoint trains on text (issue 54: it gets no vision tower, so VFlash's image rows are refused);
    # its processor files still state the run's media_kwargs.
    # Short rows: this tokenizer learnt its merges from VFlash prompts only.
    train = write_chat(tmp_path / "own.jsonl", [row for row in OWN_TRAIN if "tools" not in row])
    result = run_train("configs/chat.py:hf", workdir, f"--config.model.init_from={base}",
                       f"--config.data.tokenizer={base}", f"--config.data.train={train}", "--config.data.eval=None",
                       "--config.train.steps=2", "--config.train.log_every=1",
                       "--config.train.checkpoint_every=2", "--config.train.warmup_steps=1",
                       "--config.model.dtype=float32", "--config.data.global_batch=8",
                       "--config.data.seq_len=512", "--config.media_kwargs.max_frames=3")
    assert "initialising from" in result.stderr and "added token rows" in result.stderr
    assert "evaluated: nothing (config.data.eval=None)" in result.stderr
    logged = metrics(workdir)
    assert [m["step"] for m in logged] == [1, 2] and all(m["loss"] == m["loss"] for m in logged)
    from valen_jax.training import checkpoint
    meta = checkpoint.restore_meta(checkpoint.manager(workdir, read_only=True), 2)
    assert meta["model"]["dim"] == 64 and meta["model"]["attention_bias"] and meta["model"]["scan_layers"]
    assert meta["model"]["vision"] is None
    assert meta["model"]["vocab_size"] >= base_vocab + 1028
    assert meta["media_kwargs"] == {"min_pixels": 512, "max_pixels": 2048, "fps": 1.0, "max_frames": 3,
                                    "min_frames": 1, "image_mean": [0.25, 0.5, 0.75], "image_std": [0.5, 0.5, 0.5],
                                    "video_min_pixels": 1024, "video_max_pixels": 4096, "video_pixels_per": "frame"}
    assert meta["media_kwargs_sources"] == {"min_pixels": "preprocessor_config.json", "max_pixels":
                                            "preprocessor_config.json", "fps": "video_preprocessor_config.json",
                                            "max_frames": "config", "min_frames": "smoke default",
                                            "image_mean": "preprocessor_config.json",
                                            "image_std": "smoke default", "video_min_pixels": "smoke default",
                                            "video_max_pixels": "smoke default",
                                            "video_pixels_per": "smoke default"}


def test_architecture_fields_next_to_init_from_are_refused(tmp_path):

    result = run_train("configs/vflash.py:tiny", tmp_path, f"--config.model.init_from={tmp_path}", timeout=120,
                       check=False)
    assert result.returncode != 0 and "come from the checkpoint" in result.stderr
