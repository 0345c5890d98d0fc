"""ImageNet's validation set comes flat (val/ILSVRC2012_val_00000001.JPEG, ...) with its labels in a separate
file; an image folder needs val/<class>/*.JPEG. `behemoth data split-val VAL_DIR --labels FILE` moves each image
into its class's folder (in place: no second copy of 6.4 GB). FILE: Kaggle's LOC_val_solution.csv
(`ImageId,PredictionString`, the class the first word of PredictionString) or lines of `FILENAME CLASS`.
Every image in the folder must have a label, and every label an image, before anything moves.
"""

from __future__ import annotations

import csv
from pathlib import Path

from behemoth.errors import DataError

IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


def read_labels(path: Path) -> dict[str, str]:
    """Image file stem -> class name."""
    text = path.read_text()
    if text.startswith("ImageId,"):
        return {row["ImageId"]: row["PredictionString"].split()[0] for row in csv.DictReader(text.splitlines())}
    labels = {}
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            parts = line.split()
            if len(parts) != 2:
                raise DataError(f"{path}:{n}: expected 'FILENAME CLASS', got {line!r}")
            labels[Path(parts[0]).stem] = parts[1]
    return labels


def split_val(folder: Path, labels_path: Path) -> dict[str, int]:
    """Move every image directly in `folder` into folder/<class>/; returns images per class."""
    labels = read_labels(labels_path)
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise DataError(f"{folder} holds no images directly (already split into class folders?)")
    unlabelled = [p.name for p in images if p.stem not in labels]
    missing = sorted(set(labels) - {p.stem for p in images})
    if unlabelled or missing:
        raise DataError(f"{folder} and {labels_path} disagree: {len(unlabelled)} images without a label "
                        f"({', '.join(unlabelled[:3])}), {len(missing)} labels without an image "
                        f"({', '.join(missing[:3])}); nothing was moved")
    counts: dict[str, int] = {}
    for image in images:
        cls = labels[image.stem]
        (folder / cls).mkdir(exist_ok=True)
        image.rename(folder / cls / image.name)
        counts[cls] = counts.get(cls, 0) + 1
    return counts
