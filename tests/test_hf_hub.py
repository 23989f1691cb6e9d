"""`from_pretrained("ORG/NAME")`: a hub name resolves through a real Hugging Face cache layout, offline.

The cache is built by hand the way huggingface_hub lays it out (`models--ORG--NAME/refs/<branch>`
holding a commit hash, `snapshots/<commit>/<file>` linking into `blobs/<sha256>`), so the test runs
without network; `HF_HUB_OFFLINE=1` makes any attempt to reach the hub an error.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

from valen_jax.models import hf  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
FAMILIES = {"qwen2": (transformers.Qwen2Config, "tiny-qwen2"), "llama": (transformers.LlamaConfig, "tiny-llama")}
ORG = "valen-test"
MAIN, V2 = "a" * 40, "b" * 40  # commit hashes: 40 hex digits, as the hub's


def _save_random(family: str, seed: int, directory: Path) -> Path:
    config_cls, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**COMMON, tie_word_embeddings=False)).float()
    model.save_pretrained(directory)
    return directory


def _add_commit(cache: Path, repo_id: str, commit: str, ref: str, files: Path) -> None:
    """`files` as the snapshot of `commit` of `repo_id`, with the branch or tag `ref` pointing at it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(files.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)  # no trailing newline, as huggingface_hub writes it


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache that huggingface_hub uses, offline. It reads both settings into
    `huggingface_hub.constants` at import time and looks them up there at call time, so the
    constants are patched along with the environment (for anything started from here)."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def _logits(model) -> np.ndarray:
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, COMMON["vocab_size"], (2, 24)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s: nnx.merge(graphdef, s)(tokens, positions, jnp.ones_like(tokens)))(state))


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.slow), "qwen2"])
def test_a_hub_name_loads_the_cached_snapshot_like_the_local_directory(family, tmp_path, offline_cache):
    repo_id = f"{ORG}/{FAMILIES[family][1]}"
    main = _save_random(family, 0, tmp_path / "main")
    v2 = _save_random(family, 1, tmp_path / "v2")
    _add_commit(offline_cache, repo_id, MAIN, "main", main)
    _add_commit(offline_cache, repo_id, V2, "v2", v2)

    expected_main = _logits(hf.from_pretrained(main)[0])
    expected_v2 = _logits(hf.from_pretrained(v2)[0])
    assert np.abs(expected_main - expected_v2).max() > 1e-3  # the two commits are told apart

    assert hf.resolve(repo_id) == offline_cache / f"models--{ORG}--{FAMILIES[family][1]}" / "snapshots" / MAIN
    model, cfg = hf.from_pretrained(repo_id)
    assert cfg.attention_bias == (family == "qwen2")
    np.testing.assert_array_equal(_logits(model), expected_main)
    np.testing.assert_array_equal(_logits(hf.from_pretrained(repo_id, revision="v2")[0]), expected_v2)
    np.testing.assert_array_equal(_logits(hf.from_pretrained(repo_id, revision=MAIN)[0]), expected_main)
    np.testing.assert_array_equal(_logits(hf.from_pretrained(repo_id, revision=V2)[0]), expected_v2)


def test_an_unknown_name_or_revision_is_an_error_naming_it(tmp_path, offline_cache):
    repo_id = f"{ORG}/tiny-qwen2"
    _add_commit(offline_cache, repo_id, MAIN, "main", _save_random("qwen2", 0, tmp_path / "main"))

    with pytest.raises(FileNotFoundError, match=f"model '{ORG}/no-such-model'.*HF_HUB_OFFLINE") as error:
        hf.from_pretrained(f"{ORG}/no-such-model")
    assert str(offline_cache) in str(error.value)
    with pytest.raises(FileNotFoundError, match=f"model '{repo_id}' at revision 'no-such-branch'"):
        hf.from_pretrained(repo_id, revision="no-such-branch")
    with pytest.raises(FileNotFoundError, match=f"model '{repo_id}' at revision '{'c' * 40}'"):
        hf.from_pretrained(repo_id, revision="c" * 40)


def test_a_missing_local_path_or_a_file_is_not_mistaken_for_a_hub_name(tmp_path, offline_cache):
    missing = tmp_path / "no" / "such" / "checkpoint"
    with pytest.raises(FileNotFoundError, match=f"'{missing}': no such local directory, and not a hub model name"):
        hf.from_pretrained(missing)
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(hf.HFImportError, match="a file, not a checkpoint directory"):
        hf.from_pretrained(file)
    local = _save_random("qwen2", 0, tmp_path / "local")
    with pytest.raises(hf.HFImportError, match="a local directory has no revisions"):
        hf.from_pretrained(local, revision="main")
