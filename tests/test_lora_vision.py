"""LoRA on a vision-language model's tower: `vision/` targets put adapters on the tower's blocks and merger,
which train while the tower's base passes through each step bit for bit; a name the tower lacks is refused;
a fresh tower (no checkpoint holds it) trains in full and is saved with the adapters."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.test_lora import flat, lora_params, train_cfg
from valen_jax.errors import ConfigError
from valen_jax.models import build, lora, sharding
from valen_jax.models.config import ModelConfig, VisionConfig
from valen_jax.training import checkpoint
from valen_jax.training.step import StepOptions, TrainLayout, make_train_step

VOCAB, SEQ, BATCH, PAD = 128, 16, 2, 5
GRID = 4  # one 4 × 4-patch image per row: 16 patches, 4 merged vision tokens
TOWERS = {
    "qwen2_5_vl": ("vision/qkv", "vision/proj", "vision/gate", "vision/up", "vision/down", "vision/merge_in",
                   "vision/merge_out"),
    "valen": ("vision/q", "vision/o", "vision/down", "vision/merge_in", "vision/merge_out"),
}


def vl_cfg(family: str, targets=(), param_dtype="float32") -> ModelConfig:
    vision = VisionConfig(patch_size=2, merge_size=2, temporal_patch_size=2, dim=32, num_layers=2, num_heads=2,
                          mlp_dim=48, family=family)
    adapters = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.ATTENTION + lora.MLP + tuple(targets))
    return ModelConfig(vocab_size=VOCAB, dim=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=128,
                       tie_embeddings=False, image_pad_id=PAD, vision=vision, lora=adapters, param_dtype=param_dtype)


def vl_batch(cfg: ModelConfig) -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, VOCAB, (BATCH, SEQ)).astype(np.int32)
    tokens[:, 2:2 + GRID * GRID // 4] = PAD  # the media slots the merged vision tokens fill
    rows, columns = np.divmod(np.arange(GRID * GRID), GRID)
    # The processor's order: each run of merge² = 4 patches is one 2 × 2 window.
    order = np.argsort((rows // 2) * 100 + (columns // 2) * 10 + (rows % 2) * 2 + columns % 2, kind="stable")
    positions = np.stack([np.zeros(GRID * GRID), rows, columns], -1)[order].astype(np.int32)
    weights = np.ones((BATCH, SEQ), np.float32)
    weights[tokens == PAD] = 0
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "target_weights": weights,
            "positions": np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1)),
            "segment_ids": np.ones((BATCH, SEQ), np.int32),
            "patches": rng.normal(size=(BATCH, GRID * GRID, cfg.vision.patch_dim)).astype(np.float32),
            "patch_positions": np.tile(positions, (BATCH, 1, 1)),
            "patch_segments": np.ones((BATCH, GRID * GRID), np.int32)}


def _steps(cfg: ModelConfig, count: int = 2):
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    layout = TrainLayout.from_config(cfg, train_cfg(vision_lr_multiplier=0.5), mesh)
    params = lora_params(cfg, mesh, layout.param_shardings)
    before = flat(params)
    state = {"params": params, "opt_state": layout.tx.init(params), "step": jnp.zeros((), jnp.int32)}
    step = jax.jit(make_train_step(layout.graphdef, layout.tx, layout.schedule, StepOptions(frozen=layout.frozen)))
    with jax.set_mesh(mesh):
        for _ in range(count):
            state, metrics = step(state, vl_batch(cfg))
    assert np.isfinite(float(metrics["loss"]))
    return layout, before, flat(state["params"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "valen"])
def test_tower_targets_train_tower_adapters_and_leave_the_tower_base_bit_for_bit(family):
    """Weight decay 0: an adapter that changes had a non-zero gradient (Adam moves nothing on zero)."""
    cfg = vl_cfg(family, TOWERS[family])
    layout, before, after = _steps(cfg)
    tower = [p for p in before if p.startswith("vision/") and lora.is_adapter(p)]
    blocks = len(TOWERS[family]) - 2  # per-block targets; the merger's two once
    assert len(tower) == 2 * (blocks * cfg.vision.num_layers + 2), tower
    for path, value in before.items():
        if lora.is_adapter(path):
            assert not np.array_equal(value, after[path]), path
        else:  # the tower's base (qkv, proj, merge_in, ...) as much as the decoder's: the same bits
            assert value.tobytes() == after[path].tobytes(), path
    adapter_size = sum(before[p].size for p in before if lora.is_adapter(p))
    assert sum(x.size for x in jax.tree.leaves(layout.state_shapes["opt_state"]) if x.ndim) == 2 * adapter_size
    # The tower's adapters are saved with the decoder's.
    saved = {p[len("params/"):] for p in checkpoint.paths_of(layout.saved_abstract_state()) if p.startswith("params/")}
    assert set(tower) <= saved


def test_a_tower_target_the_tower_lacks_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"config.model.lora.targets=.*the qwen2_5_vl vision tower has no 'fc1'; "
                                          r"its linear layers are vision/qkv, vision/proj"):
        vl_cfg("qwen2_5_vl", ("vision/fc1",))
    with pytest.raises(ConfigError, match=r"the valen vision tower has no 'qkv'"):
        vl_cfg("valen", ("vision/qkv",))
    with pytest.raises(ConfigError, match=r"config.model.lora.targets=\('vision/qkv',\): the model has no vision tower"):
        ModelConfig(vocab_size=VOCAB, dim=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=128,
                    lora=lora.LoraConfig(targets=("vision/qkv",)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "valen"])
def test_tower_adapter_dropout_acts_with_a_training_key_alone(family):
    """Adapters on the tower alone (none in the decoder), dropout 0.5: a training key changes the hidden
    states (so the tower's adapters drop their inputs), each key its own masks; no key is the plain model."""
    from flax import nnx

    from valen_jax.models.transformer import abstract_model

    cfg = dataclasses.replace(vl_cfg(family), lora=lora.LoraConfig(rank=4, alpha=8.0, targets=TOWERS[family],
                                                                   dropout=0.5))
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    params = lora_params(cfg, mesh, TrainLayout.from_config(cfg, train_cfg(), mesh).param_shardings)
    assert not any(lora.is_adapter(p) for p in flat(params) if not p.startswith("vision/"))
    data = vl_batch(cfg)

    @jax.jit
    def hidden(params, key):
        model = nnx.merge(abstract_model(cfg)[0], params)
        inputs = (data["patches"], data["patch_positions"], data["patch_segments"])
        return model.hidden(data["tokens"], data["positions"], data["segment_ids"], inputs, lora_key=key)

    with jax.set_mesh(mesh):
        one, again, other = (np.asarray(hidden(params, jax.random.key(k))) for k in (1, 1, 2))
        plain = np.asarray(hidden(params, None))
        without = np.asarray(jax.jit(lambda p: nnx.merge(abstract_model(dataclasses.replace(
            cfg, lora=dataclasses.replace(cfg.lora, dropout=0.0)))[0], p).hidden(
            data["tokens"], data["positions"], data["segment_ids"],
            (data["patches"], data["patch_positions"], data["patch_segments"])))(params))
    assert not np.allclose(one, plain, atol=1e-4) and not np.allclose(one, other, atol=1e-4)
    np.testing.assert_array_equal(one, again)
    np.testing.assert_array_equal(plain, without)


def _stub(init_from: str = "") -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"model": {"init_from": init_from}})


@pytest.mark.slow
def test_a_fresh_tower_trains_in_full_and_is_saved_while_the_decoder_base_stays_frozen():
    """A model from scratch with a tower (a text checkpoint gets none, issue 54): the tower has nothing pretrained,
    so under LoRA it trains at config.train.vision_lr_multiplier beside the adapters, its leaves and their
    moments in the checkpoint."""
    cfg = build._fresh_tower_trains(_stub(), vl_cfg("qwen2_5_vl"))
    assert cfg.lora.train_vision
    layout, before, after = _steps(cfg)
    tower = [p for p in before if p.startswith("vision/")]
    saved = {p[len("params/"):] for p in checkpoint.paths_of(layout.saved_abstract_state()) if p.startswith("params/")}
    moments = {p.split("/mu/", 1)[1] for p in checkpoint.paths_of(layout.saved_abstract_state()) if "/mu/" in p}
    assert set(tower) <= saved and set(tower) <= moments
    assert not any(p.startswith("layers/") and not lora.is_adapter(p) for p in saved) and "embed" not in saved
    for path in before:
        changed = not np.array_equal(before[path], after[path])
        # Every tower matrix moves (norm scales and biases may sit at a zero gradient); the base does not.
        if path.startswith("vision/") and before[path].ndim >= 2:
            assert changed, path
        elif not path.startswith("vision/") and not lora.is_adapter(path):
            assert not changed, path
    # Its adapters would be redundant: refused; so is a bf16 tower (master weights).
    with pytest.raises(ConfigError, match=r"names the vision tower, but it is fresh"):
        build._fresh_tower_trains(_stub(), vl_cfg("qwen2_5_vl", ("vision/qkv",)))
    with pytest.raises(ConfigError, match=r"config.model.param_dtype=bfloat16: the vision tower is fresh "
                                          r"\(config.model.init_from is unset\)"):
        build._fresh_tower_trains(_stub(), vl_cfg("qwen2_5_vl", param_dtype="bfloat16"))
    # No LoRA, or no tower: unchanged.
    plain = dataclasses.replace(vl_cfg("qwen2_5_vl"), lora=None)
    assert build._fresh_tower_trains(_stub(), plain) is plain
