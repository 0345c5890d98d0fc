"""A learnable image classification dataset written as real PNG files in the ImageFolder layout.

Ten classes = 5 shapes (disk, square, ring, plus, bar) x 2 colour families (warm, cool). Position, size,
exact hue, background and noise are random, so a model must learn shape and colour, not a fixed pixel.
Every class is symmetric under a horizontal flip, so flip augmentation keeps labels true. Deterministic for
a seed: image i of class c in a split is drawn from rng(seed, split, c, i).
"""

from __future__ import annotations

import colorsys
from pathlib import Path

import numpy as np
from PIL import Image

from behemoth.progress import progress

SHAPES = ("disk", "square", "ring", "plus", "bar")
FAMILIES = ("warm", "cool")
CLASS_NAMES = [f"{shape}_{family}" for family in FAMILIES for shape in SHAPES]


def _shape_mask(shape: str, size: int, rng: np.random.Generator) -> np.ndarray:
    radius = rng.uniform(0.22, 0.36) * size
    cy, cx = rng.uniform(radius, size - radius, size=2)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
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
        return ((np.abs(dx) <= thick / 2) & (np.abs(dy) <= radius)) | ((np.abs(dy) <= thick / 2) & (np.abs(dx) <= radius))
    return (np.abs(dy) <= thick / 2) & (np.abs(dx) <= radius)  # horizontal bar


def synth_image(class_index: int, size: int, rng: np.random.Generator) -> np.ndarray:
    shape = SHAPES[class_index % len(SHAPES)]
    family = FAMILIES[class_index // len(SHAPES)]
    hue = rng.uniform(-0.08, 0.1) % 1.0 if family == "warm" else rng.uniform(0.45, 0.65)
    colour = np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.6, 1.0))) * 255
    background = rng.uniform(40, 150) + rng.normal(0, 12, size=(1, 1, 3))
    img = np.broadcast_to(background, (size, size, 3)).copy()
    img[_shape_mask(shape, size, rng)] = colour
    img += rng.normal(0, 18, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def write_synth_images(out: str | Path, classes: int = 10, per_class: int = 200, val_per_class: int = 50,
                       size: int = 32, seed: int = 0) -> dict[str, int]:
    """Write out/{train,val}/<class>/<i>.png. Returns the number of images per split."""
    if not 1 <= classes <= len(CLASS_NAMES):
        raise ValueError(f"--classes must be between 1 and {len(CLASS_NAMES)}")
    out = Path(out)
    splits = (("train", per_class), ("val", val_per_class))
    images = [(split_id, split, c, i) for split_id, (split, n) in enumerate(splits) for c in range(classes)
              for i in range(n)]
    for split_id, split, c, i in progress(images, "writing demo images", unit="img"):
        folder = out / split / CLASS_NAMES[c]
        if i == 0:
            folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng([seed, split_id, c, i])
        Image.fromarray(synth_image(c, size, rng)).save(folder / f"{i:06d}.png")
    return {split: n * classes for split, n in splits}
