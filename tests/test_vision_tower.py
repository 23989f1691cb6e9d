"""Our ViT's absolute grid positions (issue 25): off, the forward is the one it always was; on, a
vision token's features say where in the image it is, which its relative rotary positions cannot."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from valen_jax.models.config import VisionConfig
from valen_jax.models.vision import VisionEncoder, grid_position_embeddings

CFG = VisionConfig(patch_size=2, merge_size=2, temporal_patch_size=1, dim=16, num_layers=1, num_heads=2, mlp_dim=32)


def _inputs(grid: int = 4):
    rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    # the processor's window order: m×m windows in row-major order, patches row-major within each
    order = np.stack([rows, cols], -1).reshape(grid // 2, 2, grid // 2, 2, 2).transpose(0, 2, 1, 3, 4).reshape(-1, 2)
    positions = np.concatenate([np.zeros((len(order), 1), np.int32), order], axis=1)[None]
    patches = np.ones((1, len(order), CFG.patch_dim), np.float32)  # a uniform image
    return jnp.asarray(patches), jnp.asarray(positions), jnp.ones((1, len(order)), jnp.int32)


def test_grid_position_embeddings_encode_row_then_column_as_sin_cos():
    emb = grid_position_embeddings(jnp.array([0, 3]), jnp.array([2, 0]), 8)
    assert emb.shape == (2, 8)
    np.testing.assert_allclose(emb[0, :4], [0.0, 0.0, 1.0, 1.0], atol=1e-6)  # row 0: sin 0, cos 0
    np.testing.assert_allclose(emb[1, 4:], [0.0, 0.0, 1.0, 1.0], atol=1e-6)  # column 0
    np.testing.assert_allclose(emb[1, 0], np.sin(3.0), rtol=1e-6)


def test_on_a_uniform_image_tokens_differ_only_with_absolute_positions():
    patches, positions, segments = _inputs()
    plain = VisionEncoder(CFG, 8, "float32", "float32", nnx.Rngs(0))(patches, positions, segments)
    # relative rotary positions alone: every window of a uniform image is the same vector
    np.testing.assert_allclose(plain, jnp.broadcast_to(plain[:, :1], plain.shape), rtol=1e-5, atol=1e-5)
    placed = VisionEncoder(dataclasses.replace(CFG, absolute_positions=True), 8, "float32", "float32",
                           nnx.Rngs(0))(patches, positions, segments)
    assert float(jnp.min(jnp.linalg.norm(placed[0, 1:] - placed[0, :1], axis=-1))) > 1e-3


def test_absolute_positions_are_refused_for_an_imported_tower():
    with pytest.raises(ValueError, match="option of the valen tower"):
        dataclasses.replace(CFG, family="qwen2_vl", absolute_positions=True)


def test_fourier_coordinate_rows_make_neighbouring_values_alike():
    from valen_jax.models.build import fourier_coordinate_rows

    table = jnp.zeros((1100, 32), jnp.float32) + 7.0
    ids = np.arange(50, 1051)
    out = np.asarray(fourier_coordinate_rows(table, ids, seed=0))
    assert (out[:50] == 7.0).all() and (out[1051:] == 7.0).all()  # other rows untouched
    rows = out[ids]
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 0.02 * np.sqrt(32), rtol=1e-4)
    # row_u · row_v depends on u − v alone: a² Σ_k cos(πk(u − v)/1000), k = 1..8
    gram = rows @ rows.T
    a2 = (0.02 ** 2) * 32 / 8
    for u, v in ((0, 0), (10, 30), (500, 520), (0, 1000)):
        expected = a2 * np.sum(np.cos(np.pi * np.arange(1, 9) * (u - v) / 1000))
        assert gram[u, v] == pytest.approx(expected, abs=1e-6)
    assert gram[500, 505] > 0.9 * gram[500, 500] and gram[500, 800] < 0.2 * gram[500, 500]
