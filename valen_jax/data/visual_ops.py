"""The photometric ops of seed 004's `visual_aug`, on PIL RGB images, size and geometry unchanged.

Formulas follow `imagecorruptions` (Hendrycks & Dietterich's ImageNet-C code), which defines five
levels; seed 004 asks for severities 1–10, so its levels 1–5 sit at our even severities 2, 4, 6,
8, 10 and odd severities lie between them (severity 1 below level 1). Parameters in pixels are
for a 224-px short side (ImageNet-C's size) and scale up with larger images, never down, so a
given severity looks alike at any resolution.

| severity            | 1    | 2   | 3    | 4   | 5    | 6   | 7    | 8   | 9    | 10  |
| gaussian_blur σ     | 0.5  | 1   | 1.5  | 2   | 2.5  | 3   | 3.5  | 4   | 5    | 6   |
| motion_blur σ       | 1.5  | 3   | 4    | 5   | 6.5  | 8   | 10   | 12  | 13.5 | 15  |
| zoom_blur max zoom  | 1.06 | 1.11| 1.13 | 1.16| 1.18 | 1.21| 1.23 | 1.26| 1.28 | 1.31|
| zoom_blur step      | .01  | .01 | .01  | .01 | .02  | .02 | .02  | .02 | .03  | .03 |
| fog amount          | 1.0  | 1.5 | 1.75 | 2.0 | 2.25 | 2.5 | 2.5  | 2.5 | 2.75 | 3.0 |
| fog decay           | 2.0  | 2.0 | 2.0  | 2.0 | 1.85 | 1.7 | 1.6  | 1.5 | 1.45 | 1.4 |
| glass_blur σ        | 0.6  | 0.7 | 0.8  | 0.9 | 0.95 | 1.0 | 1.05 | 1.1 | 1.3  | 1.5 |
| glass_blur max Δ    | 1    | 1   | 1    | 2   | 2    | 2   | 3    | 3   | 3    | 4   |
| glass_blur rounds   | 1    | 2   | 3    | 1   | 2    | 3   | 1    | 2   | 3    | 2   |
| light ΔV (±)        | .05  | .1  | .15  | .2  | .25  | .3  | .35  | .4  | .45  | .5  |

Where this departs from imagecorruptions, for the seed's "Geometry is unchanged, so the labels
stay valid": motion blur is a Gaussian of σ along a line at an angle drawn from ±45°, centred on
each pixel (ImageMagick's, which they call, trails to one side and moves the apparent object);
it runs as shear → horizontal blur → exact inverse shear in Pillow's C code, 5× faster than
summing shifted copies in numpy. Glass blur moves each pixel at most Δ px (a gather, not their per-pixel
Python swap loop, which is too slow for a loader); fog's plasma fractal is made of upsampled
random octaves, so it covers any image size (theirs is a 256-px map). `light` is their
`brightness` (HSV value shifted by ΔV) with a random sign, as lighting changes either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageFilter

REFERENCE_SIDE = 224  # ImageNet-C's image size, which the pixel parameters are tuned for
GAUSSIAN_SIGMA = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)
MOTION_SIGMA = (1.5, 3.0, 4.0, 5.0, 6.5, 8.0, 10.0, 12.0, 13.5, 15.0)
ZOOM_MAX = (1.06, 1.11, 1.13, 1.16, 1.18, 1.21, 1.23, 1.26, 1.28, 1.31)
ZOOM_STEP = (0.01, 0.01, 0.01, 0.01, 0.02, 0.02, 0.02, 0.02, 0.03, 0.03)
FOG_AMOUNT = (1.0, 1.5, 1.75, 2.0, 2.25, 2.5, 2.5, 2.5, 2.75, 3.0)
FOG_DECAY = (2.0, 2.0, 2.0, 2.0, 1.85, 1.7, 1.6, 1.5, 1.45, 1.4)
GLASS_SIGMA = (0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.3, 1.5)
GLASS_DELTA = (1, 1, 1, 2, 2, 2, 3, 3, 3, 4)
GLASS_ROUNDS = (1, 2, 3, 1, 2, 3, 1, 2, 3, 2)
LIGHT_DELTA = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)


def _size_scale(image: Image.Image) -> float:
    return max(1.0, min(image.size) / REFERENCE_SIDE)


def _to_float(image: Image.Image) -> np.ndarray:
    return np.asarray(image, np.float32) / 255.0


def _to_image(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(np.clip(np.rint(pixels * 255.0), 0, 255).astype(np.uint8), "RGB")


def gaussian_blur(image: Image.Image, severity: int, rng: np.random.Generator) -> Image.Image:
    return image.filter(ImageFilter.GaussianBlur(GAUSSIAN_SIGMA[severity - 1] * _size_scale(image)))


def motion_blur(image: Image.Image, severity: int, rng: np.random.Generator) -> Image.Image:
    sigma = MOTION_SIGMA[severity - 1] * _size_scale(image)
    angle = math.radians(rng.uniform(-45.0, 45.0))  # imagecorruptions' angle range
    slope = math.tan(angle)
    # Edge-replicated margin wider than the blur's reach, so the shear's empty corners never
    # bleed into the image (|slope| <= 1: the line leaves the margin sideways first).
    pad = int(math.ceil(3 * sigma)) + 2
    padded = Image.fromarray(np.pad(np.asarray(image), ((pad, pad), (pad, pad), (0, 0)), mode="edge"))
    width, height = padded.size
    extra = int(math.ceil(abs(slope) * width))
    offset = extra if slope > 0 else 0
    # Vertical shear y' = y - slope·x + offset turns the blur direction horizontal; a unit step
    # along x' is 1/cos(angle) pixels along the line, hence the σ·cos(angle).
    sheared = padded.transform((width, height + extra), Image.AFFINE, (1, 0, 0, slope, 1, -offset),
                               Image.BILINEAR)
    blurred = sheared.filter(ImageFilter.GaussianBlur((sigma * math.cos(angle), 0)))
    back = blurred.transform((width, height), Image.AFFINE, (1, 0, 0, -slope, 1, offset), Image.BILINEAR)
    return back.crop((pad, pad, pad + image.size[0], pad + image.size[1]))


def zoom_blur(image: Image.Image, severity: int, rng: np.random.Generator) -> Image.Image:
    width, height = image.size
    zooms = np.arange(1.0, ZOOM_MAX[severity - 1], ZOOM_STEP[severity - 1])[1:]
    out = _to_float(image)
    for zoom in zooms:
        # Centred crop of 1/zoom of each side stretched back: the image centre stays in place.
        cw, ch = width / zoom, height / zoom
        box = ((width - cw) / 2, (height - ch) / 2, (width + cw) / 2, (height + ch) / 2)
        out += _to_float(image.resize((width, height), Image.BILINEAR, box=box))
    return _to_image(out / (len(zooms) + 1))


def fractal_noise(height: int, width: int, decay: float, rng: np.random.Generator) -> np.ndarray:
    """Plasma-like noise in [0, 1]: octave k is a (2^k + 1)² random grid upsampled to the image,
    with amplitude decay^-k (imagecorruptions' `wibbledecay`)."""
    out = np.zeros((height, width), np.float32)
    octaves = max(1, math.ceil(math.log2(max(height, width))))
    for k in range(1, octaves + 1):
        grid = rng.uniform(-1.0, 1.0, (2 ** k + 1, 2 ** k + 1)).astype(np.float32)
        layer = Image.fromarray(grid, "F").resize((width, height), Image.BICUBIC)
        out += np.asarray(layer, np.float32) * decay ** -(k - 1)
    low, high = float(out.min()), float(out.max())
    return (out - low) / (high - low) if high > low else np.zeros_like(out)


def fog(image: Image.Image, severity: int, rng: np.random.Generator) -> Image.Image:
    amount, decay = FOG_AMOUNT[severity - 1], FOG_DECAY[severity - 1]
    pixels = _to_float(image)
    peak = float(pixels.max())
    width, height = image.size
    pixels = pixels + amount * fractal_noise(height, width, decay, rng)[..., None]
    # imagecorruptions' normalisation: brightens, keeps the brightest input level at its value.
    return _to_image(pixels * peak / (peak + amount))


def glass_blur(image: Image.Image, severity: int, rng: np.random.Generator) -> Image.Image:
    scale = _size_scale(image)
    blur = ImageFilter.GaussianBlur(GLASS_SIGMA[severity - 1] * scale)
    delta = max(1, int(round(GLASS_DELTA[severity - 1] * scale)))
    pixels = np.asarray(image.filter(blur))
    height, width = pixels.shape[:2]
    rows, cols = np.indices((height, width))
    for _ in range(GLASS_ROUNDS[severity - 1]):
        dy = rng.integers(-delta, delta + 1, (height, width))
        dx = rng.integers(-delta, delta + 1, (height, width))
        pixels = pixels[np.clip(rows + dy, 0, height - 1), np.clip(cols + dx, 0, width - 1)]
    return Image.fromarray(pixels, "RGB").filter(blur)


def light(image: Image.Image, severity: int, rng: np.random.Generator) -> Image.Image:
    shift = LIGHT_DELTA[severity - 1] * (1.0 if rng.random() < 0.5 else -1.0)
    pixels = _to_float(image)
    value = pixels.max(axis=-1, keepdims=True)
    shifted = np.clip(value + shift, 0.0, 1.0)
    # HSV with V shifted and H, S kept is RGB scaled by V'/V; black (V = 0) becomes grey V'.
    ratio = np.divide(shifted, value, out=np.zeros_like(value), where=value > 0)
    return _to_image(np.where(value > 0, pixels * ratio, shifted))


OPS: dict[str, Callable[[Image.Image, int, np.random.Generator], Image.Image]] = {
    "motion_blur": motion_blur,
    "gaussian_blur": gaussian_blur,
    "zoom_blur": zoom_blur,
    "fog": fog,
    "glass_blur": glass_blur,
    "light": light,
}


def apply_op(image: Image.Image, op: str, severity: int, rng: np.random.Generator) -> Image.Image:
    if not 1 <= severity <= 10:
        raise ValueError(f"severity {severity} outside 1..10")
    out = OPS[op](image.convert("RGB"), severity, rng)
    assert out.size == image.size, (op, out.size, image.size)  # geometry must not change
    return out
