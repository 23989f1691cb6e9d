"""VFlash's block drafter (issue 16): block marking in rows, anchors and weights, the model, the step, the config."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from data_pipeline.shards import Example
from valen_jax.config.schema import ConfigError, validate_config
from valen_jax.data.assemble import AssemblyError, RowSpec, assemble, batch_shapes_of, draft_block_of
from valen_jax.data.packing import piece_of, row_of
from valen_jax.models.config import ModelConfig
from valen_jax.models.drafter import (
    Drafter,
    DrafterConfig,
    default_target_layers,
    draft_hidden,
    propose,
    target_features,
)
from valen_jax.models.transformer import Transformer
from valen_jax.training.losses import token_losses
from valen_jax.vflash.objective import (
    DrafterOptions,
    acceptance_length,
    drafter_losses,
    drafter_targets,
    make_drafter_train_step,
    position_weights,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from configs import vflash  # noqa: E402

SPEC = RowSpec(seq_len=24, max_patches=0, image_pad_id=999, pad_id=0, vision=None, media_kwargs={})


def example(spans, blocks, length=20, weights=None) -> Example:
    arrays = {"input_ids": np.arange(1, length + 1, dtype=np.int32),
              "target_weights": np.ones(length, np.float32) if weights is None else weights,
              "primitive_spans": np.asarray(spans, np.int32).reshape(-1, 3),
              "primitive_blocks": np.asarray(blocks, np.int32).reshape(-1, 3)}
    return Example(arrays, {"source": "data.jsonl", "line": 7})


# --- blocks in rows ---------------------------------------------------------------------------------


def test_draft_block_numbers_announced_blocks_only():
    # A point (no call), one single-arm block of 4, a dual-arm pair of 3 + 3 sharing call 1 (block_size 6),
    # and a dense call whose two trajectories of 2 tokens are one block each.
    ex = example([(0, 1, 3), (4, 4, 8), (4, 9, 12), (4, 12, 15), (5, 16, 18), (5, 18, 20)],
                 [(-1, 0, 0), (0, 4, 0), (1, 6, 0), (1, 6, 0), (2, 2, 2), (2, 2, 2)])
    blocks = draft_block_of(ex)
    expected = np.zeros(20, np.int32)
    expected[4:8] = [1, 2, 3, 4]
    expected[9:15] = [1, 2, 3, 4, 5, 6]
    expected[16:18] = [1, 2]
    expected[18:20] = [1, 2]
    np.testing.assert_array_equal(blocks, expected)


@pytest.mark.parametrize("spans, blocks", [([(4, 4, 8)], [(0, 5, 0)]),   # short of the announced size
                                           ([(4, 4, 8)], [(0, 3, 0)])])  # longer than it
def test_draft_block_refuses_a_size_mismatch_naming_the_record(spans, blocks):
    with pytest.raises(AssemblyError, match=r"data.jsonl:7.*block_size"):
        draft_block_of(example(spans, blocks))


def test_rows_carry_draft_block_aligned_with_targets_only_when_asked():
    ex = example([(4, 5, 9)], [(0, 4, 0)], length=12)
    plain = assemble(ex, SPEC)
    assert "draft_block" not in plain and "draft_block" not in batch_shapes_of(SPEC, 2)
    spec = dataclasses.replace(SPEC, draft_blocks=True)
    row = assemble(ex, spec)
    # targets[t] = input_ids[t + 1]: the block's first token (index 5) is the target of row position 4.
    np.testing.assert_array_equal(row["draft_block"][:11], [0, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0])
    assert row["targets"][4] == ex.arrays["input_ids"][5]
    assert batch_shapes_of(spec, 2)["draft_block"].shape == (2, 24)
    for key in plain:
        np.testing.assert_array_equal(plain[key], row[key], err_msg=key)  # every existing field unchanged
    packed = row_of([piece_of(ex, spec)], spec)
    assert packed.keys() == row.keys()
    np.testing.assert_array_equal(packed["draft_block"], row["draft_block"])


# --- anchors, weights, metrics ----------------------------------------------------------------------


def test_position_weights_decay_from_one():
    np.testing.assert_allclose(position_weights(4, 2.0), np.exp(-np.arange(4) / 2.0), rtol=1e-6)


def test_drafter_targets_first_anchors_first_then_inside_blocks_with_masks():
    # One row: a block of 5 targets at positions 2..6 (target weight 0 at position 4: an atom mask), then
    # a block of 3 at 7..9 right after it.
    draft_block = np.zeros((1, 12), np.int32)
    draft_block[0, 2:7] = [1, 2, 3, 4, 5]
    draft_block[0, 7:10] = [1, 2, 3]
    targets = np.arange(100, 112, dtype=np.int32)[None]
    weights = np.ones((1, 12), np.float32)
    weights[0, 4] = 0.0
    anchors, block_targets, block_weights = drafter_targets(jnp.asarray(draft_block), jnp.asarray(targets),
                                                            jnp.asarray(weights), 2, 4, jax.random.key(0))
    assert sorted(np.asarray(anchors)[0].tolist()) == [2, 7]  # both blocks' first anchors win the budget
    order = np.argsort(np.asarray(anchors)[0])
    np.testing.assert_array_equal(np.asarray(block_targets)[0][order], [[102, 103, 104, 105], [107, 108, 109, 110]])
    # Anchor 2: positions 2, 3, (4 masked), 5; anchor 7: 7, 8, 9 and nothing past its block's end.
    np.testing.assert_array_equal(np.asarray(block_weights)[0][order], [[1, 1, 0, 1], [1, 1, 1, 0]])

    anchors, _, block_weights = drafter_targets(jnp.asarray(draft_block), jnp.asarray(targets), jnp.asarray(weights),
                                                12, 4, jax.random.key(0))
    chosen = np.asarray(anchors)[0]
    assert sorted(chosen[:2].tolist()) == [2, 7]  # first anchors, then the 6 inside blocks, then filler
    assert sorted(chosen[2:8].tolist()) == [3, 4, 5, 6, 8, 9]
    assert np.asarray(block_weights)[0, 8:].sum() == 0  # positions outside every block weigh nothing
    row = dict(zip(chosen.tolist(), np.asarray(block_weights)[0].tolist(), strict=True))
    assert row[5] == [1, 1, 0, 0]  # block positions 4, 5 of the first block, then its end
    assert row[4] == [0, 1, 1, 0]  # the masked coordinate itself weighs 0


def test_acceptance_length_is_the_sum_of_prefix_products():
    correct = jnp.asarray([9.0, 4.0, 0.0, 5.0])
    count = jnp.asarray([10.0, 5.0, 5.0, 0.0])
    # 0.9 + 0.9·0.8 + 0 + 0 (a position with nothing supervised counts as a miss)
    np.testing.assert_allclose(acceptance_length(correct, count), 0.9 + 0.72, rtol=1e-6)


def test_drafter_losses_equal_decayed_cross_entropy():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(8, 11)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, size=(2, 3, 4)), jnp.int32)
    weights = jnp.asarray(rng.integers(0, 2, size=(2, 3, 4)), jnp.float32)
    sums = jax.jit(drafter_losses, static_argnums=4)(hidden, head, targets, weights, 2.0)
    decay = position_weights(4, 2.0)
    logits = jnp.einsum("bakd,dv->bakv", hidden, head)
    expected = sum(decay[k] * token_losses(logits[:, :, k], targets[:, :, k], weights[:, :, k])["ce"]
                   for k in range(4))
    np.testing.assert_allclose(sums["ce"], expected, rtol=1e-5)
    np.testing.assert_allclose(sums["weight"], jnp.sum(weights.sum(axis=(0, 1)) * decay), rtol=1e-6)
    np.testing.assert_array_equal(sums["count"], weights.sum(axis=(0, 1)))
    hits = (jnp.argmax(logits, -1) == targets) * weights
    np.testing.assert_array_equal(sums["correct"], hits.sum(axis=(0, 1)))


# --- the model --------------------------------------------------------------------------------------

TARGET = ModelConfig(vocab_size=48, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)


BLOCK = 4
# Jitted once per module: eager mode would compile every op of the models separately.
hidden_of = nnx.jit(draft_hidden)
features_of = nnx.jit(target_features, static_argnums=1)


@pytest.fixture(scope="module")
def models():
    group = vflash.with_drafter(vflash.get_config("tiny"), tiny=True).model.drafter
    group.block_size = BLOCK
    return Transformer(TARGET, nnx.Rngs(1)), Drafter(DrafterConfig.of(group, TARGET), nnx.Rngs(2))


def token_batch(seed: int, rows: int = 2, length: int = 16) -> dict:
    rng = np.random.default_rng(seed)
    segment_ids = np.ones((rows, length), np.int32)
    segment_ids[1, 10:] = 2  # the second row packs two examples
    positions = np.concatenate([np.arange(10), np.arange(length - 10)])[None].repeat(rows, 0)
    positions[0] = np.arange(length)
    return {"tokens": jnp.asarray(rng.integers(1, 48, size=(rows, length)), jnp.int32),
            "positions": jnp.asarray(positions, jnp.int32), "segment_ids": jnp.asarray(segment_ids)}


def test_default_target_layers_spread_over_the_depth():
    assert default_target_layers(2) == (0, 1)
    assert default_target_layers(36) == (0, 9, 18, 26, 35)
    assert default_target_layers(1) == (0,)


def test_drafter_config_refuses_a_layer_the_target_lacks():
    group = vflash.with_drafter(vflash.get_config("tiny"), tiny=True).model.drafter
    group.target_layers = (0, 3)
    with pytest.raises(ValueError, match="target has 3 layers"):
        DrafterConfig.of(group, TARGET)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_target_features_are_the_decoder_layer_outputs(scan):
    target = Transformer(dataclasses.replace(TARGET, scan_layers=scan), nnx.Rngs(3))
    batch = token_batch(0)
    features = features_of(target, (0, 2), batch["tokens"], batch["positions"], batch["segment_ids"])
    assert features.shape == (2, 16, 64)
    # The last layer's output, final-normed, is what the decoder's heads read.
    hidden = nnx.jit(lambda model, b: model.hidden(b["tokens"], b["positions"], b["segment_ids"]))(target, batch)
    np.testing.assert_allclose(target.final_norm(features[..., 32:]), hidden, rtol=1e-5, atol=1e-5)


def test_one_pass_proposes_a_whole_block(models):
    target, drafter = models
    batch = token_batch(0)
    anchors = jnp.asarray([[3, 12], [5, 13]], jnp.int32)
    hidden = hidden_of(drafter, target, batch, anchors)
    assert hidden.shape == (2, 2, BLOCK, TARGET.dim)
    proposal = nnx.jit(propose)(drafter, target, batch, anchors)
    assert proposal.shape == (2, 2, BLOCK) and proposal.dtype == jnp.int32
    assert np.all((np.asarray(proposal) >= 0) & (np.asarray(proposal) < TARGET.vocab_size))


def test_a_block_sees_its_anchor_and_earlier_context_of_its_segment_only(models):
    target, drafter = models
    batch = token_batch(0)
    anchors = jnp.asarray([[6, 6], [6, 13]], jnp.int32)
    base = np.asarray(hidden_of(drafter, target, batch, anchors))

    def changed(row, position):
        tokens = np.asarray(batch["tokens"]).copy()
        tokens[row, position] = tokens[row, position] % 47 + 1
        return np.asarray(hidden_of(drafter, target, {**batch, "tokens": jnp.asarray(tokens)}, anchors))

    after = changed(0, 7)  # after row 0's anchor at 6: invisible to it
    np.testing.assert_allclose(after[0], base[0], atol=1e-6)
    before = changed(0, 2)  # context before the anchor: seen
    assert np.abs(before[0] - base[0]).max() > 1e-4
    anchor = changed(0, 6)  # the anchor token itself: seen
    assert np.abs(anchor[0] - base[0]).max() > 1e-4
    other_segment = changed(1, 4)  # row 1's first example, seen by its anchor 6, not by anchor 13 (segment 2)
    assert np.abs(other_segment[1, 0] - base[1, 0]).max() > 1e-4
    np.testing.assert_allclose(other_segment[1, 1], base[1, 1], atol=1e-6)
    # One block's output never depends on another block of the same pass.
    alone = np.asarray(hidden_of(drafter, target, batch, anchors[:, :1]))
    np.testing.assert_allclose(alone[:, 0], base[:, 0], atol=1e-5)


def test_every_drafter_parameter_names_its_logical_axes(models):
    _, drafter = models
    for path, variable in nnx.iter_graph(drafter):
        if isinstance(variable, nnx.Param):
            axes = variable.get_metadata().get("logical_axes")
            assert axes is not None and len(axes) == variable[...].ndim, path


# --- the step ---------------------------------------------------------------------------------------


def step_batch() -> dict:
    batch = {**token_batch(1), "targets": token_batch(2)["tokens"], "target_weights": jnp.ones((2, 16))}
    draft_block = np.zeros((2, 16), np.int32)
    draft_block[0, 3:13] = np.arange(1, 11)  # one long block: anchors inside it too
    draft_block[1, 1:4] = np.arange(1, 4)  # a block shorter than BLOCK
    draft_block[1, 11:15] = np.arange(1, 5)  # the second packed example's block
    return {**batch, "draft_block": jnp.asarray(draft_block)}


@pytest.mark.slow
def test_drafter_step_accumulates_exactly_lowers_the_loss_and_leaves_the_target_bitwise_unchanged(models):
    target, drafter = models
    target_graphdef, target_params = nnx.split(target)
    target_params = nnx.to_pure_dict(target_params)
    graphdef, params = nnx.split(drafter)
    params = nnx.to_pure_dict(params)
    before = jax.tree.map(np.array, target_params)
    batch = step_batch()
    tx = optax.adam(1e-2)
    first = {}
    for accum in (2, 1):
        options = DrafterOptions(block_size=BLOCK, anchors_per_row=6, position_decay=4.0, grad_accum_steps=accum)
        step = jax.jit(make_drafter_train_step(graphdef, target_graphdef, tx, optax.constant_schedule(1e-2), options))
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        state, first[accum] = step(state, batch, target_params)
    # Micro-batches of rows 0 and 1 give the loss and gradient of the whole batch.
    for key in ("loss", "grad_norm", "drafter_acceptance_length"):
        np.testing.assert_allclose(first[1][key], first[2][key], rtol=1e-5, err_msg=key)
    losses = [float(first[1]["loss_drafter"])]
    for _ in range(24):
        state, metrics = step(state, batch, target_params)
        losses.append(float(metrics["loss_drafter"]))
    assert losses[-1] < losses[0] - 0.3, losses
    assert {f"drafter_accuracy_{k}" for k in range(1, BLOCK + 1)} <= set(metrics)
    assert float(metrics["drafter_acceptance_length"]) > float(first[1]["drafter_acceptance_length"])
    # Row 0: 6 of its 10 block positions; row 1: 6 of the 3 + 4 of its two blocks.
    assert float(metrics["drafter_anchors"]) == 6 + 3 + 3
    for (path, old), new in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(target_params),
                                strict=True):
        assert np.array_equal(old, np.asarray(new)), path


# --- the config -------------------------------------------------------------------------------------


def test_drafter_variants_parse():
    config = vflash.get_config("tiny,drafter")
    assert config.train.mode == "vflash" and config.model.drafter.block_size == 8
    assert dict(config.loss.weights) == {"tokens": 0.0, "branches": 0.0, "drafter": 1.0}
    assert vflash.get_config("drafter").model.drafter.block_size == 16
    assert vflash.get_config("tiny").train.mode == "ar"
    with pytest.raises(ValueError, match="at most one of"):
        vflash.get_config("tiny,hf,drafter")


@pytest.mark.parametrize("change, message", [
    (lambda c: c.loss.weights.update(drafter=0.5), "weights.drafter=0.5 needs config.train.mode=vflash"),
    (lambda c: setattr(c.model, "target_from", "/tmp/target"), "target_from is read only with config.train.mode=vflash"),
])
def test_ar_configs_refuse_drafter_settings(change, message):
    config = vflash.get_config("tiny")
    change(config)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


@pytest.mark.parametrize("change, message", [
    (lambda c: None, "needs --config.model.target_from=WORKDIR"),
    (lambda c: (setattr(c.model, "target_from", "/t"), c.loss.weights.update(tokens=1.0)), "drafter alone"),
    (lambda c: (setattr(c.model, "target_from", "/t"), setattr(c.eval, "every", 2)), "evaluates nothing yet"),
    (lambda c: (setattr(c.model, "target_from", "/t"), setattr(c.model.drafter, "block_size", 0)),
     "block_size must be an integer ≥ 1"),
    (lambda c: (setattr(c.model, "target_from", "/t"), setattr(c.model.drafter, "target_layers", (1, 1))),
     "distinct layer indices"),
])
def test_vflash_configs_are_checked(change, message):
    config = vflash.get_config("tiny,drafter")
    change(config)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_an_unknown_training_mode_is_refused_naming_the_registered_ones():
    from valen_jax.tasks.modes import check_mode

    config = vflash.get_config("tiny")
    config.train.mode = "diffusion"
    validate_config(config)  # the schema checks the built-in modes' keys; the mode table refuses the name
    with pytest.raises(ConfigError, match="train.mode='diffusion'; choose one of ar, vflash"):
        check_mode(config)


def _target_run(workdir: str, params, identity: str):
    """A target's run handle holding only what `check_target` reads: where it is, its weights, their identity."""
    from valen_jax.run import ModelRun

    return ModelRun(Path(workdir), 4, None, TARGET, None, {}, None, None, None, params, identity)


def test_resuming_a_drafter_against_other_target_weights_is_refused(tmp_path, caplog):
    from valen_jax.run import check_target
    from valen_jax.training import checkpoint

    record = {"workdir": "/runs/target", "step": 4, "params_identity": "a" * 64, "tokenizer": {}}
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint 3 is a drafter for target .*other weights"):
        check_target(tmp_path, 3, record, _target_run("/runs/target", None, "b" * 64))
    check_target(tmp_path, 3, record, _target_run("/runs/target", None, "a" * 64))
    assert "same target weights" not in caplog.text
    check_target(tmp_path, 3, record, _target_run("/moved/target", None, "a" * 64))  # moved: a warning
    assert "trained against the same target weights in /runs/target; now read from /moved/target" in caplog.text


def test_a_drafter_saved_before_params_identity_is_checked_on_the_sha256_of_its_targets_weights(tmp_path):
    """Meta schema 1: the record holds params_sha256 (every byte of the weights), compared the old way."""
    from valen_jax.run import check_target
    from valen_jax.training import checkpoint

    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    legacy = {"workdir": "/runs/target", "step": 4, "params_sha256": checkpoint.params_sha256(params), "tokenizer": {}}
    check_target(tmp_path, 3, legacy, _target_run("/runs/target", params, checkpoint.params_identity_of(params)))
    other = {**params, "b": params["b"] * 2}
    with pytest.raises(checkpoint.CheckpointError, match="other weights"):
        check_target(tmp_path, 3, legacy, _target_run("/runs/target", other, "c" * 64))


def test_metas_are_migrated_to_the_current_schema_and_a_newer_one_is_refused():
    from valen_jax.training import checkpoint

    old = {"config": {"train": {"steps": 4}}, "model": {}}
    migrated = checkpoint.migrate_meta(old)
    assert migrated["schema_version"] == checkpoint.META_SCHEMA and migrated["config"]["train"]["mode"] == "ar"
    assert "schema_version" not in old  # a copy
    vflash_run = {"schema_version": 2, "config": {"train": {"mode": "vflash"}}}
    assert checkpoint.migrate_meta(vflash_run)["config"]["train"]["mode"] == "vflash"
    newer = checkpoint.META_SCHEMA + 1
    with pytest.raises(checkpoint.CheckpointError, match=f"schema_version {newer} was written by a newer valen_jax"):
        checkpoint.migrate_meta({"schema_version": newer})


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_prefill_and_extend_collect_the_target_features(scan):
    """Decoding's drafter features (`collect=`): a prefill over the first 10 tokens and an extend over
    the next 6 give what `target_features` gives over the whole row; asking for none changes nothing."""
    target = Transformer(dataclasses.replace(TARGET, scan_layers=scan), nnx.Rngs(3))
    batch = {k: v[:1] for k, v in token_batch(0).items()}  # row 0: one example of 16 tokens
    tokens, positions = batch["tokens"], batch["positions"]

    @nnx.jit
    def decode(model):
        _, cache, first = model.prefill(tokens[:, :10], positions[:, :10], jnp.asarray([10]), 32, collect=(0, 2))
        logits, _, second = model.extend(tokens[:, 10:], positions[:, 10:], cache, jnp.asarray([10]), collect=(0, 2))
        _, plain_cache = model.prefill(tokens[:, :10], positions[:, :10], jnp.asarray([10]), 32)
        plain, _ = model.extend(tokens[:, 10:], positions[:, 10:], plain_cache, jnp.asarray([10]))
        return jnp.concatenate([first, second], axis=1), logits, plain

    collected, logits, plain = decode(target)
    full = features_of(target, (0, 2), tokens, positions, batch["segment_ids"])
    np.testing.assert_allclose(collected, full, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(logits, plain)
    with pytest.raises(ValueError, match="collect=\\(0, 3\\)"):
        target.prefill(tokens, positions, jnp.asarray([16]), 32, collect=(0, 3))
