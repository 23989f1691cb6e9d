"""LoRA and QLoRA in the train step: only adapters (and named heads) change, the base stays bit for bit,
Adam's moments exist only for what trains; the adapted model starts as its base; config.model.lora checks."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from valen_jax.config.schema import ConfigError, defaults, validate_config
from valen_jax.models import lora, lora_init, sharding
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import abstract_model, init_params
from valen_jax.training.optim import ParamGroupError, path_of
from valen_jax.training.step import StepOptions, TrainLayout, make_train_step

VOCAB, SEQ, BATCH = 128, 16, 4


def train_cfg(**overrides) -> ml_collections.ConfigDict:
    values = dict(steps=10, learning_rate=1e-2, warmup_steps=0, decay="cosine", end_learning_rate_fraction=0.1,
                  weight_decay=0.0, adam_b1=0.9, adam_b2=0.95, grad_clip_norm=1e9, param_groups=[],
                  vision_lr_multiplier=0.1)
    values.update(overrides)
    return ml_collections.ConfigDict(values)


def model_cfg(scan=False, quantize="none", score_head=False, **lora_overrides) -> ModelConfig:
    adapters = lora.LoraConfig(rank=4, alpha=8.0, quantize_base=quantize, **lora_overrides)
    return ModelConfig(vocab_size=VOCAB, dim=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=128,
                       tie_embeddings=False, scan_layers=scan, score_head=score_head, lora=adapters)


def batch() -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "target_weights": np.ones((BATCH, SEQ), np.float32),
            "positions": np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1)),
            "segment_ids": np.ones((BATCH, SEQ), np.int32), "patches": np.zeros((BATCH, 0, 0), np.float32),
            "patch_positions": np.zeros((BATCH, 0, 3), np.int32), "patch_segments": np.zeros((BATCH, 0), np.int32)}


def lora_params(cfg: ModelConfig, mesh, shardings, perturb=True) -> dict:
    """The real start (`lora_init.attach` on a float base), B then made non-zero so both A and B get gradients."""
    base = init_params(lora.base_config(cfg), 0, lora_init.base_shardings(cfg, shardings))
    params = lora_init.attach(base, cfg, shardings, seed=1)
    if perturb:
        key = iter(jax.random.split(jax.random.key(7), 64))
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.05 * jax.random.normal(next(key), x.shape, x.dtype)
            if path_of(p).endswith(lora.SUFFIX_B) else x, params)
    return params


def flat(tree) -> dict:
    return {path_of(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("scan,quantize", [pytest.param(False, "none", marks=pytest.mark.slow),
                                           pytest.param(True, "none", marks=pytest.mark.heavy),
                                           pytest.param(True, "nf4", marks=pytest.mark.heavy)])
def test_a_step_changes_only_the_adapters_and_adam_holds_moments_for_them_alone(scan, quantize):
    cfg = model_cfg(scan=scan, quantize=quantize)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    train = train_cfg(weight_decay=0.01)
    layout = TrainLayout.from_config(cfg, train, mesh)
    params = lora_params(cfg, mesh, layout.param_shardings)
    before = flat(params)
    state = {"params": params, "opt_state": layout.tx.init(params), "step": jnp.zeros((), jnp.int32)}
    step = jax.jit(make_train_step(layout.graphdef, layout.tx, layout.schedule, StepOptions(frozen=layout.frozen)))
    with jax.set_mesh(mesh):
        state, metrics = step(state, batch())
        state, metrics = step(state, batch())
    after = flat(state["params"])
    assert np.isfinite(float(metrics["loss"]))
    adapters = [p for p in before if lora.is_adapter(p)]
    assert len(adapters) == 2 * 7 * (1 if scan else 2)
    for path, value in before.items():
        if lora.is_adapter(path):
            assert not np.array_equal(value, after[path]), path
        else:  # the base, NF4 codes and maxima included: the same bits
            assert value.dtype == after[path].dtype and value.tobytes() == after[path].tobytes(), path
    if quantize == "nf4":
        assert after["layers/attn/q/codes"].dtype == np.uint8
    # Adam's two moments over the adapters' entries and nothing else.
    adapter_size = sum(before[p].size for p in adapters)
    moments = sum(x.size for x in jax.tree.leaves(layout.state_shapes["opt_state"]) if x.ndim)
    assert moments == 2 * adapter_size


def test_adapter_dropout_acts_with_a_key_alone_and_each_key_draws_its_own_masks():
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    cfg = model_cfg(dropout=0.5)
    params = lora_params(cfg, mesh, TrainLayout.from_config(cfg, train_cfg(), mesh).param_shardings)
    data = batch()

    @jax.jit
    def hidden(params, key):
        model = nnx.merge(abstract_model(cfg)[0], params)
        return model.hidden(data["tokens"], data["positions"], data["segment_ids"], lora_key=key)

    @jax.jit
    def plain(params):
        return nnx.merge(abstract_model(model_cfg())[0], params).hidden(data["tokens"], data["positions"],
                                                                        data["segment_ids"])

    with jax.set_mesh(mesh):
        one, again, other = (np.asarray(hidden(params, jax.random.key(k))) for k in (1, 1, 2))
        evaluated = np.asarray(hidden(params, None))
        without = np.asarray(plain(params))
    assert not np.allclose(one, without, atol=1e-3) and not np.allclose(one, other, atol=1e-3)
    np.testing.assert_array_equal(one, again)
    np.testing.assert_array_equal(evaluated, without)  # no key (evaluation, decoding): no dropout


@pytest.mark.heavy  # three train-step compiles (~30 s each on a loaded CPU)
@pytest.mark.parametrize("scan", [False, True])
def test_adapter_dropout_changes_the_training_forward_per_step_and_never_evaluation(scan):
    """config.model.lora.dropout: the train step's loss depends on its dropout masks (drawn from the seed and
    the step: the same step gives the same masks, another step others), while the model evaluation and
    decoding call (no key) computes what a model without dropout computes."""
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    dropped, plain = model_cfg(scan=scan, dropout=0.5), model_cfg(scan=scan)
    layout = TrainLayout.from_config(dropped, train_cfg(), mesh)
    params = lora_params(dropped, mesh, layout.param_shardings)
    data = batch()

    def losses(cfg, seed, steps):
        """The train step's loss at each of `steps` (one compile), from the same params and batch."""
        options = StepOptions(frozen=layout.frozen, lora_dropout_seed=seed)
        train_step = jax.jit(make_train_step(abstract_model(cfg)[0], layout.tx, layout.schedule, options))
        opt_state = layout.tx.init(params)
        with jax.set_mesh(mesh):
            return [float(train_step({"params": params, "opt_state": opt_state, "step": jnp.asarray(step, jnp.int32)},
                                     data)[1]["loss"]) for step in steps]

    without = losses(plain, None, [3])[0]
    at_3, again_3, at_4 = losses(dropped, 0, [3, 3, 4])
    assert at_3 != without and at_3 == again_3 and at_4 != at_3

    def logits(cfg):
        model = nnx.merge(abstract_model(cfg)[0], params)
        with jax.set_mesh(mesh):
            return np.asarray(model(data["tokens"], data["positions"], data["segment_ids"]))

    np.testing.assert_array_equal(logits(dropped), logits(plain))
    # StepOptions reads the rate from the config: a dropout stream only when the rate is > 0.
    config = ml_collections.ConfigDict({"loss": {"weights": {"tokens": 1.0}, "z_loss": 0.0, "loss_reduction": "state_mean"},
                                        "train": {"grad_accum_steps": 1, "steps": 4, "seed": 5},
                                        "model": {"lora": {"dropout": 0.1}}})
    assert StepOptions.from_config(config).lora_dropout_seed == 5
    config.model.lora.dropout = 0.0
    assert StepOptions.from_config(config).lora_dropout_seed is None


def test_a_named_extra_and_the_score_head_train_beside_the_adapters_and_a_typo_is_refused():
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    cfg = model_cfg(score_head=True, trainable=("lm_head",))
    layout = TrainLayout.from_config(cfg, train_cfg(), mesh)
    frozen = flat(layout.frozen)
    assert not frozen["lm_head"] and any(p.startswith("score_head/") for p in frozen)
    assert not any(v for p, v in frozen.items() if p.startswith("score_head/"))
    assert all(v for p, v in frozen.items() if not (lora.is_adapter(p) or p == "lm_head" or p.startswith("score_head/")))
    with pytest.raises(ParamGroupError, match=r"config.model.lora.trainable\[0\] 'lm_haed' matches no parameter"):
        TrainLayout.from_config(model_cfg(trainable=("lm_haed",)), train_cfg(), mesh)


@pytest.mark.heavy  # two models' forwards, scanned, float and NF4 (~20 s)
def test_fresh_adapters_leave_the_base_function_unchanged_and_nf4_computes_the_dequantised_base(scan=True):
    # Unscanned layers: tests/test_lora_parity.py checks fresh adapters against transformers' base.
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    tokens = jnp.asarray(batch()["tokens"])
    positions, segments = jnp.asarray(batch()["positions"]), jnp.ones_like(tokens)
    for quantize in ("none", "nf4"):
        cfg = model_cfg(scan=scan, quantize=quantize)
        graphdef, abstract = abstract_model(cfg)
        shardings = jax.tree.map(lambda _: sharding.NamedSharding(mesh, sharding.PartitionSpec()),
                                 nnx.to_pure_dict(abstract))
        base = init_params(lora.base_config(cfg), 0, lora_init.base_shardings(cfg, shardings))
        host_base = jax.tree.map(np.asarray, base)
        params = lora_init.attach(base, cfg, shardings, seed=1)
        ours = np.asarray(nnx.merge(graphdef, params)(tokens, positions, segments))
        # Reference: the plain model on the base (NF4: on the merged, i.e. dequantised, weights).
        reference_params = host_base if quantize == "none" else lora.merged(params, cfg)
        base_def = abstract_model(lora.base_config(cfg))[0]
        expected = np.asarray(nnx.merge(base_def, reference_params)(tokens, positions, segments))
        if quantize == "none":
            np.testing.assert_array_equal(ours, expected)
        else:
            np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
            plain = np.asarray(nnx.merge(base_def, host_base)(tokens, positions, segments))
            assert np.abs(plain - ours).max() > 1e-4  # NF4 is a different (rounded) base, not the float one


def _config(**lora_values) -> ml_collections.ConfigDict:
    from configs.chat import get_config

    config = get_config("tiny")
    config.model.lora = defaults("lora", **lora_values)
    return config


@pytest.mark.parametrize("values,message", [
    (dict(rank=0), r"config.model.lora.rank must be an integer ≥ 1, got 0"),
    (dict(alpha=float("nan")), r"model.lora.alpha"),
    (dict(dropout=1.0), r"config.model.lora.dropout=1.0: a probability in \[0, 1\)"),
    (dict(targets=("q", "qkv")), r"config.model.lora.targets=\('q', 'qkv'\)"),
    (dict(quantize_base="int4"), r"config.model.lora.quantize_base='int4'; choose one of none, nf4"),
    (dict(trainable=("(",)), r"config.model.lora.trainable\[0\]='\(' is not a regex"),
])
def test_a_bad_lora_group_is_one_error_naming_the_key(values, message):
    validate_config(_config())
    with pytest.raises(ConfigError, match=message):
        validate_config(_config(**values))


def test_an_unknown_lora_key_is_refused():
    config = _config()
    config.model.lora.rnak = 8
    with pytest.raises(ConfigError, match="config.model.lora has unknown keys rnak"):
        validate_config(config)


def test_the_lora_config_round_trips_through_the_checkpoint_meta():
    cfg = model_cfg(scan=True, quantize="nf4", trainable=("lm_head",))
    assert ModelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    assert ModelConfig.from_json({**dataclasses.asdict(cfg), "lora": None}).lora is None


def test_a_frozen_lora_base_may_be_bf16_while_its_adapters_stay_f32_master_weights():
    config = _config()
    config.model.param_dtype = "bfloat16"
    validate_config(config)  # the base is frozen whole: nothing of it is updated in bf16
    config.model.lora.trainable = ("lm_head",)
    with pytest.raises(ConfigError, match="param_dtype must be float32 .* unless config.model.lora freezes the base"):
        validate_config(config)
    config.model.lora = None
    with pytest.raises(ConfigError, match="master weights"):
        validate_config(config)
    abstract = nnx.to_pure_dict(abstract_model(dataclasses.replace(model_cfg(), param_dtype="bfloat16"))[1])
    shapes = {path_of(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    assert {shapes[p].dtype for p in shapes if lora.is_adapter(p)} == {np.dtype(np.float32)}
    assert shapes["layers/0/attn/q"].dtype == jnp.bfloat16


@pytest.mark.parametrize("stored,compute", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)])
def test_a_cast_weight_has_autodiffs_gradients_bit_for_bit(stored, compute):
    """`layers.cast_dense` (a weight stored in one dtype, multiplied in another: a bf16 LoRA base in an f32
    step, f32 masters in a bf16 step) casts again in its backward instead of keeping the cast copy; its
    gradients are those of autodiff through the plain cast-then-matmul."""
    from valen_jax.models.layers import cast_dense, dense

    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (2, 8, 4, 16), compute)  # in_dims=2: the o projection's [N, H] input
    w = jax.random.normal(kw, (4, 16, 32), jnp.float32).astype(stored)
    g = jax.random.normal(kg, (2, 8, 32), compute)

    def plain(w, x):
        return dense(x, w.astype(compute), 2)

    ours, ours_vjp = jax.vjp(lambda w, x: cast_dense(w, x, compute, 2), w, x)
    theirs, theirs_vjp = jax.vjp(plain, w, x)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
    for a, b in zip(jax.jit(ours_vjp)(g), jax.jit(theirs_vjp)(g), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
