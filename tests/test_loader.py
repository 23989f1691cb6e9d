"""The Grain loader over real shards: recipe weights, fixed shapes, determinism, resume state."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.conversion import convert
from data_pipeline.tokenizer import load_tokenizer
from tests.train_runs import ROOT
from valen_jax.data.assemble import AssemblyError, RowSpec, assemble
from valen_jax.data.pipeline import build_dataset
from valen_jax.data.sources import ShardSet, sampling_indices
from valen_jax.models.config import ModelConfig, VisionConfig


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "train"
    convert("recipe", ROOT / "data/smoke/vflash/recipe.json", out, ROOT / "data/tokenizer", progress=False)
    tok = load_tokenizer(ROOT / "data/tokenizer")
    cfg = ModelConfig(vocab_size=2176, dim=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, mlp_dim=8,
                      image_pad_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                      vision=VisionConfig(patch_size=8, merge_size=2, temporal_patch_size=2, dim=8,
                                          num_layers=1, num_heads=1, mlp_dim=8))
    spec = RowSpec.of(192, 128, tok, cfg, {"max_pixels": 64 * 64})
    return ShardSet.open(out), spec


def test_repeat_time_weights_entries(setup):
    shard_set, _ = setup
    indices = sampling_indices(shard_set.manifest, seed=0)
    entries = {e["name"]: e for e in shard_set.manifest.data["entries"]}
    boxes = entries["smoke_boxes"]
    in_boxes = (indices >= boxes["start"]) & (indices < boxes["stop"])
    assert boxes["repeat_time"] == 2.0 and in_boxes.sum() == 2 * (boxes["stop"] - boxes["start"])
    assert len(indices) == 96 + (boxes["stop"] - boxes["start"])


def test_fractional_repeat_time_selects_a_deterministic_subset(setup):
    shard_set, _ = setup
    data = dict(shard_set.manifest.data)
    data["entries"] = [dict(e, repeat_time=0.5) for e in data["entries"]]
    from data_pipeline.shards import Manifest
    manifest = Manifest(data)
    first, second = sampling_indices(manifest, 3), sampling_indices(manifest, 3)
    np.testing.assert_array_equal(first, second)
    assert len(first) == sum(round(0.5 * (e["stop"] - e["start"])) for e in data["entries"])
    assert len(set(first.tolist())) == len(first)


def test_batches_have_fixed_shapes_and_media_slots_match_vision_tokens(setup):
    shard_set, spec = setup
    dataset = build_dataset(shard_set, spec, global_batch=4, seed=0, shuffle=True, repeat=True, workers=0)
    iterator = iter(dataset)
    for _ in range(5):
        batch = next(iterator)
        assert batch["tokens"].shape == (4, 192) and batch["patches"].shape == (4, 128, 2 * 8 * 8 * 3)
        slots = (batch["tokens"] == spec.image_pad_id).sum(axis=1)
        # Every media slot token is one merged window of 2×2 patches.
        np.testing.assert_array_equal(slots * 4, (batch["patch_segments"] > 0).sum(axis=1))
        assert (batch["target_weights"][batch["segment_ids"] == 0] == 0).all()
        assert (batch["target_weights"].sum(axis=1) > 0).all()


def test_iterator_state_restores_the_exact_position(setup):
    shard_set, spec = setup
    def make():
        return iter(build_dataset(shard_set, spec, global_batch=4, seed=1, shuffle=True, repeat=True, workers=0))

    straight = make()
    expected = [next(straight)["tokens"] for _ in range(40)]
    first = make()
    for _ in range(33):
        next(first)
    state = first.get_state()
    resumed = make()
    resumed.set_state(state)
    for want in expected[33:]:
        np.testing.assert_array_equal(next(resumed)["tokens"], want)


def test_an_overlong_example_is_refused_with_its_source_line(setup):
    shard_set, spec = setup
    from dataclasses import replace

    from data_pipeline.shards import Example
    example = Example.from_bytes(shard_set.source()[0])
    with pytest.raises(AssemblyError, match=r"points\.jsonl:1: .* exceed data.seq_len=10"):
        assemble(example, replace(spec, seq_len=10))
