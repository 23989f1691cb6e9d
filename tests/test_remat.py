"""config.model.remat policies (issue 14): same loss and gradients under each; old boolean metas still load."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import chat
from valen_jax.config.schema import ConfigError, validate_config
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import Transformer
from valen_jax.training.losses import head_token_losses

TINY = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)


def _loss_and_grads(cfg: ModelConfig):
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    positions = jnp.tile(jnp.arange(12, dtype=jnp.int32), (2, 1))
    segments = jnp.asarray([[1] * 7 + [2] * 5, [1] * 10 + [0] * 2], jnp.int32)  # packed and padded rows

    def loss(p):
        model = nnx.merge(graphdef, p)
        hidden = model.hidden(tokens, positions, segments)
        sums = head_token_losses(hidden, model.head_matrix(), jnp.roll(tokens, -1, 1), (segments > 0) * 1.0)
        return sums["ce"] / sums["weight"]

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow
def test_every_remat_policy_gives_the_same_loss_and_gradients():
    # Scanned layers, as the :hf variants run. `offload` is refused on CPU (below), so it is not here.
    want_loss, want_grads = _loss_and_grads(dataclasses.replace(TINY, scan_layers=True))
    for policy in ("full", "save_dots"):
        loss, grads = _loss_and_grads(dataclasses.replace(TINY, scan_layers=True, remat=policy))
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6, err_msg=policy)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=policy)


def test_boolean_remat_of_older_checkpoint_metas_loads_as_a_policy_name():
    meta = TINY.to_json()
    assert meta["remat"] == "none"
    assert ModelConfig.from_json({**meta, "remat": True}).remat == "full"
    assert ModelConfig.from_json({**meta, "remat": False}) == TINY
    with pytest.raises(ValueError, match="remat='some'; choose one of none, full, save_dots, offload"):
        dataclasses.replace(TINY, remat="some")


def test_offload_is_refused_on_cpu_when_the_step_is_traced():
    # JAX lowers host transfers to nothing on CPU: offload would silently be save_dots there.
    assert jax.default_backend() == "cpu"
    with pytest.raises(ConfigError, match="remat='offload' moves saved activations to pinned host memory, which "
                                          "the cpu backend does not do"):
        _loss_and_grads(dataclasses.replace(TINY, remat="offload"))


def test_config_schema_names_the_remat_choices():
    config = chat.get_config("tiny")
    config.model.remat = "save_dot"
    with pytest.raises(ConfigError, match="config.model.remat='save_dot'; choose one of none, full, save_dots, offload"):
        validate_config(config)
    assert chat.get_config("hf").model.remat == "full"
