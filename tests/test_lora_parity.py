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
