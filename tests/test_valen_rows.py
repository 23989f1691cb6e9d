"""Valen rendering and row assembly on the smoke set, through the real model."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data_pipeline.formats.valen import read_valen
from data_pipeline.render.common import RenderError
from data_pipeline.render.valen import ValenRenderer
from data_pipeline.tokenizer import load_tokenizer
from tests.train_runs import ROOT
from valen_jax.data.assemble import AssemblyError, RowSpec
from valen_jax.data.valen_rows import QuestionSpec, valen_row
from valen_jax.models.config import ModelConfig, VisionConfig, padded_vocab
from valen_jax.models.transformer import Transformer


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer(ROOT / "data/tokenizer")
    cfg = ModelConfig(vocab_size=padded_vocab(len(tok)), dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_dim=64, score_head=True, image_pad_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                      vision=VisionConfig(patch_size=8, merge_size=2, temporal_patch_size=2, dim=16, num_layers=1,
                                          num_heads=2, mlp_dim=32))
    spec = RowSpec.of(256, 256, tok, cfg, {"max_pixels": 64 * 64, "max_frames": 4})
    renderer = ValenRenderer(tok)
    examples = [renderer.render(r, "train") for r in read_valen(ROOT / "data/smoke/valen/train.jsonl")]
    return tok, cfg, spec, examples, Transformer(cfg, nnx.Rngs(0))


def _scores(model, row):
    batch = {k: jnp.asarray(v[None]) for k, v in row.items()}
    hidden = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"],
                          (batch["patches"], batch["patch_positions"], batch["patch_segments"]), batch["branch_ids"])
    return np.asarray(model.score_head(hidden))[0]


@pytest.mark.slow
def test_question_mode_branch_scores_equal_separate_sequences(setup):
    tok, cfg, spec, examples, model = setup
    example = examples[2]  # the image record: media in the prefix too
    qspec = QuestionSpec("question", 8, 8, training=False)
    row = valen_row(example, spec, qspec, None)
    tree = _scores(model, row)
    state_len = int((row["branch_ids"] == 0).sum() - (row["segment_ids"] == 0).sum())
    for q in range(int(row["branch_mask"].any(axis=1).sum())):
        for k in np.flatnonzero(row["branch_mask"][q]):
            end = row["score_positions"][q, k]
            branch = row["branch_ids"][end]
            members = np.flatnonzero(row["branch_ids"] == branch)
            alone = {key: value.copy() for key, value in row.items()}
            sequence = np.concatenate([row["tokens"][:state_len], row["tokens"][members]])
            alone["tokens"] = np.pad(sequence, (0, spec.seq_len - len(sequence)))
            alone["positions"] = np.pad(np.arange(len(sequence), dtype=np.int32), (0, spec.seq_len - len(sequence)))
            alone["segment_ids"] = np.pad(np.ones(len(sequence), np.int32), (0, spec.seq_len - len(sequence)))
            alone["branch_ids"] = np.zeros(spec.seq_len, np.int32)
            separate = _scores(model, alone)
            np.testing.assert_allclose(tree[end], separate[len(sequence) - 1], atol=2e-5)


def test_training_skips_unlabeled_questions_and_shuffles_choices_with_labels(setup):
    _, _, spec, examples, _ = setup
    example = examples[0]  # traffic light: choice + noul + score, all labeled
    inference = valen_row(example, spec, QuestionSpec("question", 8, 8, training=False), None)
    keys = example.meta["candidate_keys"]
    seen_orders = set()
    for seed in range(8):
        row = valen_row(example, spec, QuestionSpec("question", 8, 8, training=True), np.random.default_rng(seed))
        order = tuple(row["candidate_index"][0][row["branch_mask"][0]])
        seen_orders.add(order)
        # Labels follow their candidates through the shuffle.
        np.testing.assert_array_equal(row["labels"][0][: len(order)], example.arrays["labels"][list(order)])
        np.testing.assert_array_equal(row["candidate_index"][1], inference["candidate_index"][1])  # noul fixed
    assert len(seen_orders) > 1
    assert tuple(inference["candidate_index"][0][: len(keys[0])]) == (0, 1, 2)
    partly = next(e for e in examples if not e.arrays["labeled"].all())
    row = valen_row(partly, spec, QuestionSpec("question", 8, 8, training=True), np.random.default_rng(0))
    assert row["branch_mask"].any(axis=1).sum() == partly.arrays["labeled"].sum()
    shared = valen_row(partly, spec, QuestionSpec("shared_state", 8, 8, training=True), np.random.default_rng(0))
    assert shared["branch_mask"].any(axis=1).sum() == len(partly.meta["questions"])  # kept as context
    assert shared["labeled"].sum() == partly.arrays["labeled"].sum()
    assert (shared["branch_ids"] == 0).all()


def test_a_record_without_labels_is_refused_in_training(setup):
    _, _, spec, examples, _ = setup
    example = dataclasses.replace(examples[0], arrays={**examples[0].arrays,
                                                       "labeled": np.zeros_like(examples[0].arrays["labeled"])})
    with pytest.raises(AssemblyError, match="no labeled question"):
        valen_row(example, spec, QuestionSpec("question", 8, 8, training=True), None)
    assert valen_row(example, spec, QuestionSpec("question", 8, 8, training=False), None)["branch_mask"].any()


def test_control_tokens_in_user_text_are_refused(setup):
    tok = setup[0]
    record = read_valen(ROOT / "data/smoke/valen/train.jsonl")[0]
    bad = dataclasses.replace(record, state="green <|im_end|> light")
    with pytest.raises(RenderError, match=r"train.jsonl:1: request.state: holds the control token '<\|im_end\|>'"):
        ValenRenderer(tok).render(bad, "train")
