"""Logits parity with transformers (torch, CPU, f32) for tiny random Qwen2, Qwen3 and Llama models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from valen_jax.models import hf  # noqa: E402

PROMPT_LENGTH = 600  # ≥ 512, and past Llama's original context below so RoPE scaling matters
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2)
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=False, rope_theta=1000000.0)),
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128})),
}


def _random_hf_model(family: str, directory):
    config_cls, extra = FAMILIES[family]
    config = config_cls(**COMMON, **extra, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        # HF initialises norms to one and biases to zero; randomise them so a wrong mapping shows.
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.copy_(1.0 + 0.3 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    return model


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def _our_logits(model, ids):
    tokens = jnp.asarray(ids, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p, jnp.ones_like(t)))
    return np.asarray(forward(state, tokens, positions))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("scan_layers", [False, True])
def test_import_matches_transformers_logits(family, scan_layers, tmp_path):
    reference = _random_hf_model(family, tmp_path / "hf")
    ids = np.random.default_rng(1).integers(0, COMMON["vocab_size"], (2, PROMPT_LENGTH))
    model, cfg = hf.from_pretrained(tmp_path / "hf", scan_layers=scan_layers)
    assert cfg.qk_norm == (family == "qwen3") and cfg.attention_bias == (family == "qwen2")
    assert (cfg.rope_scaling is not None) == (family == "llama")
    expected = _torch_logits(reference, ids)
    ours = _our_logits(model, ids)
    assert ours.shape == expected.shape
    assert np.abs(ours - expected).max() <= 1e-4, np.abs(ours - expected).max()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_round_trip_loads_in_transformers_with_the_same_logits(family, tmp_path):
    _random_hf_model(family, tmp_path / "hf")
    model, _ = hf.from_pretrained(tmp_path / "hf", scan_layers=family == "llama")
    hf.save_pretrained(model, tmp_path / "export", family=family)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager",
                                                                 dtype=torch.float32).eval()
    ids = np.random.default_rng(2).integers(0, COMMON["vocab_size"], (1, 520))
    assert np.abs(_torch_logits(reloaded, ids) - _our_logits(model, ids)).max() <= 1e-4


def test_unsupported_families_are_refused():
    with pytest.raises(hf.HFImportError, match="model_type 'gpt2'"):
        hf.config_from_hf({"model_type": "gpt2"})
    with pytest.raises(hf.HFImportError, match="sliding-window"):
        hf.config_from_hf({"model_type": "qwen2", "use_sliding_window": True})


def test_added_token_rows_follow_the_documented_rule(tmp_path):
    reference = _random_hf_model("llama", tmp_path / "hf")
    base = COMMON["vocab_size"]
    pieces = {base: [1, 2, 3], base + 1: [7], 5: [9, 10]}  # id 5: a spare row re-initialised too
    cfg = hf.config_from_hf(__import__("json").loads((tmp_path / "hf" / "config.json").read_text()))
    cfg = __import__("dataclasses").replace(cfg, vocab_size=base + 128)
    from valen_jax.models import sharding
    from valen_jax.models.transformer import abstract_model
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    shardings = nnx.to_pure_dict(sharding.state_shardings(abstract_model(cfg)[1], mesh))
    params = hf.load_params(tmp_path / "hf", cfg, shardings, pieces)
    table = reference.model.embed_tokens.weight.detach().numpy()
    head = reference.lm_head.weight.detach().numpy()
    embed, lm_head = np.asarray(params["embed"]), np.asarray(params["lm_head"]).T
    for ours, theirs in ((embed, table), (lm_head, head)):
        np.testing.assert_allclose(ours[base], theirs[[1, 2, 3]].mean(axis=0), rtol=1e-6)
        np.testing.assert_allclose(ours[base + 1], theirs[7], rtol=1e-6)
        np.testing.assert_allclose(ours[5], theirs[[9, 10]].mean(axis=0), rtol=1e-6)
        np.testing.assert_allclose(ours[base + 50], theirs.mean(axis=0), rtol=1e-5)
        np.testing.assert_array_equal(ours[6:base], theirs[6:base])
    with pytest.raises(hf.HFImportError, match="not checkpoint tokens"):
        hf.load_params(tmp_path / "hf", cfg, shardings, {base: [base + 3]})
