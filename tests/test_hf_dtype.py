"""`hf.from_pretrained` takes a dtype as a name or as a JAX/NumPy dtype ('What users see', issue 12)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from valen_jax.models import hf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("dtype, name", [(jnp.float32, "float32"), (jnp.bfloat16, "bfloat16"),
                                         (np.float32, "float32"), ("bfloat16", "bfloat16")])
def test_from_pretrained_accepts_dtype_objects_and_names(tiny_qwen2, dtype, name):
    model, cfg = hf.from_pretrained(tiny_qwen2, dtype=dtype, param_dtype=jnp.float32)
    assert (cfg.dtype, cfg.param_dtype) == (name, "float32")
    assert model.cfg.dtype == name


def test_from_pretrained_refuses_what_is_not_a_dtype(tiny_qwen2):
    with pytest.raises(hf.HFImportError, match="neither a dtype name"):
        hf.from_pretrained(tiny_qwen2, dtype=object())
