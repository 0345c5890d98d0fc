"""Image classification data: the index of samples of the job's `data:` section (data/image/image_config.py:
ImageData), built on the driver.

Three layouts are read:
- ImageFolder: ROOT/{train,val}/<class>/*.{png,jpg,jpeg,webp,bmp,gif,tif,tiff} (the CIFAR/ImageNet layout);
- parquet: files with an image-bytes column (raw bytes, or Hugging Face's {"bytes", "path"} struct) and a
  label column (class names or integers);
- WebDataset tar shards: an image member and a .cls member per sample key (data/image/image_shards.py).

The driver only lists files and reads label columns (`build_index`), so a missing folder or an empty class
fails before Ray starts. The workers read, decode and augment the samples this index names
(data/image/image_batches.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from behemoth.errors import DataError
from behemoth.progress import progress
from behemoth.data.image import image_shards
from behemoth.data.image.image_config import ImageData, reads_folder
from behemoth.data.pipeline import expand_files
from behemoth.storage.store import Store

# The still-image formats, as the WebDataset reader takes them (image_shards.IMAGE_EXTENSIONS); anything else in
# a class folder (notes, JSON sidecars) is not an image and is left out of the index.
IMAGE_SUFFIXES = {f".{ext}" for ext in image_shards.IMAGE_EXTENSIONS}
# One row per sample. `row`: -1 for an image file; the row in `path` for parquet; for a tar shard the byte
# offset of the image member's data, `size` its length (-1 otherwise).
INDEX_SCHEMA = pa.schema([("sample_id", pa.int64()), ("path", pa.string()), ("row", pa.int64()),
                          ("label", pa.int64()), ("size", pa.int64())])


@dataclass
class ImageIndex:
    """What the workers need to find every sample: one row per image (path, parquet row, label), and where each
    split's decoded cache is (image_cache.CachePlan by split; None: decoded every epoch)."""

    train: pa.Table
    val: pa.Table
    classes: list[str]
    cache: dict | None = None


def build_index(cfg: ImageData) -> ImageIndex:
    """image_folder: data.root; image_parquet and image_webdataset: data.train_files / val_files. A task of
    one's own built on image classification (data.kind: module:Class) reads parquet when data.train_files is
    set, data.root otherwise."""
    keep = Path(cfg.cache_dir) if Store(cfg.cache_dir).is_local else None
    if cfg.kind == "image_webdataset":
        return index_webdataset(cfg.train_files, cfg.val_files, keep)
    if reads_folder(cfg):
        return index_image_folder(Path(cfg.root), keep)
    return index_parquet(cfg.train_files, cfg.val_files, cfg.image_column, cfg.label_column)


# ---------------------------------------------------------------------------------------------------------
# Indexing (driver side)


def index_image_folder(root: Path, cache_dir: Path | None = None) -> ImageIndex:
    """The index of an ImageFolder. With `cache_dir`, the listing is kept in cache_dir/index/, keyed by the
    class folders' modification times (a file added, removed or renamed in one changes its folder's): a rerun,
    a restart of the driver and every trial of a sweep stat the class folders instead of listing every file."""
    if not root.is_dir():
        raise DataError(f"data folder {root} does not exist: point data.root at a folder holding train/ and val/ "
                        f"class folders (ImageNet's flat val/ split into class folders: docs/quickstarts.md); to try "
                        f"behemoth on demo data instead: behemoth data synth-images --out /tmp/behemoth-demo-images "
                        f"and data.root=/tmp/behemoth-demo-images")
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise DataError(f"{root / split} is missing: data.root must hold train/ and val/ class folders")
    if any(p.suffix.lower() in IMAGE_SUFFIXES for p in (root / "val").iterdir() if p.is_file()):
        raise DataError(f"{root / 'val'} holds images directly: validation images go in one folder per class, as in "
                        f"train/ (ImageNet's come flat: behemoth data split-val {root / 'val'} --labels "
                        f"LOC_val_solution.csv)")
    kept = _listing_file(root, cache_dir) if cache_dir is not None else None
    index = _kept_index(kept)
    if index is not None:
        return index
    splits = {split: _list_class_folders(root / split) for split in ("train", "val")}
    classes = sorted(splits["train"])
    unknown = sorted(set(splits["val"]) - set(classes))
    if unknown:
        raise DataError(f"{root / 'val'} has classes that train/ lacks: {unknown}")
    to_index = {name: i for i, name in enumerate(classes)}
    tables = {
        split: _index_table([(str(p), -1, to_index[c]) for c, files in found.items() for p in files])
        for split, found in splits.items()
    }
    if kept is not None:
        _keep_listing(kept, tables, classes)
    return ImageIndex(tables["train"], tables["val"], classes)


def _listing_file(root: Path, cache_dir: Path) -> Path:
    import hashlib

    # the root as given, and the folder a relative one is read from: the kept paths are those a listing gives
    h = hashlib.sha256(f"{root}\0{'' if root.is_absolute() else os.getcwd()}".encode())
    for split in ("train", "val"):
        for entry in sorted(os.scandir(root / split), key=lambda e: e.name):
            if entry.is_dir():
                h.update(f"{split}/{entry.name}\0{entry.stat().st_mtime_ns}\0{entry.inode()}\n".encode())
    return cache_dir / "index" / f"{h.hexdigest()[:24]}.arrow"


def _kept_index(kept: Path | None) -> ImageIndex | None:
    """The index kept in `kept` (_keep_listing), or None where there is none or it cannot be read."""
    if kept is None or not kept.is_file():
        return None
    try:
        with pa.OSFile(str(kept), "rb") as f:
            table = pa.ipc.open_file(f).read_all()
        return _index_of_listing(table)
    except (OSError, pa.ArrowInvalid, KeyError, ValueError):
        return None  # damaged or of another version: listed again, and rewritten


def _keep_listing(file: Path, tables: dict, classes: list[str]) -> None:
    """Both splits' index in one Arrow file (a `split` column, the class names in its metadata), written to a
    temporary name and renamed: a reader sees the whole file or none."""
    both = pa.concat_tables([t.append_column("split", pa.array([s] * t.num_rows, pa.string()))
                             for s, t in tables.items()])
    both = both.replace_schema_metadata({"classes": json.dumps(classes)})
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, both.schema) as w:
            w.write_table(both)
        os.replace(tmp, file)
    except OSError:
        pass  # a read-only cache folder: listed again next time


def _index_of_listing(table: pa.Table) -> ImageIndex:
    import pyarrow.compute as pc

    classes = json.loads(table.schema.metadata[b"classes"])
    splits = {s: table.filter(pc.equal(table["split"], s)).drop_columns(["split"]) for s in ("train", "val")}
    return ImageIndex(splits["train"].cast(INDEX_SCHEMA), splits["val"].cast(INDEX_SCHEMA), classes)


def _list_class_folders(folder: Path) -> dict[str, list[Path]]:
    found = {}
    class_dirs = sorted(p for p in folder.iterdir() if p.is_dir())
    for class_dir in progress(class_dirs, f"indexing {folder}", unit="class"):
        files = sorted(p for p in class_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise DataError(f"class folder {class_dir} holds no images ({'/'.join(sorted(IMAGE_SUFFIXES))}): add "
                            f"some or remove it")
        found[class_dir.name] = files
    if not found:
        raise DataError(f"{folder} has no class folders: expected {folder}/<class>/*.png")
    return found


def index_parquet(train_files: list[str], val_files: list[str], image_col: str, label_col: str) -> ImageIndex:
    """The index of parquet files, every file's columns checked before Ray starts: a damaged file, an image
    column without the image bytes or a label column that is neither names nor integers is one line naming the
    file; so is a validation split with no rows or with labels the training split lacks."""
    labels, rows, integer = {}, {}, {}
    for split, patterns in (("train", train_files), ("val", val_files)):
        key = f"data.{split}_files"
        files = expand_files(patterns, key)
        rows[split], labels[split], integer[split] = _read_label_columns(files, image_col, label_col, key)
        if not rows[split]:
            raise DataError(f"data: the {split} split has no rows ({', '.join(files)}): fill the files or list others "
                            f"in {key}")
    # The training split's classes (one only validation holds could never be predicted), sorted: names as text,
    # integer labels as numbers (as text, 10 came before 2: a Hugging Face set's labels 0-999 were renumbered,
    # and a pretrained classifier's head of the same size kept with its rows permuted)
    seen = set(labels["train"].to_pylist())
    classes = sorted(seen, key=int) if integer["train"] else sorted(seen)
    to_index = {name: i for i, name in enumerate(classes)}
    _check_val_labels(rows["val"], labels["val"], to_index)
    tables = {
        split: _index_table([(p, r, to_index[str(v)]) for (p, r), v in zip(rows[split], labels[split].to_pylist())])
        for split in ("train", "val")
    }
    return ImageIndex(tables["train"], tables["val"], classes)


def _check_val_labels(rows: list[tuple[str, int]], labels: pa.Array, known: dict[str, int]) -> None:
    """DataError naming the first validation file holding a label the training rows lack (train cat/dog, val
    0/1 gave 4 classes, half of them never trained on), with a few of each side's labels."""
    unknown: dict[str, list[str]] = {}
    for (path, _), label in zip(rows, labels.to_pylist()):
        if label not in known:
            found = unknown.setdefault(path, [])
            if label not in found:
                found.append(label)
    if unknown:
        path, names = next(iter(unknown.items()))
        few = ", ".join(repr(n) for n in sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        trained = ", ".join(repr(n) for n in list(known)[:5]) + (", ..." if len(known) > 5 else "")
        raise DataError(f"{path}: label(s) {few} are not among the training rows' labels ({trained}): validation "
                        f"labels must name the same classes as data.train_files'")


def _read_label_columns(files: list[str], image_col: str, label_col: str, key: str):
    """(the files' rows, their labels as text, whether every file's labels are integers)."""
    rows, labels, integer = [], [], True
    for f in files:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:  # a truncated download, a CSV named .parquet
            raise DataError(f"{f} is not a parquet file pyarrow can read ({' '.join(str(e).split())[:200]}): write "
                            f"it again, or remove it from the {key} list") from None
        schema = pf.schema_arrow
        for col, col_key in ((image_col, "image_column"), (label_col, "label_column")):
            if col not in schema.names:
                raise DataError(f"{f} has no column '{col}' (data.{col_key}); its columns: {schema.names}")
        _check_image_column(f, pf, image_col)
        label_type = schema.field(label_col).type
        if pa.types.is_dictionary(label_type):  # pandas' categorical: its values are what counts
            label_type = label_type.value_type
        if not (pa.types.is_string(label_type) or pa.types.is_large_string(label_type)
                or pa.types.is_integer(label_type)):
            raise DataError(f"{f}: column '{label_col}' (data.label_column) is {label_type}: a label is a class "
                            f"name (string) or an integer; point data.label_column at such a column")
        column = pf.read(columns=[label_col]).column(label_col).combine_chunks()
        if column.null_count:
            raise DataError(f"{f}: column '{label_col}' has {column.null_count} empty labels")
        rows += [(f, i) for i in range(len(column))]
        labels.append(column.cast(pa.string()))
        integer = integer and pa.types.is_integer(label_type)
    return rows, pa.concat_arrays(labels) if labels else pa.array([], pa.string()), integer


def _check_image_column(path: str, pf: pq.ParquetFile, column: str) -> None:
    """DataError where `column` cannot hold encoded images: binary, or Hugging Face's {bytes, path} struct with
    bytes in it. Read from the schema and the row groups' statistics, not from the images: a path or an int
    passed the index and failed in every decode task; a struct saved by path (bytes null) made every sample
    "cannot identify image file"."""
    kind = pf.schema_arrow.field(column).type
    struct = pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0
    inner = kind.field("bytes").type if struct else kind
    if not (pa.types.is_binary(inner) or pa.types.is_large_binary(inner)):
        hint = (" (paths or text: the parquet must hold the images' bytes, or use data.kind image_folder on the "
                "files)" if pa.types.is_string(inner) or pa.types.is_large_string(inner) else "")
        raise DataError(f"{path}: column '{column}' (data.image_column) is {kind}{hint}: it must hold the encoded "
                        f"images, as binary or as a struct with a binary 'bytes' field (Hugging Face's Image)")
    if struct:
        md = pf.metadata
        leaf = f"{column}.bytes"
        nulls = sum(c.statistics.null_count for g in range(md.num_row_groups)
                    for c in (md.row_group(g).column(i) for i in range(md.num_columns))
                    if c.path_in_schema == leaf and c.statistics is not None and c.statistics.has_null_count)
        if nulls:
            raise DataError(f"{path}: column '{column}' (data.image_column) has {nulls} images with 'bytes' null: "
                            f"they were saved by path, and the parquet must hold the image bytes; write it with "
                            f"the images embedded, or use data.kind image_folder on the image files")


def index_webdataset(train_files: list[str], val_files: list[str], cache_dir: Path | None = None) -> ImageIndex:
    """The index of WebDataset tar shards (data/image/image_shards.py). With `cache_dir`, kept in cache_dir/index/,
    keyed by every shard's (and classes.txt's) path, size and modification time: a rerun, a driver restart and
    a sweep's trials stat the shards instead of reading every member's header."""
    files = {split: expand_files(patterns, f"data.{split}_files")
             for split, patterns in (("train", train_files), ("val", val_files))}
    kept = _shards_listing_file(files, cache_dir) if cache_dir is not None else None
    index = _kept_index(kept)
    if index is not None:
        return index
    entries = {split: image_shards.index_shards(found) for split, found in files.items()}
    # the training shards' classes (with classes.txt, its lines): a class only validation holds is refused, as
    # image_folder and image_parquet refuse it (it could never be predicted)
    classes, position = image_shards.class_names(files["train"], {e[3] for e in entries["train"]})
    known = {str(k): v for k, v in position.items()}
    _check_val_labels([(p, offset) for p, offset, _, _ in entries["val"]],
                      pa.array([str(e[3]) for e in entries["val"]], pa.string()), known)
    tables = {split: _index_table([(p, offset, position[label]) for p, offset, _, label in es],
                                  sizes=[size for _, _, size, _ in es])
              for split, es in entries.items()}
    if kept is not None:
        _keep_listing(kept, tables, classes)
    return ImageIndex(tables["train"], tables["val"], classes)


def _shards_listing_file(files: dict[str, list[str]], cache_dir: Path) -> Path:
    import hashlib

    # the folder relative names are read from, where there are any (a sweep's trials run in folders of their own)
    relative = any(not os.path.isabs(f) for found in files.values() for f in found)
    # ("2": the classes the training shards' alone; an index of before held validation's too, unchecked)
    h = hashlib.sha256(f"tar shards 2\0{os.getcwd() if relative else ''}".encode())
    names = image_shards.classes_file(files["train"])
    for split, found in files.items():
        for path in [*found, *([str(names)] if names.is_file() and split == "train" else [])]:
            st = os.stat(path)
            h.update(f"{split}/{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return cache_dir / "index" / f"{h.hexdigest()[:24]}.arrow"


def _index_table(entries: list[tuple[str, int, int]], sizes: list[int] | None = None) -> pa.Table:
    paths, rows, labels = zip(*entries) if entries else ((), (), ())
    return pa.Table.from_pydict(
        {"sample_id": np.arange(len(paths)), "path": list(paths), "row": list(rows), "label": list(labels),
         "size": [-1] * len(paths) if sizes is None else sizes},
        schema=INDEX_SCHEMA,
    )
