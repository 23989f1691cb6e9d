"""A LoRA model against transformers (f32, CPU): its merged export, and PEFT loading our adapter folder onto
the base, give our logits (≤ 1e-4), per text family; the adapters perturbed so they are far from zero."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.test_hf_parity import COMMON, _our_logits, _random_hf_model, _torch_logits  # noqa: E402
from valen_jax.models import hf, lora, peft_adapter  # noqa: E402
from valen_jax.training.optim import path_of  # noqa: E402

# The rank 8 of every linear layer, alpha 16: the update (alpha/r)·A·B is of the order of the weights.
ADAPTERS = lora.LoraConfig(rank=8, alpha=16.0)


def _perturbed(model):
    """B random (fresh adapters have B = 0, and a zero adapter would pass any mapping)."""
    graphdef, state = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(3), 256))
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype) if path_of(p).endswith(lora.SUFFIX_B)
        else x, nnx.to_pure_dict(state))
    return nnx.merge(graphdef, params)


@pytest.mark.parametrize("family,scan_layers", [("qwen2", False), ("qwen3", True), ("llama", False)])
def test_merged_export_and_the_peft_adapter_give_our_logits(family, scan_layers, tmp_path):
    base = _random_hf_model(family, tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", scan_layers=scan_layers, lora=ADAPTERS)
    ids = np.random.default_rng(4).integers(0, COMMON["vocab_size"], (1, 300))
    base_logits = _torch_logits(base, ids)
    np.testing.assert_allclose(_our_logits(model, ids), base_logits, atol=1e-4)  # B = 0: the base itself
    model = _perturbed(model)
    ours = _our_logits(model, ids)
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapters change the function

    hf.save_pretrained(model, tmp_path / "merged", family=family)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    assert np.abs(_torch_logits(merged, ids) - ours).max() <= 1e-4

    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    peft_adapter.save_adapter(cfg, params, tmp_path / "adapter", base=str(tmp_path / "hf"))
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    # Every targeted linear layer is wrapped, and every tensor we wrote was loaded (none left at init).
    assert len([m for m in adapted.modules() if isinstance(m, peft.tuners.lora.Linear)]) == 7 * cfg.num_layers
    assert np.abs(_torch_logits(adapted, ids) - ours).max() <= 1e-4


@pytest.mark.slow  # a VL forward compiled twice, two transformers loads
def test_a_qwen2_5_vl_lora_model_equals_its_merged_export_and_its_peft_adapter(tmp_path):
    """Qwen2.5-VL with adapters on its decoder (images and a video through the frozen tower): our logits
    equal the merged export in transformers and PeftModel over the base (PEFT's names under
    `model.language_model`)."""
    from tests.test_hf_vl_parity import (
        IMAGE_GRIDS,
        VIDEO_GRIDS,
        _config,
        _hf_logits,
        _our_logits,
        _pixels,
        _prompt,
    )

    torch.manual_seed(0)
    hf_model = transformers.Qwen2_5_VLForConditionalGeneration(_config("qwen2_5_vl")).float().eval()
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if parameter.ndim == 1:
                base = 1.0 if ("norm" in name or "ln_q" in name) and name.endswith("weight") else 0.0
                parameter.copy_(base + 0.3 * torch.randn_like(parameter))
    hf_model.save_pretrained(tmp_path / "hf")
    ids, images, videos = _prompt("qwen2_5_vl"), _pixels(IMAGE_GRIDS, 2), _pixels(VIDEO_GRIDS, 3)
    base_logits = _hf_logits(hf_model, ids, images, videos)

    model, cfg = hf.from_pretrained(tmp_path / "hf", lora=ADAPTERS)
    model = _perturbed(model)
    ours = _our_logits(model, ids, images, videos)
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapters change the function

    hf.save_pretrained(model, tmp_path / "merged")
    merged = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp_path / "merged", attn_implementation="eager").float().eval()
    assert np.abs(_hf_logits(merged, ids, images, videos) - ours).max() <= 1e-4

    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    peft_adapter.save_adapter(cfg, params, tmp_path / "adapter", base=str(tmp_path / "hf"))
    adapted = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    # Only the decoder's linear layers are wrapped (the tower keeps its own qkv/proj untouched).
    assert len([m for m in adapted.modules() if isinstance(m, peft.tuners.lora.Linear)]) == 7 * cfg.num_layers
    assert np.abs(_hf_logits(adapted, ids, images, videos) - ours).max() <= 1e-4
