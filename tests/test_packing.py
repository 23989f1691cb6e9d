"""Packing on hand-made examples: first fit vs best fit, isolation of segments, media order, caps,
the overlong policy, and an exact resume of the packing stream from its saved state."""

from __future__ import annotations

import json
from dataclasses import replace

import grain
import numpy as np
import pytest

from data_pipeline.shards import Example
from valen_jax.data.assemble import AssemblyError, RowSpec, assemble
from valen_jax.data.packing import (
    PackingSpec,
    PackIterDataset,
    Piece,
    pack,
    packing_statistics,
    piece_of,
    row_of,
)
from valen_jax.models.attention import reference_mask as attention_mask
from valen_jax.models.config import VisionConfig

IMAGE_PAD = 99
# merge 2 → 4 patches per media-slot token; patch_dim = 1·1·1·3.
VISION = VisionConfig(patch_size=1, merge_size=2, temporal_patch_size=1, dim=8, num_layers=1, num_heads=1,
                      mlp_dim=8)
SPEC = RowSpec(seq_len=10, max_patches=16, image_pad_id=IMAGE_PAD, pad_id=0, vision=VISION, media_kwargs={})


def make_piece(ident: int, length: int, media: tuple[int, ...] = ()) -> Piece:
    """Tokens 100+ident; media item m fills `media[m]` slot tokens and carries patches tagged ident·10+m."""
    tokens = np.full(length, 100 + ident, np.int32)
    tokens[1:1 + sum(media)] = IMAGE_PAD
    patch_counts = [4 * slots for slots in media]
    tags = np.repeat([ident * 10 + m for m in range(len(media))], patch_counts).astype(np.float32)
    return Piece(tokens=tokens, targets=tokens + 1, weights=np.ones(length, np.float32),
                 patches=np.repeat(tags[:, None], 3, axis=1), patch_positions=np.zeros((len(tags), 3), np.int32),
                 patch_media=np.repeat(np.arange(1, len(media) + 1, dtype=np.int32), patch_counts),
                 num_media=len(media), where=f"hand.jsonl:{ident}", positions=np.arange(length, dtype=np.int32))


def idents(rows: list[list[Piece]]) -> list[list[int]]:
    return [[int(p.tokens[0]) - 100 for p in row] for row in rows]


def stream(pieces, spec=SPEC, packing=None):
    packing = packing or PackingSpec(packing="best_fit")
    return iter(PackIterDataset(grain.MapDataset.source(pieces).to_iter_dataset(), spec, packing))


def test_first_fit_and_best_fit_place_the_same_examples_differently():
    # Open rows 5 and 7 (seq_len 10); a 3 then a 5 arrive.
    pieces = [make_piece(0, 5), make_piece(1, 7), make_piece(2, 3), make_piece(3, 5)]
    first = pack(pieces, SPEC, PackingSpec(packing="first_fit", pack_buffer=3))
    best = pack(pieces, SPEC, PackingSpec(packing="best_fit", pack_buffer=3))
    # First fit puts the 3 into the oldest row, so the last 5 fits nowhere and opens a third row.
    assert idents(first) == [[0, 2], [1], [3]]
    # Best fit puts the 3 where it leaves the least room (completing the 7), so the 5 completes the 5.
    assert idents(best) == [[1, 2], [0, 3]]
    assert idents(pack(pieces, SPEC, PackingSpec(packing="none"))) == [[0], [1], [2], [3]]


def test_a_full_buffer_emits_the_oldest_row_for_first_fit_and_the_fullest_for_best_fit():
    pieces = [make_piece(0, 4), make_piece(1, 8), make_piece(2, 7)]
    # Buffer of 2: rows [4] and [8] are open when the 7 fits neither.
    assert idents(pack(pieces, SPEC, PackingSpec(packing="first_fit", pack_buffer=2))) == [[0], [1], [2]]
    assert idents(pack(pieces, SPEC, PackingSpec(packing="best_fit", pack_buffer=2))) == [[1], [0], [2]]


def test_a_row_nothing_fits_is_emitted_after_the_horizon_so_resume_state_stays_bounded():
    packing = PackingSpec(packing="best_fit", pack_buffer=2, max_segments=3)
    assert packing.horizon == 6
    pieces = [make_piece(0, 9)] + [make_piece(i, 5) for i in range(1, 12)]
    # The 9-token row has room for no 5; it leaves once 6 examples were read after it opened.
    assert idents(pack(pieces, SPEC, packing))[:4] == [[1, 2], [3, 4], [0], [5, 6]]

    rng = np.random.default_rng(2)
    lengths = [int(rng.choice([2, 3, 9])) for _ in range(400)]
    iterator = stream([make_piece(i, n) for i, n in enumerate(lengths)], packing=packing)
    consumed = []
    for _ in iterator:
        consumed.append(iterator.get_state()["consumed"])
    assert max(consumed) <= packing.horizon + 1


def test_segments_never_attend_across_examples_and_positions_restart():
    rng = np.random.default_rng(0)
    pieces = [make_piece(i, int(rng.integers(1, 7))) for i in range(40)]
    rows = list(stream(pieces, packing=PackingSpec(packing="best_fit", pack_buffer=4)))
    assert sum(int(r["segment_ids"].max()) for r in rows) == 40  # every example exactly once
    segments = np.stack([r["segment_ids"] for r in rows])
    mask = np.asarray(attention_mask(segments))[:, 0]
    for row, seg, allowed in zip(rows, segments, mask, strict=True):
        i, j = np.meshgrid(np.arange(SPEC.seq_len), np.arange(SPEC.seq_len), indexing="ij")
        expected = ((seg[i] == seg[j]) & (seg[i] > 0) & (j <= i)) | (i == j)
        np.testing.assert_array_equal(allowed, expected)
        for k in range(1, seg.max() + 1):
            in_segment = np.flatnonzero(seg == k)
            assert (np.diff(in_segment) == 1).all()  # contiguous
            np.testing.assert_array_equal(row["positions"][in_segment], np.arange(len(in_segment)))
            assert len(set(row["tokens"][in_segment].tolist())) == 1  # one example per segment
        assert (row["target_weights"][seg == 0] == 0).all() and (row["positions"][seg == 0] == 0).all()


def test_vision_patches_follow_the_media_slots_and_each_item_has_its_own_segment():
    media = {1: (1, 2), 2: (1,), 3: (), 4: (1,)}
    pieces = [make_piece(ident, length, media[ident]) for ident, length in ((1, 6), (2, 3), (3, 4), (4, 5))]
    packing = PackingSpec(packing="first_fit", pack_buffer=2)
    assert idents(pack(pieces, SPEC, packing)) == [[1, 2], [3, 4]]
    for row in stream(pieces, packing=packing):
        slots = row["tokens"] == IMAGE_PAD
        segment = row["segment_ids"]
        # What Transformer.embed_tokens gathers: the n-th slot of the row takes merged vision token n,
        # i.e. patches 4n..4n+3 (merge 2×2).
        merged = np.cumsum(slots) - 1
        for t in np.flatnonzero(slots):
            group = slice(4 * merged[t], 4 * merged[t] + 4)
            ident = int(row["tokens"][segment == segment[t]][0]) - 100
            nth_slot = int(slots[(segment == segment[t]) & (np.arange(len(slots)) < t)].sum())
            want = make_piece(ident, 10, media[ident]).patches[4 * nth_slot, 0]
            np.testing.assert_array_equal(row["patches"][group, 0], want)
        # One patch segment per media item, numbered 1..M in slot order, each a contiguous run.
        numbers = row["patch_segments"][row["patch_segments"] > 0]
        assert (np.diff(numbers) >= 0).all()
        assert set(numbers.tolist()) == set(range(1, int(numbers.max(initial=0)) + 1))
        in_row = {int(row["tokens"][segment == k][0]) - 100 for k in range(1, segment.max() + 1)}
        assert int(numbers.max(initial=0)) == sum(len(media[i]) for i in in_row)
        assert len(numbers) == 4 * int(slots.sum())


def test_caps_on_segments_and_patches_are_respected():
    small = [make_piece(i, 2) for i in range(9)]
    rows = pack(small, SPEC, PackingSpec(packing="best_fit", max_segments=2))
    assert [len(r) for r in rows] == [2, 2, 2, 2, 1]
    # Two media items of 2 slots each fill max_patches=16; a third example with media needs a new row.
    media = [make_piece(0, 3, (2,)), make_piece(1, 3, (2,)), make_piece(2, 3, (1,))]
    rows = pack(media, SPEC, PackingSpec(packing="best_fit"))
    assert idents(rows) == [[0, 1], [2]]
    for row in stream(media):
        assert int((row["patch_segments"] > 0).sum()) <= SPEC.max_patches


def test_overlong_examples_stop_the_run_or_are_skipped_and_counted():
    pieces = [make_piece(0, 4), make_piece(1, 11), make_piece(2, 3), make_piece(3, 4, (5,))]
    with pytest.raises(AssemblyError, match=r"hand\.jsonl:1: 11 tokens .* exceed data\.seq_len=10"):
        list(stream(pieces, packing=PackingSpec(packing="best_fit", overlong="error")))
    iterator = stream(pieces, packing=PackingSpec(packing="best_fit", overlong="skip"))
    rows = list(iterator)
    assert [int(r["segment_ids"].max()) for r in rows] == [2]  # 4 + 3 in one row; 11 tokens and 20 patches skipped
    counts = packing_statistics(iterator.get_state())
    assert counts == {"rows": 1, "examples": 2, "tokens": 7, "skipped_overlong": 2}


def test_one_example_per_row_equals_assemble():
    spec = replace(SPEC, vision=None, seq_len=12, max_patches=0)
    example = Example({"input_ids": np.arange(1, 9, dtype=np.int32),
                       "target_weights": np.array([0, 0, 0, 1, 1, 1, 1, 1], np.float32)}, {"source": "x", "line": 1})
    row = row_of([piece_of(example, spec)], spec)
    expected = assemble(example, spec)
    assert row.keys() == expected.keys()
    for key in row:
        np.testing.assert_array_equal(row[key], expected[key], err_msg=key)


@pytest.mark.parametrize("mode", ["none", "first_fit", "best_fit"])
def test_packing_state_restores_the_exact_next_rows(mode):
    rng = np.random.default_rng(1)
    pieces = [make_piece(i, int(rng.integers(1, 9)), (1,) if i % 3 == 0 else ()) for i in range(30)]
    packing = PackingSpec(packing=mode, pack_buffer=4, max_segments=3, overlong="skip")

    def make():
        source = grain.MapDataset.source(pieces).shuffle(seed=5).repeat(None, reseed_each_epoch=True)
        return iter(PackIterDataset(source.to_iter_dataset(), SPEC, packing))

    straight = make()
    expected = [next(straight) for _ in range(60)]
    first = make()
    for _ in range(23):
        next(first)
    state = json.loads(json.dumps(first.get_state()))  # what Grain's checkpoint handler writes
    resumed = make()
    resumed.set_state(state)
    for want in expected[23:]:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert packing_statistics(resumed.get_state()) == packing_statistics(straight.get_state())


def test_packing_spec_refuses_unknown_modes_and_policies():
    with pytest.raises(ValueError, match="data.packing"):
        PackingSpec(packing="greedy")
    with pytest.raises(ValueError, match="truncation is not offered"):
        PackingSpec(overlong="truncate")
    with pytest.raises(ValueError, match="max_segments"):
        PackingSpec(max_segments=0)
