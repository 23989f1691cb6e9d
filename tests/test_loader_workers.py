"""The loader with worker processes and resume, mixtures of shard sets, and sharding by process."""

from __future__ import annotations

import logging

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from data_pipeline.conversion import convert
from data_pipeline.shards import Manifest, ShardError
from data_pipeline.tokenizer import load_tokenizer
from tests.train_runs import ROOT
from valen_jax.data.assemble import RowSpec
from valen_jax.data.packing import PackingSpec, packing_statistics
from valen_jax.data.pipeline import TokenAssembly, build_dataset, example_refs
from valen_jax.data.sources import ShardSet, log_length_mismatches, mixture_of, sampling_indices
from valen_jax.models.config import ModelConfig, VisionConfig

BEST_FIT = PackingSpec(packing="best_fit", max_segments=8, pack_buffer=4)
RESUME_AT, TOTAL = 3, 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    convert("recipe", ROOT / "data/smoke/vflash/recipe.json", root / "recipe", ROOT / "data/tokenizer",
            progress=False)
    convert("vflash", ROOT / "data/smoke/vflash/drive.jsonl", root / "drive", ROOT / "data/tokenizer",
            progress=False)
    tok = load_tokenizer(ROOT / "data/tokenizer")
    cfg = ModelConfig(vocab_size=2176, dim=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, mlp_dim=8,
                      image_pad_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                      vision=VisionConfig(patch_size=8, merge_size=2, temporal_patch_size=2, dim=8,
                                          num_layers=1, num_heads=1, mlp_dim=8))
    # Rows of 512 tokens hold ~4 smoke examples (each ~100 tokens with a 16-token image).
    spec = RowSpec.of(512, 512, tok, cfg, {"max_pixels": 64 * 64})
    return ShardSet.open(root / "recipe"), ShardSet.open(root / "drive"), spec


def _dataset(setup, workers: int):
    recipe, drive, spec = setup
    return build_dataset([(recipe, 3.0), (drive, 1.0)], spec, global_batch=2, seed=4, shuffle=True, repeat=True,
                         workers=workers, assembly=TokenAssembly(BEST_FIT))


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """An uninterrupted 2-worker run; its state and an Orbax checkpoint taken after RESUME_AT batches."""
    directory = tmp_path_factory.mktemp("ckpt")
    iterator = iter(_dataset(setup, workers=2))
    batches = [next(iterator) for _ in range(RESUME_AT)]
    state = iterator.get_state()
    with ocp.CheckpointManager(directory, item_names=("data",)) as mgr:
        mgr.save(RESUME_AT, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
        mgr.wait_until_finished()
    batches += [next(iterator) for _ in range(TOTAL - RESUME_AT)]
    iterator.close()
    return batches, state, directory


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.slow  # worker processes take ~10 s each to start on a small machine
def test_two_workers_resume_from_a_saved_state_to_the_same_batches(setup, reference):
    batches, state, _ = reference
    assert all(b["segment_ids"].max() > 1 for b in batches)  # rows really are packed
    # The packers run in the workers; their counters reach the trainer through the state.
    counts = packing_statistics(state)
    assert counts["rows"] == 2 * RESUME_AT and counts["examples"] == sum(
        int(b["segment_ids"].max(axis=1).sum()) for b in batches[:RESUME_AT])
    resumed = iter(_dataset(setup, workers=2))
    resumed.set_state(state)
    for want in batches[RESUME_AT:]:
        _assert_same(next(resumed), want)
    resumed.close()


@pytest.mark.slow
def test_two_workers_resume_through_an_orbax_checkpoint(setup, reference):
    batches, _, directory = reference
    resumed = iter(_dataset(setup, workers=2))
    with ocp.CheckpointManager(directory, item_names=("data",)) as mgr:
        mgr.restore(RESUME_AT, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed)))
    for want in batches[RESUME_AT:]:
        _assert_same(next(resumed), want)
    resumed.close()


def test_mixture_weights_give_their_proportions_and_keep_recipe_repeats(setup):
    recipe, drive, _ = setup
    components = mixture_of([(recipe, 3.0), (drive, 1.0)])
    refs = example_refs(components, seed=0, shuffle=True, repeat=True, process_index=0, process_count=1)
    drawn = np.array([refs[i][:2] for i in range(8000)])
    share = np.mean(drawn[:, 0] == 0)
    assert abs(share - 0.75) < 0.01
    # Within the recipe set, smoke_boxes (repeat_time 2) is drawn twice as often per record.
    entries = {e["name"]: e for e in recipe.manifest.data["entries"]}
    from_recipe = drawn[drawn[:, 0] == 0, 1]
    per_record = {name: np.isin(from_recipe, np.arange(e["start"], e["stop"])).sum() / (e["stop"] - e["start"])
                  for name, e in entries.items()}
    assert abs(per_record["smoke_boxes"] / per_record["smoke_points"] - 2.0) < 0.15
    # Deterministic: the same seed gives the same draws; another seed another order.
    again = example_refs(components, seed=0, shuffle=True, repeat=True, process_index=0, process_count=1)
    other = example_refs(components, seed=1, shuffle=True, repeat=True, process_index=0, process_count=1)
    assert [again[i] for i in range(200)] == [refs[i] for i in range(200)]
    assert [other[i] for i in range(200)] != [refs[i] for i in range(200)]


def test_each_epoch_of_a_component_is_a_new_permutation_of_its_weighted_indices(setup):
    recipe, _, _ = setup
    refs = example_refs(mixture_of(recipe), seed=2, shuffle=True, repeat=True, process_index=0, process_count=1)
    epoch = len(sampling_indices(recipe.manifest, 2))
    first = [refs[i] for i in range(epoch)]
    second = [refs[i] for i in range(epoch, 2 * epoch)]
    assert {r[2] for r in first} == {0} and {r[2] for r in second} == {1}
    assert sorted(r[1] for r in first) == sorted(r[1] for r in second)
    assert [r[1] for r in first] != [r[1] for r in second]


@pytest.mark.parametrize("count", [2, 3])
def test_processes_read_disjoint_slices_that_cover_the_epoch(setup, count):
    recipe, drive, _ = setup
    components = mixture_of([(recipe, 1.0), (drive, 1.0)])
    whole = list(example_refs(components, seed=7, shuffle=True, repeat=False, process_index=0, process_count=1))
    slices = [list(example_refs(components, seed=7, shuffle=True, repeat=False, process_index=p,
                                process_count=count)) for p in range(count)]
    for p, part in enumerate(slices):
        assert part == whole[p::count]  # positions p, p+count, …: disjoint, and together all of them
    assert sum(len(part) for part in slices) == len(whole)


def test_a_fake_process_reads_its_rows_of_the_global_batch(setup):
    recipe, _, spec = setup
    def first_batch(index, count):
        dataset = build_dataset(recipe, spec, global_batch=4, seed=3, shuffle=True, repeat=False, workers=0,
                                process_index=index, process_count=count)
        return next(iter(dataset))["tokens"]

    whole = first_batch(0, 1)
    halves = [first_batch(p, 2) for p in range(2)]
    assert halves[0].shape == (2, 512)
    np.testing.assert_array_equal(halves[0], whole[0::2])
    np.testing.assert_array_equal(halves[1], whole[1::2])
    with pytest.raises(ValueError, match="not divisible by 3 processes"):
        build_dataset(recipe, spec, global_batch=4, seed=3, shuffle=True, repeat=False, workers=0,
                      process_index=0, process_count=3)


def test_mixing_refuses_shards_of_another_tokenizer_and_nonpositive_weights(setup):
    recipe, drive, _ = setup
    data = dict(drive.manifest.data)
    data["tokenizer"] = {**data["tokenizer"], "fingerprint": {"vocab": "other"}}
    foreign = ShardSet(drive.directory, Manifest(data))
    with pytest.raises(ShardError, match="convert both with one tokenizer"):
        mixture_of([(recipe, 1.0), (foreign, 1.0)])
    with pytest.raises(ValueError, match="must be > 0"):
        mixture_of([(recipe, 1.0), (drive, 0.0)])


def test_an_entry_length_mismatch_in_the_manifest_is_logged_at_load(setup, caplog):
    recipe, _, _ = setup
    data = dict(recipe.manifest.data)
    data["entries"] = [dict(e, length=(e["stop"] - e["start"] + (1 if i == 0 else 0)))
                       for i, e in enumerate(data["entries"])]
    with caplog.at_level(logging.WARNING, logger="valen_jax.data.sources"):
        log_length_mismatches(Manifest(data), "shards/")
    assert [r.getMessage() for r in caplog.records] == [
        "shards/: entry 'smoke_points' expects length=29 but holds 28 records"]
