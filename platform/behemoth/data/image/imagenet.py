"""ImageNet's validation set comes flat (val/ILSVRC2012_val_00000001.JPEG, ...) with its labels in a separate
file; an image folder needs val/<class>/*.JPEG. `behemoth data split-val VAL_DIR --labels FILE` moves each image
into its class's folder (in place: no second copy of 6.4 GB). FILE: Kaggle's LOC_val_solution.csv
(`ImageId,PredictionString`, the class the first word of PredictionString) or lines of `FILENAME CLASS`.

Every row is checked and every move planned before anything moves: class and file names are plain names (one
path component: a class of `../x` or `/abs` would move images out of the folder), every image in the folder
has a label and every label an image, and no move lands on a file that exists. The plan is made again from the
folder as it is on every run, so a run stopped midway (a failed move, Ctrl-C) is finished by the same command
(an image already in its class folder counts as moved) or undone by it with `--undo`.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path

from behemoth.data.image.image_shards import IMAGE_EXTENSIONS
from behemoth.errors import DataError
from behemoth.storage.paths import PART_MAX, is_inside

# the formats an image folder is read in (images.IMAGE_SUFFIXES): an image split-val left behind in the flat
# folder would be refused there as "val holds images directly"
IMAGE_SUFFIXES = tuple(f".{ext}" for ext in IMAGE_EXTENSIONS)
_KAGGLE_COLUMNS = ("ImageId", "PredictionString")


@dataclass(frozen=True)
class Label:
    stem: str  # the image's file name without its suffix
    cls: str
    where: str  # FILE:LINE of its row, for errors


@dataclass
class SplitResult:
    moved: dict[str, int] = field(default_factory=dict)  # images moved per class folder
    in_place: int = 0  # images found where this run would have moved them (a finished or earlier run's)


def read_labels(path: Path) -> list[Label]:
    """Every row of the labels file, its names checked (plain names: no folder, no `..`)."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a CSV saved by Excel starts with a BOM
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read the labels file {path}: {e}") from None
    kaggle = text.startswith("ImageId,")  # its ImageId is the file's stem; a FILENAME has a suffix
    labels: dict[str, Label] = {}
    for where, name, cls in _kaggle_rows(path, text) if kaggle else _line_rows(path, text):
        name = _plain(name, "the image id" if kaggle else "the file name", where)
        label = Label(name if kaggle else Path(name).stem, _plain(cls, "the class", where), where)
        seen = labels.setdefault(label.stem, label)
        if seen.cls != label.cls:
            raise DataError(f"{where}: image {label.stem} is labelled {label.cls}, and {seen.cls} at {seen.where}; "
                            f"keep one of the two rows")
    return list(labels.values())


def _kaggle_rows(path: Path, text: str):
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in _KAGGLE_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        header = ",".join(reader.fieldnames or [])
        raise DataError(f"{path}:1: no column {', '.join(missing)} in the header {header!r}; Kaggle's "
                        f"LOC_val_solution.csv starts with 'ImageId,PredictionString'")
    for row in reader:
        where = f"{path}:{reader.line_num}"
        words = (row["PredictionString"] or "").split()
        if not words:
            raise DataError(f"{where}: column PredictionString is empty; it needs the image's class as its first "
                            f"word (e.g. 'n01440764 ...'): fix or remove the row")
        yield where, row["ImageId"] or "", words[0]


def _line_rows(path: Path, text: str):
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            parts = line.split()
            if len(parts) != 2:
                raise DataError(f"{path}:{n}: expected 'FILENAME CLASS', got {line!r}")
            yield f"{path}:{n}", parts[0], parts[1]


def _plain(name: str, what: str, where: str) -> str:
    """`name` where it is one path component that stays inside the folder, else the error naming the row."""
    if "/" in name or not is_inside(name):  # (one part: a file or folder directly in the folder)
        raise DataError(f"{where}: {what} {name!r} is not a plain name (one folder or file name: not empty, no "
                        f"'/', '\\' or '..', at most {PART_MAX} bytes); fix the row: nothing was moved")
    return name


def split_val(folder: Path, labels_path: Path, undo: bool = False) -> SplitResult:
    """Move every labelled image directly in `folder` into folder/<class>/ (or, `undo`, back); see the module."""
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder: give the flat validation folder (e.g. /data/imagenet/val)")
    labels = read_labels(labels_path)
    moves, result = _plan(folder, labels, labels_path, undo)
    for done, (label, src, dst) in enumerate(moves):
        try:
            dst.parent.mkdir(exist_ok=True)
            if dst.exists() or dst.is_symlink():  # appeared since the plan: never overwritten
                raise FileExistsError(17, "exists", str(dst))
            src.rename(dst)
        except OSError as e:
            raise DataError(f"moved {done} of {len(moves)} images, then could not move {src} to {dst} "
                            f"({e.strerror or e}, row {label.where}); fix that and rerun the same command to finish, "
                            f"or rerun it with --undo to move them back") from None
        key = folder.name if undo else label.cls
        result.moved[key] = result.moved.get(key, 0) + 1
    if undo:
        for cls in {label.cls for label, _, _ in moves}:
            if not any((folder / cls).iterdir()):
                (folder / cls).rmdir()  # the class folders the split made, now empty
    return result


def _plan(folder: Path, labels: list[Label], labels_path: Path, undo: bool):
    """[(label, from, to)] for every image still to move, and the result so far (images already in place);
    the error naming the first row in the way where anything would go wrong."""
    flat = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES:
            flat.setdefault(p.stem, []).append(p)
    by_class: dict[str, dict[str, list[Path]]] = {}
    moves, result, missing = [], SplitResult(), []
    for label in labels:
        placed = _class_listing(folder, label, by_class).get(label.stem, [])
        here = flat.pop(label.stem, [])
        sources, in_place = (placed, here) if undo else (here, placed)
        if not sources and not in_place:
            missing.append(label.stem)
        result.in_place += len(in_place)
        for src in sources:
            dst = (folder if undo else folder / label.cls) / src.name
            if dst.exists() or dst.is_symlink():
                raise DataError(f"{labels_path}: row {label.where} would move {src} onto the existing {dst}; move "
                                f"or rename one of the two: nothing was moved")
            moves.append((label, src, dst))
    unlabelled = [p.name for ps in flat.values() for p in ps] if not undo else []
    if unlabelled or missing:
        raise DataError(f"{folder} and {labels_path} disagree: {len(unlabelled)} images without a label "
                        f"({', '.join(unlabelled[:3])}), {len(missing)} labels without an image "
                        f"({', '.join(missing[:3])}); nothing was moved")
    return moves, result


def _class_listing(folder: Path, label: Label, by_class: dict) -> dict[str, list[Path]]:
    """The images in folder/<class> by stem (listed once per class); the error where that is not a folder."""
    if label.cls not in by_class:
        path = folder / label.cls
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise DataError(f"row {label.where}: {path} is not a folder of this one (a file or a link); move it "
                            f"away or fix the row: nothing was moved")
        listing: dict[str, list[Path]] = {}
        for p in sorted(path.iterdir()) if path.is_dir() else []:
            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES:
                listing.setdefault(p.stem, []).append(p)
        by_class[label.cls] = listing
    return by_class[label.cls]
