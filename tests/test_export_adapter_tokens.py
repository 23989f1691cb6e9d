"""A LoRA model whose tokenizer added tokens (VFlash's `<0>`…`<1000>` and tags: rows grown by
`hf_common.extend_rows`) exported as a PEFT adapter folder: the base loaded in transformers, resized to the
tokenizer's length as transformers resizes it (new rows drawn at random), plus `PeftModel.from_pretrained`,
gives our logits and the merged export's (≤ 1e-4, f32), tied head (Qwen2) and untied (Llama); the rows
travel as PEFT's `trainable_token_indices` and nothing else of the embedding."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.test_hf_parity import COMMON, _our_logits, _random_hf_model, _torch_logits  # noqa: E402
from tests.test_lora_parity import ADAPTERS, _perturbed  # noqa: E402
from valen_jax.models import hf, hf_text, lora, lora_init, peft_adapter, sharding  # noqa: E402
from valen_jax.models.config import padded_vocab  # noqa: E402
from valen_jax.models.transformer import abstract_model  # noqa: E402

ADDED = 40  # tokens the training tokenizer adds after the checkpoint's 512


def _grown_lora_model(directory, scan_layers: bool):
    """Our LoRA model over the checkpoint in `directory` with ADDED rows appended by rule, as a run whose
    tokenizer added tokens builds it (models/build.py): (model, cfg, the tokenizer's length)."""
    vocabulary = COMMON["vocab_size"] + ADDED
    cfg = hf.config_from_hf(json.loads((directory / "config.json").read_text()), scan_layers=scan_layers,
                            lora=ADAPTERS)
    cfg = dataclasses.replace(cfg, vocab_size=padded_vocab(vocabulary))
    pieces = {COMMON["vocab_size"] + i: [(3 * i) % COMMON["vocab_size"], (7 * i + 1) % COMMON["vocab_size"]]
              for i in range(ADDED)}
    graphdef, abstract = abstract_model(cfg)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
    base = hf_text.load_params(directory, lora.base_config(cfg), lora_init.base_shardings(cfg, shardings), pieces)
    return nnx.merge(graphdef, lora_init.attach(base, cfg, shardings, seed=0)), cfg, vocabulary


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_adapter_carries_the_added_tokens_rows(family, tmp_path):
    _random_hf_model(family, tmp_path / "hf")
    model, cfg, vocabulary = _grown_lora_model(tmp_path / "hf", scan_layers=family == "qwen2")
    model = _perturbed(model)
    # Every prompt holds added tokens: their rows are what the adapter must carry.
    ids = np.random.default_rng(4).integers(0, vocabulary, (1, 200))
    ids[0, ::5] = np.arange(COMMON["vocab_size"], vocabulary)
    ours = _our_logits(model, ids)[..., :vocabulary]

    hf.save_pretrained(model, tmp_path / "merged", family=family)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert np.abs(_torch_logits(merged, ids)[..., :vocabulary] - ours).max() <= 1e-4

    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    carried = peft_adapter.save_adapter(cfg, params, tmp_path / "adapter", base=str(tmp_path / "hf"),
                                        vocabulary=vocabulary)
    assert carried == ADDED  # the added rows, no row of the checkpoint's own
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    added = list(range(COMMON["vocab_size"], vocabulary))
    assert saved["trainable_token_indices"] == (added if family == "qwen2" else
                                                {"embed_tokens": added, "lm_head": added})

    # The user's recipe (export.py's docstring): the base, resized as transformers resizes it, then PEFT.
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    base.resize_token_embeddings(vocabulary)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert np.abs(_torch_logits(adapted, ids) - ours).max() <= 1e-4

    # Our own reader (config.model.lora.init_adapter) reads the adapters and leaves the rows to the rule.
    read = peft_adapter.load_adapter(cfg, tmp_path / "adapter", lora_init.adapter_shapes(cfg))
    for got, want in zip(jax.tree.leaves(read), jax.tree.leaves(lora.adapter_tree(params)), strict=True):
        np.testing.assert_array_equal(got, want)
