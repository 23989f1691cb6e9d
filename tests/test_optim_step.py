"""Schedules, parameter groups, gradient accumulation, z-loss and bf16 compute in the train step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from valen_jax.models import sharding
from valen_jax.models.config import ModelConfig, VisionConfig
from valen_jax.models.transformer import abstract_model, init_params
from valen_jax.training.optim import ParamGroupError, groups_of, learning_rate_schedule, param_labels
from valen_jax.training.step import StepOptions, TrainLayout, make_train_step

VOCAB, SEQ, BATCH = 128, 16, 8


def train_cfg(**overrides) -> ml_collections.ConfigDict:
    values = dict(steps=100, learning_rate=1e-2, warmup_steps=10, decay="cosine", end_learning_rate_fraction=0.1,
                  weight_decay=0.01, adam_b1=0.9, adam_b2=0.95, grad_clip_norm=1.0, param_groups=[],
                  vision_lr_multiplier=1.0)
    values.update(overrides)
    return ml_collections.ConfigDict(values)


def model_cfg(dtype="float32") -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                       dtype=dtype, param_dtype="float32")


def batch() -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    weights = (rng.random((BATCH, SEQ)) < 0.5).astype(np.float32)
    weights[3] = 0.0  # a row without supervised tokens: the normaliser is the whole batch's count
    weights[5, :4] = 2.0
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "target_weights": weights,
            "positions": np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1)),
            "segment_ids": np.ones((BATCH, SEQ), np.int32), "patches": np.zeros((BATCH, 0, 0), np.float32),
            "patch_positions": np.zeros((BATCH, 0, 3), np.int32), "patch_segments": np.zeros((BATCH, 0), np.int32)}


def one_step(cfg: ModelConfig, train, options: StepOptions | None = None):
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    layout = TrainLayout.from_config(cfg, train, mesh)
    if options is not None and layout.frozen is not None:
        options = StepOptions(options.loss_weights, options.z_loss, options.grad_accum_steps, layout.frozen)
    params = init_params(cfg, 0, layout.param_shardings)
    state = {"params": params, "opt_state": layout.tx.init(params), "step": jnp.zeros((), jnp.int32)}
    step = jax.jit(make_train_step(layout.graphdef, layout.tx, layout.schedule, options))
    with jax.set_mesh(mesh):
        new_state, metrics = step(state, batch())
    return params, new_state, metrics, layout


def test_cosine_and_linear_decay_after_warmup():
    cosine = learning_rate_schedule(train_cfg(decay="cosine"))
    linear = learning_rate_schedule(train_cfg(decay="linear"))
    for schedule in (cosine, linear):
        assert float(schedule(0)) == 0.0
        assert float(schedule(5)) == pytest.approx(5e-3)
        assert float(schedule(10)) == pytest.approx(1e-2)
        assert float(schedule(100)) == pytest.approx(1e-3)
    # Halfway through the decay: linear is at the midpoint, cosine too (cos(π/2) = 0) ...
    assert float(linear(55)) == pytest.approx(5.5e-3)
    assert float(cosine(55)) == pytest.approx(5.5e-3, rel=1e-5)
    # ... but a quarter in, cosine is still higher than linear.
    assert float(cosine(32)) > float(linear(32))
    with pytest.raises(ValueError, match="decay"):
        learning_rate_schedule(train_cfg(decay="step"))


def test_param_groups_match_whole_paths_first_match_wins_and_an_unmatched_pattern_is_an_error():
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                      vision=VisionConfig(patch_size=8, merge_size=2, temporal_patch_size=2, dim=32, num_layers=1,
                                          num_heads=2, mlp_dim=64))
    from flax import nnx
    shapes = nnx.to_pure_dict(abstract_model(cfg)[1])
    labels = param_labels(shapes, [{"pattern": "vision/.*", "frozen": True}, {"pattern": "embed", "lr_multiplier": 0.1},
                                   {"pattern": ".*", "lr_multiplier": 0.5}])
    assert labels["embed"] == "group1"
    assert set(jax.tree.leaves(labels["vision"])) == {"frozen"}
    assert labels["layers"][0]["attn"]["q"] == "group2"
    with pytest.raises(ParamGroupError, match="matches no parameter"):
        param_labels(shapes, [{"pattern": "visoin/.*", "frozen": True}])
    with pytest.raises(ParamGroupError, match="exactly one"):
        param_labels(shapes, [{"pattern": "embed", "frozen": True, "lr_multiplier": 0.1}])
    with pytest.raises(ParamGroupError, match="pattern"):
        param_labels(shapes, [{"pattern": "(", "frozen": True}])


def test_the_vision_tower_trains_at_its_multiplier_after_the_configured_groups_and_a_text_model_has_none():
    from flax import nnx
    vision = VisionConfig(patch_size=8, merge_size=2, temporal_patch_size=2, dim=32, num_layers=1, num_heads=2,
                          mlp_dim=64)
    shapes = nnx.to_pure_dict(abstract_model(ModelConfig(vocab_size=VOCAB, dim=32, num_layers=1, num_heads=2,
                                                         num_kv_heads=1, head_dim=16, mlp_dim=64, vision=vision))[1])
    groups = groups_of(train_cfg(vision_lr_multiplier=0.1), shapes)
    assert groups == [{"pattern": "vision/.*", "lr_multiplier": 0.1}]
    labels = param_labels(shapes, groups)
    assert set(jax.tree.leaves(labels["vision"])) == {"group0"} and labels["embed"] == "trained"
    # A configured group that matches tower parameters wins over the implicit one (first match).
    frozen = groups_of(train_cfg(vision_lr_multiplier=0.1, param_groups=[{"pattern": "vision/merge_.*", "frozen": True}]),
                       shapes)
    labels = param_labels(shapes, frozen)
    assert labels["vision"]["merge_in"] == "frozen" and labels["vision"]["patch_embed"] == "group1"
    # No tower (a text model, a drafter) or a multiplier of 1: nothing is added.
    text = nnx.to_pure_dict(abstract_model(model_cfg())[1])
    assert groups_of(train_cfg(vision_lr_multiplier=0.1), text) == []
    assert groups_of(train_cfg(vision_lr_multiplier=1.0), shapes) == []


def test_frozen_params_get_no_update_and_no_optimizer_state_and_multipliers_scale_the_step():
    groups = [{"pattern": "layers/0/.*", "frozen": True}, {"pattern": "embed", "lr_multiplier": 0.1}]
    train = train_cfg(param_groups=groups, warmup_steps=0, weight_decay=0.0, grad_clip_norm=1e9)
    before, after, metrics, layout = one_step(model_cfg(), train, StepOptions())
    for a, b in zip(jax.tree.leaves(before["layers"][0]), jax.tree.leaves(after["params"]["layers"][0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(before["layers"][1]["mlp"]["up"]),
                              np.asarray(after["params"]["layers"][1]["mlp"]["up"]))
    # Adam's first step moves every entry by ≈ lr·sign(g): 1e-2 for trained, 1e-3 for embed (× 0.1).
    layer1 = np.abs(np.asarray(after["params"]["layers"][1]["mlp"]["up"]) - np.asarray(before["layers"][1]["mlp"]["up"]))
    embed = np.abs(np.asarray(after["params"]["embed"]) - np.asarray(before["embed"]))
    assert np.max(layer1) == pytest.approx(1e-2, rel=1e-3)
    assert np.max(embed) == pytest.approx(1e-3, rel=1e-3)
    # No Adam moments are held for the frozen layer: the optimizer state is smaller by exactly its size.
    frozen_size = sum(x.size for x in jax.tree.leaves(layout.param_shapes["layers"][0]))
    all_size = sum(x.size for x in jax.tree.leaves(layout.param_shapes))
    moment_size = sum(x.size for x in jax.tree.leaves(layout.state_shapes["opt_state"]) if x.ndim)
    assert moment_size == 2 * (all_size - frozen_size)


@pytest.mark.heavy
def test_gradient_accumulation_gives_the_update_of_one_big_batch():
    # Adam's first step is lr·g/(|g|+1e-8): a gradient entry of order 1e-8, which summation order
    # changes in its last bits, moves by a visible fraction of lr. lr=1e-4 keeps that under 1e-6.
    train = train_cfg(warmup_steps=0, learning_rate=1e-4)
    _, one, metrics_one, _ = one_step(model_cfg(), train, StepOptions(grad_accum_steps=1))
    _, four, metrics_four, _ = one_step(model_cfg(), train, StepOptions(grad_accum_steps=4))
    for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(four["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    for key in ("loss", "accuracy", "target_tokens", "grad_norm"):
        assert float(metrics_one[key]) == pytest.approx(float(metrics_four[key]), rel=1e-5)


@pytest.mark.heavy
def test_z_loss_adds_its_term_to_the_total_but_not_to_the_token_loss():
    train = train_cfg()
    _, _, plain, _ = one_step(model_cfg(), train, StepOptions())
    _, _, with_z, _ = one_step(model_cfg(), train, StepOptions(z_loss=1e-2))
    assert float(with_z["loss_tokens"]) == pytest.approx(float(plain["loss_tokens"]))
    assert float(with_z["loss"]) == pytest.approx(float(plain["loss"]) + 1e-2 * float(plain["loss_z"]), rel=1e-6)


@pytest.mark.heavy
def test_a_loss_weight_scales_the_token_objective():
    _, _, half, _ = one_step(model_cfg(), train_cfg(), StepOptions(loss_weights={"tokens": 0.5, "branches": 0.0,
                                                                                   "drafter": 0.0}))
    assert float(half["loss"]) == pytest.approx(0.5 * float(half["loss_tokens"]))


def test_a_weighted_objective_the_batch_lacks_fails_when_the_step_is_traced():
    with pytest.raises(ValueError, match="branches"):
        one_step(model_cfg(), train_cfg(), StepOptions(loss_weights={"tokens": 1.0, "branches": 1.0, "drafter": 0.0}))


@pytest.mark.heavy
def test_bf16_compute_keeps_f32_master_weights_and_a_finite_loss():
    before, after, metrics, _ = one_step(model_cfg("bfloat16"), train_cfg(warmup_steps=0), StepOptions())
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert {x.dtype for x in jax.tree.leaves(after["params"])} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(after["opt_state"]) if x.ndim} == {jnp.dtype(jnp.float32)}
    assert float(optax.tree.norm(jax.tree.map(jnp.subtract, after["params"], before))) > 0
