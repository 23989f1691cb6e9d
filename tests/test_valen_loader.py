"""The Valen loader as the token loader is tested: exact resume, worker processes, process slices; the
start-up fit report; and the seed 000 knobs that Valen honours or refuses (never ignores)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from configs import valen as valen_config
from data_pipeline.conversion import convert
from data_pipeline.tokenizer import load_tokenizer
from tests.train_runs import ROOT
from valen_jax.config.schema import ConfigError
from valen_jax.data.assemble import AssemblyError, RowSpec
from valen_jax.data.pipeline import build_dataset
from valen_jax.data.sources import ShardSet, decode
from valen_jax.data.valen_fit import check_training_set
from valen_jax.data.valen_rows import QuestionSpec, ValenAssembly, row_needs, valen_row
from valen_jax.models.config import ModelConfig, VisionConfig, padded_vocab

QUESTION = QuestionSpec("question", 4, 8, training=True)
RESUME_AT, TOTAL = 2, 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    shards = tmp_path_factory.mktemp("valen") / "shards"
    convert("valen", ROOT / "data/smoke/valen/train.jsonl", shards, ROOT / "data/tokenizer", progress=False)
    tok = load_tokenizer(ROOT / "data/tokenizer")
    cfg = ModelConfig(vocab_size=padded_vocab(len(tok)), dim=8, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=8, mlp_dim=8, score_head=True, image_pad_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                      vision=VisionConfig(patch_size=8, merge_size=2, temporal_patch_size=2, dim=8, num_layers=1,
                                          num_heads=1, mlp_dim=8))
    spec = RowSpec.of(256, 256, tok, cfg, {"max_pixels": 64 * 64, "max_frames": 4})
    return ShardSet.open(shards), spec


def _dataset(shard_set, spec, workers=0, qspec=QUESTION, overlong="error", **kwargs):
    kwargs = {"global_batch": 2, "seed": 5, "shuffle": True, "repeat": True, **kwargs}
    return build_dataset(shard_set, spec, ValenAssembly(qspec, overlong), workers=workers, training=True, **kwargs)


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_restored_valen_iterator_continues_with_the_same_batches(setup):
    # 5 batches of 2 cross the 6-record epoch, so the resumed part shuffles candidates of a new epoch.
    iterator = iter(_dataset(*setup))
    batches = [next(iterator) for _ in range(RESUME_AT)]
    state = iterator.get_state()
    batches += [next(iterator) for _ in range(TOTAL - RESUME_AT)]
    resumed = iter(_dataset(*setup))
    resumed.set_state(state)
    for want in batches[RESUME_AT:]:
        _assert_same(next(resumed), want)
    # Candidate order is drawn per (record, epoch): some choice question is seen in two orders.
    orders = {}
    for batch in batches:
        for row in range(2):
            for q in range(QUESTION.max_questions):
                members = batch["candidate_index"][row, q][batch["branch_mask"][row, q]]
                if len(members) > 2:
                    orders.setdefault(tuple(sorted(members)), set()).add(tuple(members))
    assert any(len(seen) > 1 for seen in orders.values())


@pytest.mark.slow  # worker processes take ~10 s each to start on a small machine
def test_two_workers_resume_from_a_saved_state_to_the_same_batches(setup):
    # Each worker assembles whole batches from its slice of the records, so the order differs from
    # workers=0; what must hold is that a resumed 2-worker run continues the uninterrupted one.
    iterator = iter(_dataset(*setup, workers=2))
    want = [next(iterator) for _ in range(RESUME_AT)]
    state = iterator.get_state()
    want += [next(iterator) for _ in range(TOTAL - RESUME_AT)]
    iterator.close()
    resumed = iter(_dataset(*setup, workers=2))
    resumed.set_state(state)
    for w in want[RESUME_AT:]:
        _assert_same(next(resumed), w)
    resumed.close()
    # The workers draw the same per-example candidate orders as one process: same rows, other order.
    alone = iter(_dataset(*setup))
    rows = {_row_key(b, r) for b in [next(alone) for _ in range(TOTAL + 1)] for r in range(2)}
    assert {_row_key(b, r) for b in want for r in range(2)} <= rows


def _row_key(batch: dict, row: int) -> bytes:
    return batch["tokens"][row].tobytes() + batch["candidate_index"][row].tobytes()


def test_a_fake_process_reads_its_rows_of_the_valen_global_batch(setup):
    def first_batch(index, count):
        return next(iter(_dataset(*setup, global_batch=4, process_index=index, process_count=count)))["tokens"]

    whole = first_batch(0, 1)
    halves = [first_batch(p, 2) for p in range(2)]
    np.testing.assert_array_equal(halves[0], whole[0::2])
    np.testing.assert_array_equal(halves[1], whole[1::2])


def test_the_fit_report_names_the_smallest_limits_and_what_the_current_ones_drop(setup, caplog):
    shard_set, spec = setup
    source = shard_set.source()
    examples = [decode(source[i]) for i in range(len(source))]
    needs = [row_needs(e, spec, QUESTION) for e in examples]
    smallest = (max(n.seq_len for n in needs), max(n.questions for n in needs), max(n.candidates for n in needs),
                max(n.patches for n in needs))
    tight = dataclasses.replace(spec, seq_len=smallest[0] - 1)
    tight_q = dataclasses.replace(QUESTION, max_candidates=smallest[2] - 1)
    with pytest.raises(ConfigError) as refused:
        check_training_set(shard_set, tight, tight_q, "error")
    message = str(refused.value)
    # Both limits in one report, not one stop per limit.
    assert (f"data.seq_len={smallest[0]}, data.max_questions={smallest[1]}, data.max_candidates={smallest[2]}, "
            f"data.max_patches={smallest[3]}") in message
    over_len = sum(n.seq_len > smallest[0] - 1 for n in needs)
    over_cand = sum(n.candidates > smallest[2] - 1 for n in needs)
    unfit = sum(n.seq_len > smallest[0] - 1 or n.candidates > smallest[2] - 1 for n in needs)
    assert f"{unfit} of {len(examples)} records do not fit" in message
    assert f"data.max_candidates: {over_cand}" in message and f"data.seq_len: {over_len}" in message
    assert "data.overlong=skip" in message
    # At the smallest limits everything fits.
    exact = dataclasses.replace(spec, seq_len=smallest[0])
    exact_q = dataclasses.replace(QUESTION, max_questions=smallest[1], max_candidates=smallest[2])
    assert check_training_set(shard_set, exact, exact_q, "error").unfit == []
    # With overlong=skip the same report is a warning, logged once.
    with caplog.at_level("WARNING", logger="valen_jax.data.valen_fit"):
        report = check_training_set(shard_set, tight, tight_q, "skip")
    assert len(report.unfit) == unfit and len(caplog.records) == 1


def test_overlong_skip_drops_the_rows_that_do_not_fit_and_error_names_them(setup):
    shard_set, spec = setup
    source = shard_set.source()
    examples = [decode(source[i]) for i in range(len(source))]
    longest = max(row_needs(e, spec, QUESTION).seq_len for e in examples)
    tight = dataclasses.replace(spec, seq_len=longest - 1)
    dropped = next(e for e in examples if row_needs(e, spec, QUESTION).seq_len == longest)
    assert valen_row(dropped, tight, QUESTION, None, overlong="skip") is None
    with pytest.raises(AssemblyError, match=f"data.seq_len={longest - 1} < {longest}"):
        valen_row(dropped, tight, QUESTION, None)
    batches = _dataset(shard_set, tight, overlong="skip", repeat=False, shuffle=False, global_batch=1)
    kept = [int(b["segment_ids"].sum()) for b in batches]
    assert len(kept) == len(examples) - 1 and max(kept) < longest


def _config(**overrides):
    config = valen_config.get_config("tiny")
    for path, value in overrides.items():
        group, key = path.split(".", 1)
        if "." in key:
            key, sub = key.split(".")
            config[group][key][sub] = value
        else:
            config[group][key] = value
    return config


@pytest.mark.parametrize(("path", "value", "named"), [
    ("data.packing", "first_fit", "config.data.packing='first_fit'"),
    ("data.packing", "best_fit", "config.data.packing='best_fit'"),
    ("loss.z_loss", 1e-4, "config.loss.z_loss=0.0001"),
    ("loss.weights.tokens", 1.0, "config.loss.weights.tokens=1.0"),
    ("data.max_segments", 0, "config.data.max_segments=0"),
    ("data.overlong", "truncate", "config.data.overlong='truncate'"),
    ("data.valen_mode", "tree", "config.data.valen_mode='tree'"),
    ("data.max_candidates", 0, "config.data.max_candidates=0"),
])
def test_valen_refuses_what_its_rows_cannot_honour(path, value, named):
    with pytest.raises(ConfigError) as refused:
        ValenAssembly.from_config(_config(**{path: value}), training=True)
    assert named in str(refused.value)


def test_valen_honours_overlong_skip_and_max_segments():
    assembly = ValenAssembly.from_config(_config(**{"data.overlong": "skip", "data.max_segments": 1}), training=True)
    assert assembly.overlong == "skip"  # the loader drops rows that do not fit (test above)
    # Every Valen row is one segment, so any max_segments ≥ 1 holds.
    assert assembly.qspec == QuestionSpec("question", 4, 8, training=True)


def test_a_valen_run_stops_at_start_up_with_the_refusal_and_with_the_whole_fit_report(tmp_path):
    from valen_jax import train

    with pytest.raises(ConfigError, match=r"config\.data\.packing='first_fit'"):
        train.run(_config(**{"data.packing": "first_fit"}), tmp_path / "packed")
    # Both limits at once, from the whole set (not the first record over one of them).
    with pytest.raises(ConfigError, match=r"smallest limits that fit every record") as refused:
        train.run(_config(**{"data.seq_len": 64, "data.max_candidates": 2}), tmp_path / "small")
    assert "data.seq_len: " in str(refused.value) and "data.max_candidates: " in str(refused.value)
    assert not (tmp_path / "small" / "checkpoints").exists()
