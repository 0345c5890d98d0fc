"""A learnable image classification dataset written as real image files in the ImageFolder layout.

Ten classes = 5 shapes (disk, square, ring, plus, bar) x 2 colour families (warm, cool). Position, size,
exact hue, background and noise are random, so a model must learn shape and colour, not a fixed pixel.
Every class is symmetric under a horizontal flip, so flip augmentation keeps labels true. Deterministic for
a seed: image i of class c in a split is drawn from rng(seed, split, c, i).

Two kinds: the demo's small square PNGs (flat background, noise), and ImageNet-shaped JPEGs (`synth_photo`):
landscape W x H for 70 %, portrait H x W for 20 %, 10 % at twice the size, over a photograph-like background
(1/f noise, the spectrum of natural images, with a light gradient), the shape filled with a texture, sensor
noise, written at JPEG quality 90-97: about ImageNet's file sizes (~100 KB at 500x375) and so its decoding
cost. Synthetic still: benchmarks of the decoding path use real photographs (bench/photos.py).
"""

from __future__ import annotations

import colorsys
from pathlib import Path

import numpy as np
from PIL import Image

from behemoth.progress import progress
from behemoth.storage.paths import local_out_folder

SHAPES = ("disk", "square", "ring", "plus", "bar")
FAMILIES = ("warm", "cool")
CLASS_NAMES = [f"{shape}_{family}" for family in FAMILIES for shape in SHAPES]


def _shape_mask(shape: str, size: int, rng: np.random.Generator, width: int | None = None) -> np.ndarray:
    """The shape's pixels in a size x size image (or size high and `width` wide), at a random place."""
    width = width or size
    radius = rng.uniform(0.22, 0.36) * min(size, width)
    cy, cx = rng.uniform([radius, radius], [size - radius, width - radius])
    y, x = np.mgrid[0:size, 0:width].astype(np.float32) + 0.5
    dy, dx = y - cy, x - cx
    thick = radius * 0.35
    if shape == "disk":
        return dx**2 + dy**2 <= radius**2
    if shape == "square":
        return (np.abs(dx) <= radius * 0.85) & (np.abs(dy) <= radius * 0.85)
    if shape == "ring":
        r2 = dx**2 + dy**2
        return (r2 <= radius**2) & (r2 >= (radius - thick) ** 2)
    if shape == "plus":
        return (((np.abs(dx) <= thick / 2) & (np.abs(dy) <= radius))
                | ((np.abs(dy) <= thick / 2) & (np.abs(dx) <= radius)))
    return (np.abs(dy) <= thick / 2) & (np.abs(dx) <= radius)  # horizontal bar


def synth_image(class_index: int, size: int, rng: np.random.Generator) -> np.ndarray:
    shape = SHAPES[class_index % len(SHAPES)]
    colour = _class_colour(class_index, rng)
    background = rng.uniform(40, 150) + rng.normal(0, 12, size=(1, 1, 3))
    img = np.broadcast_to(background, (size, size, 3)).copy()
    img[_shape_mask(shape, size, rng)] = colour
    img += rng.normal(0, 18, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _class_colour(class_index: int, rng: np.random.Generator) -> np.ndarray:
    family = FAMILIES[class_index // len(SHAPES)]
    hue = rng.uniform(-0.08, 0.1) % 1.0 if family == "warm" else rng.uniform(0.45, 0.65)
    return np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.6, 1.0))) * 255


def _pink_noise(h: int, w: int, rng: np.random.Generator, alpha: float) -> np.ndarray:
    """[h, w] noise with a 1/f**alpha amplitude spectrum (natural images: alpha ~1-2), scaled to unit std."""
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    f = np.sqrt(fx**2 + fy**2)
    f[0, 0] = 1.0
    spectrum = (rng.normal(size=f.shape) + 1j * rng.normal(size=f.shape)) / f**alpha
    spectrum[0, 0] = 0
    noise = np.fft.irfft2(spectrum, s=(h, w))
    return noise / (noise.std() + 1e-8)


def synth_photo(class_index: int, width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """A photograph-like uint8 [height, width, 3] picture of the class's shape and colour family."""
    shape = SHAPES[class_index % len(SHAPES)]
    colour = _class_colour(class_index, rng)
    alpha = rng.uniform(1.0, 1.6)
    mix = rng.uniform(0.3, 1.0, size=(3, 3))  # channels correlated, as in photographs
    texture = np.stack([_pink_noise(height, width, rng, alpha) for _ in range(3)], axis=-1) @ mix.T
    base = rng.uniform(60, 160, size=3) + texture * rng.uniform(25, 45)
    gradient = np.linspace(-1, 1, height)[:, None, None] * rng.uniform(-30, 30, size=3)
    img = base + gradient
    mask = _shape_mask(shape, height, rng, width)
    img[mask] = colour + texture[mask] * rng.uniform(8, 16)
    img += rng.normal(0, rng.uniform(3, 6), size=img.shape)  # sensor noise
    return np.clip(img, 0, 255).astype(np.uint8)


def photo_size(size: tuple[int, int], rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) of one image: landscape for 70 %, portrait for 20 %, twice the size for 10 %."""
    w, h = size
    r = rng.random()
    return (w, h) if r < 0.7 else (h, w) if r < 0.9 else (2 * w, 2 * h)


def write_synth_images(out: str | Path, classes: int = 10, per_class: int = 200, val_per_class: int = 50,
                       size: int | tuple[int, int] = 32, seed: int = 0, image_format: str = "png") -> dict[str, int]:
    """Write out/{train,val}/<class>/<i>.png (square `size`, the demo's) or <i>.jpg (image_format "jpeg":
    photograph-like, `size` = (width, height) of the landscape ones). Returns the number of images per split."""
    if not 1 <= classes <= len(CLASS_NAMES):
        raise ValueError(f"--classes must be between 1 and {len(CLASS_NAMES)}")
    # a second run into the same folder (another --format, fewer classes) would leave both runs' images side by
    # side, one dataset silently doubled: only a new or empty folder is written
    out = local_out_folder(out, empty="the images")
    splits = (("train", per_class), ("val", val_per_class))
    images = [(split_id, split, c, i) for split_id, (split, n) in enumerate(splits) for c in range(classes)
              for i in range(n)]
    if image_format not in ("png", "jpeg"):
        raise ValueError(f"--format must be png or jpeg, got {image_format!r}")
    for split_id, split, c, i in progress(images, "writing demo images", unit="img"):
        folder = out / split / CLASS_NAMES[c]
        if i == 0:
            folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng([seed, split_id, c, i])
        if image_format == "png":
            square = size if isinstance(size, int) else size[0]
            Image.fromarray(synth_image(c, square, rng)).save(folder / f"{i:06d}.png")
        else:
            wh = (size, size * 3 // 4) if isinstance(size, int) else size
            Image.fromarray(synth_photo(c, *photo_size(wh, rng), rng)).save(
                folder / f"{i:06d}.jpg", "JPEG", quality=int(rng.integers(90, 98)))
    return {split: n * classes for split, n in splits}
