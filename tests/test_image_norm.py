"""Issue 55: our tower's per-image pixel standardisation (valen_jax.models.image_norm). Each media item of a row
is standardised on its own, per colour channel, padding stays zero, and a small object on a background of
any colour comes out the same contrast, which the plain patch embedding cannot give."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image, ImageDraw

from valen_jax.data.media_defaults import MEDIA_DEFAULTS
from valen_jax.data.vision_processor import process_frames
from valen_jax.models.config import VisionConfig
from valen_jax.models.image_norm import standardised
from valen_jax.models.vision import VisionEncoder

TOWER = VisionConfig(patch_size=8, merge_size=2, temporal_patch_size=2, dim=32, num_layers=1, num_heads=2, mlp_dim=64,
                     absolute_positions=True)


def _ball(background: tuple[int, int, int], centre=(20, 40), radius=3) -> Image.Image:
    image = Image.new("RGB", (64, 64), background)
    cx, cy = centre
    ImageDraw.Draw(image).ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=(220, 30, 30))
    return image


def _row(*images: Image.Image):
    """The processor's patches of `images` in one row (item k = segment k), with 16 padding patches after."""
    media = [process_frames([image], TOWER, MEDIA_DEFAULTS) for image in images]
    patches = np.concatenate([m.patches for m in media] + [np.zeros((16, TOWER.patch_dim), np.float32)])
    positions = np.concatenate([m.positions for m in media] + [np.zeros((16, 3), np.int32)])
    segments = np.concatenate([np.full(len(m.patches), k + 1, np.int32) for k, m in enumerate(media)]
                              + [np.zeros(16, np.int32)])
    return jnp.asarray(patches[None]), jnp.asarray(positions[None]), jnp.asarray(segments[None])


def test_each_item_is_standardised_per_channel_on_its_own_and_padding_stays_zero():
    patches, _, segments = _row(_ball((40, 200, 90)), _ball((20, 230, 230), centre=(50, 10)))
    out = np.asarray(standardised(patches, segments))[0]
    segments = np.asarray(segments)[0]
    for item in (1, 2):
        pixels = out[segments == item].reshape(-1, 3, TOWER.patch_dim // 3)  # (C, t, p, p) flattened
        np.testing.assert_allclose(pixels.mean(axis=(0, 2)), 0.0, atol=1e-3)  # float32 sums of 8192 values
        np.testing.assert_allclose(pixels.std(axis=(0, 2)), 1.0, atol=1e-3)
    assert not out[segments == 0].any()


@pytest.mark.parametrize("background", [(30, 60, 150), (200, 220, 120), (128, 128, 128), (250, 240, 240)])
def test_a_small_ball_stands_out_on_any_background_colour(background):
    ball = _row(_ball(background))
    empty = _row(Image.new("RGB", (64, 64), background))
    on_ball = np.asarray(ball[0] != empty[0])[0]  # the ball's pixel values, in the processor's layout
    out = np.abs(np.asarray(standardised(ball[0], ball[2]))[0])
    # Every background pixel is ~0 and the ball is its contrast against it, many standard deviations out,
    # whatever the colour around it.
    assert out[~on_ball].max() < 0.5
    per_pixel = out.reshape(-1, 3, TOWER.patch_dim // 3).max(axis=1)  # the strongest channel of each pixel
    ball_pixels = on_ball.reshape(-1, 3, TOWER.patch_dim // 3).any(axis=1)
    assert per_pixel[ball_pixels].min() > 4.0


def test_a_flat_image_is_not_blown_up():
    patches, _, segments = _row(Image.new("RGB", (64, 64), (120, 120, 120)))
    out = np.asarray(standardised(patches, segments))
    assert np.isfinite(out).all() and np.abs(out).max() < 1e-4


def test_the_tower_embeds_raw_and_standardised_pixels_only_when_asked():
    patches, positions, segments = _row(_ball((40, 200, 90)))
    plain = VisionEncoder(TOWER, 16, "float32", "float32", nnx.Rngs(0))
    both = VisionEncoder(dataclasses.replace(TOWER, standardise_pixels=True), 16, "float32", "float32", nnx.Rngs(0))
    assert plain.patch_embed[...].shape == (TOWER.patch_dim, TOWER.dim)
    assert both.patch_embed[...].shape == (2 * TOWER.patch_dim, TOWER.dim)
    # With the standardised half's weights zeroed, the tower is the plain one: the raw half is untouched.
    both.patch_embed[...] = jnp.concatenate([plain.patch_embed[...], jnp.zeros_like(plain.patch_embed[...])])
    nnx.update(both, nnx.state(plain, nnx.Not(nnx.PathContains("patch_embed"))))
    np.testing.assert_allclose(both(patches, positions, segments), plain(patches, positions, segments), atol=1e-5)


def test_standardise_pixels_is_an_option_of_our_tower_only():
    with pytest.raises(ValueError, match="standardise_pixels is an option of the valen tower"):
        dataclasses.replace(TOWER, family="qwen2_vl", absolute_positions=False, standardise_pixels=True)
