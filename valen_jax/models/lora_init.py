"""A LoRA model's parameters from its base's: fresh adapters beside the base weights, the base quantised to
NF4 under QLoRA. One place for the HF import (`hf.from_pretrained`) and a run's start (`build.initial_params`)."""

from __future__ import annotations

import jax
from flax import nnx

from valen_jax.models import lora, sharding
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import Transformer, abstract_model


def base_shardings(model_cfg: ModelConfig, shardings) -> dict:
    """The shardings of `model_cfg`'s base (no adapters, float weights) on the mesh of `shardings`."""
    mesh = jax.tree.leaves(shardings)[0].mesh
    return nnx.to_pure_dict(sharding.state_shardings(abstract_model(lora.base_config(model_cfg))[1], mesh))


def adapter_shapes(model_cfg: ModelConfig) -> dict:
    """The adapter leaves of `model_cfg`'s parameters as shapes (nothing allocated)."""
    return lora.adapter_tree(nnx.to_pure_dict(abstract_model(model_cfg)[1]))


def attach(base: dict, model_cfg: ModelConfig, shardings, seed: int, adapters: dict | None = None) -> dict:
    """`base` (the parameters of `lora.base_config(model_cfg)`, donated) with fresh adapters (A uniform, B = 0:
    the model starts as its base), or the host arrays `adapters` (a PEFT adapter read back,
    `peft_adapter.load_adapter`), quantised first when `model_cfg.lora.quantize_base` is nf4."""

    def fresh_adapters():
        return lora.adapter_tree(nnx.to_pure_dict(nnx.split(Transformer(model_cfg, nnx.Rngs(seed)))[1]))

    if adapters is None:
        # Only the adapters are outputs, so XLA never materialises the fresh base it traces past.
        fresh = jax.jit(fresh_adapters, out_shardings=lora.adapter_tree(shardings))()
    else:  # already in the adapters' dtypes (`load_adapter` casts to its template's)
        fresh = jax.device_put(adapters, lora.adapter_tree(shardings))

    def combine(b, a):
        if model_cfg.lora.quantize_base == "nf4":
            b = lora.quantise_base(b, model_cfg)
        return lora.with_adapters(b, a)

    # The float base is donated where its buffers can hold the result (not NF4's codes).
    donate = (0,) if model_cfg.lora.quantize_base == "none" else ()
    return jax.jit(combine, out_shardings=shardings, donate_argnums=donate)(base, fresh)
