"""Image data: indexing, decode + augment + normalise, parquet vs ImageFolder, bad input."""

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from behemoth.data.image.image_batches import normalise, transform_batch
from behemoth.data.image.images import ImageData
from behemoth.data.image.images import DataError, build_index, index_image_folder
from behemoth.errors import BadSampleError


def batch_of(table: pa.Table) -> dict:
    return {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}


def cfg(**kw) -> ImageData:
    return ImageData(**{"root": "unused", "image_size": 16, "crop_padding": 2, **kw})


def test_index_sorted_classes_and_counts(image_root):
    index = index_image_folder(image_root)
    assert index.classes == sorted(index.classes) and len(index.classes) == 4
    assert index.train.num_rows == 96 and index.val.num_rows == 24
    assert index.train.column("sample_id").to_pylist() == list(range(96))
    labels = index.train.column("label").to_pylist()
    paths = index.train.column("path").to_pylist()
    assert all(f"/{index.classes[label]}/" in p for p, label in zip(paths, labels))


def test_an_image_folder_listing_is_kept_until_a_class_folder_changes(tmp_path, monkeypatch):
    """With a cache folder, the index of an ImageFolder is kept: a second build (a rerun, a sweep's trial)
    stats the class folders and lists no file; a file added to a class folder lists it again, with the file."""
    import shutil

    from behemoth.data.image import images
    from behemoth.data.image.synth import write_synth_images

    root = tmp_path / "images"
    write_synth_images(root, classes=3, per_class=5, val_per_class=2, size=8, seed=0)
    cfg = ImageData(kind="image_folder", root=str(root), image_size=8, cache_dir=str(tmp_path / "cache"))
    first = build_index(cfg)
    assert len(list((tmp_path / "cache" / "index").glob("*.arrow"))) == 1
    listed = []
    real_list = images._list_class_folders
    monkeypatch.setattr(images, "_list_class_folders", lambda folder: (listed.append(folder), real_list(folder))[1])
    again = build_index(cfg)
    assert listed == [] and again.classes == first.classes
    assert again.train.equals(first.train) and again.val.equals(first.val)

    shutil.copy(root / "train" / first.classes[1] / sorted(p.name for p in (root / "train" / first.classes[1])
                                                           .iterdir())[0], root / "train" / first.classes[1] / "new.png")
    changed = build_index(cfg)
    assert listed and changed.train.num_rows == first.train.num_rows + 1
    assert str(root / "train" / first.classes[1] / "new.png") in changed.train["path"].to_pylist()
    assert build_index(ImageData(kind="image_folder", root=str(root), image_size=8,
                                 cache_dir=str(tmp_path / "cache"))).train.equals(changed.train)

    # a root given relative to the working folder keeps its own listing: its paths are relative, and are
    # never handed to a process that names the same folder by its absolute path (a sweep's trial)
    monkeypatch.chdir(tmp_path)
    relative = build_index(ImageData(kind="image_folder", root="images", image_size=8, cache_dir="cache"))
    assert relative.train["path"][0].as_py().startswith("images/")
    assert build_index(cfg).train.equals(changed.train)


def test_transform_shapes_dtypes_normalisation(tmp_path):
    """The decode tasks hand on uint8 NHWC (3 x S x S bytes a sample); the worker's normalise makes the float32
    NCHW input, with not-valid samples all 0."""
    gray = tmp_path / "gray.png"
    Image.new("RGB", (16, 16), (128, 128, 128)).save(gray)
    table = pa.table({"sample_id": [0], "path": [str(gray)], "row": [-1], "label": [3], "size": [-1]})
    out = transform_batch(batch_of(table), cfg=cfg(), seed=0, epoch=0, train=False)
    assert out["image"].shape == (1, 16, 16, 3) and out["image"].dtype == np.uint8
    assert (out["image"] == 128).all()
    assert out["label"].tolist() == [3] and out["valid"].tolist() == [True]
    mean, std = (torch.tensor(v, dtype=torch.float32).view(1, 3, 1, 1) for v in ([0.5, 0.4, 0.3], [0.25, 0.2, 0.1]))
    two = torch.from_numpy(np.concatenate([out["image"]] * 2))
    images = normalise(two, torch.tensor([True, False]), mean, std)
    assert images.shape == (2, 3, 16, 16) and images.dtype == torch.float32 and images.is_contiguous()
    want = (128 / 255 - np.array([0.5, 0.4, 0.3])) / np.array([0.25, 0.2, 0.1])
    np.testing.assert_allclose(images[0].mean(dim=(1, 2)).numpy(), want, atol=1e-6)  # float32
    assert (images[1] == 0).all()


def test_augmentation_is_a_function_of_seed_epoch_and_sample(image_root):
    index = index_image_folder(image_root)
    b = batch_of(index.train.slice(0, 8))
    a1 = transform_batch(b, cfg=cfg(), seed=0, epoch=1, train=True)["image"]
    a2 = transform_batch(b, cfg=cfg(), seed=0, epoch=1, train=True)["image"]
    np.testing.assert_array_equal(a1, a2)
    # same sample decoded in a different batch (another worker/task) gets the same augmentation
    alone = transform_batch(batch_of(index.train.slice(3, 1)), cfg=cfg(), seed=0, epoch=1, train=True)["image"]
    np.testing.assert_array_equal(alone[0], a1[3])
    other_epoch = transform_batch(b, cfg=cfg(), seed=0, epoch=2, train=True)["image"]
    assert not np.array_equal(a1, other_epoch)
    evals = [transform_batch(b, cfg=cfg(), seed=s, epoch=e, train=False)["image"] for s, e in ((0, 0), (5, 9))]
    np.testing.assert_array_equal(*evals)  # evaluation has no randomness


@pytest.mark.parametrize("augment", ["crop_flip", "random_resized_crop", "none"])
@pytest.mark.parametrize("mode,size", [("L", (16, 16)), ("RGBA", (16, 16)), ("RGB", (37, 23)), ("P", (8, 40))])
def test_odd_images_are_converted_and_resized(tmp_path, augment, mode, size):
    path = tmp_path / f"odd_{mode}.png"
    Image.new(mode, size).save(path)
    table = pa.table({"sample_id": [0], "path": [str(path)], "row": [-1], "label": [0], "size": [-1]})
    for train in (True, False):
        out = transform_batch(batch_of(table), cfg=cfg(augment=augment), seed=0, epoch=0, train=train)
        assert out["image"].shape == (1, 16, 16, 3) and out["image"].dtype == np.uint8


def write_parquet_copy(image_root, out_dir, rows_per_group=10):
    """The ImageFolder data as parquet: HF-style {"bytes", "path"} image structs and class-name labels."""
    index = index_image_folder(image_root)
    files = {}
    for split in ("train", "val"):
        t = getattr(index, split)
        images = [{"bytes": open(p, "rb").read(), "path": p} for p in t.column("path").to_pylist()]
        labels = [index.classes[i] for i in t.column("label").to_pylist()]
        files[split] = str(out_dir / f"{split}.parquet")
        pq.write_table(pa.table({"img": images, "cls": labels}), files[split], row_group_size=rows_per_group)
    return index, files


def test_parquet_and_image_folder_yield_the_same_samples(image_root, tmp_path):
    folder_index, files = write_parquet_copy(image_root, tmp_path)
    pq_cfg = cfg(kind="image_parquet", train_files=[files["train"]], val_files=[files["val"]],
                 image_column="img", label_column="cls")
    pq_index = build_index(pq_cfg)
    assert pq_index.classes == folder_index.classes
    assert pq_index.train.column("label").equals(folder_index.train.column("label"))
    # a scattered set of rows across row groups, decoded from both sources
    rows = [0, 95, 11, 57, 30, 10, 9]
    for train in (True, False):
        a = transform_batch(batch_of(folder_index.train.take(rows)), cfg=cfg(), seed=0, epoch=1, train=train)
        b = transform_batch(batch_of(pq_index.train.take(rows)), cfg=pq_cfg, seed=0, epoch=1, train=train)
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])


def test_parquet_missing_column_named(image_root, tmp_path):
    _, files = write_parquet_copy(image_root, tmp_path)
    bad = cfg(kind="image_parquet", train_files=[files["train"]], val_files=[files["val"]], image_column="image",
              label_column="cls")
    with pytest.raises(DataError, match=r"train.parquet has no column 'image' \(data.image_column\)"):
        build_index(bad)
    with pytest.raises(DataError, match="matches no file"):
        build_index(cfg(kind="image_parquet", train_files=[str(tmp_path / "x*.parquet")], val_files=["y"]))


def _png(colour=(0, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def _parquet_job(tmp_path, train: dict, val: dict, **kw) -> ImageData:
    """An image_parquet job over one train and one val file holding these columns (image column 'img', label
    column 'cls' unless given)."""
    for split, columns in (("train", train), ("val", val)):
        pq.write_table(pa.table(columns), tmp_path / f"{split}.parquet")
    return cfg(kind="image_parquet", train_files=[str(tmp_path / "train.parquet")],
               val_files=[str(tmp_path / "val.parquet")], image_column="img", label_column="cls", **kw)


@pytest.mark.parametrize("content", [b"img,cls\nx,cat\n", b"PAR1 truncated download"])
def test_a_file_that_is_not_parquet_is_named_with_its_data_key(tmp_path, content):
    """a CSV named .parquet or a truncated download was pyarrow's ArrowInvalid traceback."""
    job = _parquet_job(tmp_path, {"img": [_png()] * 2, "cls": ["cat", "dog"]}, {"img": [_png()], "cls": ["cat"]})
    (tmp_path / "val.parquet").write_bytes(content)
    with pytest.raises(DataError, match=rf"{tmp_path / 'val.parquet'} is not a parquet file pyarrow can read "
                                        rf"\(.*\): write it again, or remove it from the data.val_files list"):
        build_index(job)


@pytest.mark.parametrize("column, values, expected", [
    ("cls", [["cat"], ["dog"]], r"column 'cls' \(data.label_column\) is list<.*>: a label is a class name"),
    ("cls", [{"name": "cat"}, {"name": "dog"}], r"column 'cls' \(data.label_column\) is struct<.*>: a label"),
    ("cls", [0.0, 1.0], r"column 'cls' \(data.label_column\) is double: a label is a class name"),
    ("img", ["a.png", "b.png"], (r"column 'img' \(data.image_column\) is string \(paths or text: the parquet "
                                 r"must hold the images' bytes.*\): it must hold the encoded images")),
    ("img", [1, 2], r"column 'img' \(data.image_column\) is int64: it must hold the encoded images, as binary"),
    ("img", [{"bytes": None, "path": "a.png"}, {"bytes": _png(), "path": "b.png"}],
     (r"column 'img' \(data.image_column\) has 1 images with 'bytes' null: they were saved by path, and the "
      r"parquet must hold the image bytes")),
])
def test_parquet_columns_of_the_wrong_type_are_named_when_indexed(tmp_path, column, values, expected):
    """a list or struct label was pyarrow's 'Unsupported cast' traceback; an image column of paths or ints, or
    HF structs saved by path, passed the index and failed in every decode task."""
    train = {"img": [_png(), _png()], "cls": ["cat", "dog"], column: values}
    job = _parquet_job(tmp_path, train, {"img": [_png()], "cls": ["cat"]})
    with pytest.raises(DataError, match=rf"^{tmp_path / 'train.parquet'}: {expected}"):
        build_index(job)
    # the right types pass: HF structs with bytes, integer labels, pandas' categorical (a dictionary) labels
    hf = [{"bytes": _png(), "path": None}] * 2
    for labels in ([3, 7], pa.array(["cat", "dog"]).dictionary_encode()):
        val_label = labels[:1] if isinstance(labels, list) else labels.slice(0, 1)
        index = build_index(_parquet_job(tmp_path, {"img": hf, "cls": labels}, {"img": hf[:1], "cls": val_label}))
        assert index.train.num_rows == 2 and index.val.num_rows == 1 and len(index.classes) == 2


def test_parquet_val_labels_the_training_rows_lack_or_no_val_rows_are_refused(tmp_path):
    """train cat/dog with val 0/1 made 4 classes (two never trained on); a val file of no rows gave
    val metrics of 0.0. Both are one line naming the validation file."""
    train = {"img": [_png()] * 3, "cls": ["cat", "dog", "cat"]}
    job = _parquet_job(tmp_path, train, {"img": [_png()] * 3, "cls": [0, 1, 0]})
    with pytest.raises(DataError, match=rf"^{tmp_path / 'val.parquet'}: label\(s\) '0', '1' are not among the "
                                        rf"training rows' labels \('cat', 'dog'\)"):
        build_index(job)
    job = _parquet_job(tmp_path, train, {"img": pa.array([], pa.binary()), "cls": pa.array([], pa.string())})
    with pytest.raises(DataError, match=rf"^data: the val split has no rows \({tmp_path / 'val.parquet'}\)"):
        build_index(job)
    index = build_index(_parquet_job(tmp_path, train, {"img": [_png()], "cls": ["dog"]}))
    assert index.classes == ["cat", "dog"] and index.val["label"].to_pylist() == [1]


def test_parquet_integer_labels_are_numbered_in_numeric_order(tmp_path):
    """Integer labels were sorted as text (0, 1, 10, 11, 2, ...): a Hugging Face set's labels 0-999 were renumbered,
    so a pretrained classifier of as many classes was fine-tuned with its head's rows permuted, and the same data
    as WebDataset shards numbered its classes otherwise. Names that are digits stay names, sorted as text."""
    labels = list(range(12))
    index = build_index(_parquet_job(tmp_path, {"img": [_png()] * 12, "cls": labels}, {"img": [_png()], "cls": [10]}))
    assert index.classes == [str(v) for v in labels] and index.train["label"].to_pylist() == labels
    assert index.val["label"].to_pylist() == [10]
    named = build_index(_parquet_job(tmp_path, {"img": [_png()] * 3, "cls": ["2", "10", "1"]},
                                     {"img": [_png()], "cls": ["10"]}))
    assert named.classes == ["1", "10", "2"]


def test_image_folder_reads_every_still_image_format_and_leaves_other_files_out(tmp_path):
    """.webp, .bmp, .gif, .tif/.tiff images were skipped without a word (half of a folder of jpg,
    JPEG, webp and bmp files). Each is indexed and decodes to RGB (a paletted GIF too); notes beside them are
    not images and stay out."""
    colour = (200, 40, 10)
    formats = {"a.jpg": "JPEG", "b.JPEG": "JPEG", "c.webp": "WEBP", "d.bmp": "BMP", "e.gif": "GIF",
               "f.tif": "TIFF", "g.TIFF": "TIFF", "h.png": "PNG"}
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for name, fmt in formats.items():
                img = Image.new("RGB", (16, 16), colour)
                paletted = img.convert("P", palette=Image.Palette.ADAPTIVE)  # the colour exactly, in a palette
                (paletted if fmt == "GIF" else img).save(folder / name, format=fmt, lossless=True)
            (folder / "notes.txt").write_text("not an image")
            (folder / "meta.json").write_text("{}")
    assert Image.open(tmp_path / "train" / "cat" / "e.gif").mode == "P"
    index = index_image_folder(tmp_path)
    assert index.train.num_rows == index.val.num_rows == 2 * len(formats)
    assert {Path(p).name for p in index.train["path"].to_pylist()} == set(formats)
    out = transform_batch(batch_of(index.train), cfg=cfg(augment="none"), seed=0, epoch=0, train=False)
    assert out["valid"].all() and out["image"].shape == (2 * len(formats), 16, 16, 3)
    lossy = [Path(p).suffix.lower() in (".jpg", ".jpeg") for p in index.train["path"].to_pylist()]
    for image, jpeg in zip(out["image"], lossy):
        np.testing.assert_allclose(image.reshape(-1, 3).mean(0), colour, atol=8 if jpeg else 0)


def test_missing_folder_and_empty_class_named(tmp_path):
    with pytest.raises(DataError, match=f"data folder {tmp_path / 'nope'} does not exist"):
        index_image_folder(tmp_path / "nope")
    for split in ("train", "val"):
        (tmp_path / split / "cat").mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(tmp_path / split / "cat" / "a.png")
    (tmp_path / "train" / "dog").mkdir()
    with pytest.raises(DataError, match=f"class folder {tmp_path / 'train' / 'dog'} holds no"):
        index_image_folder(tmp_path)


def test_corrupt_image_named_or_dropped_within_budget(tmp_path):
    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    Image.new("RGB", (16, 16)).save(good)
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    table = pa.table({"sample_id": [0, 1], "path": [str(good), str(bad)], "row": [-1, -1], "label": [0, 1],
                      "size": [-1, -1]})
    with pytest.raises(BadSampleError, match=f"cannot decode image {bad}.*data.max_bad_samples"):
        transform_batch(batch_of(table), cfg=cfg(), seed=0, epoch=0, train=True)
    out = transform_batch(batch_of(table), cfg=cfg(max_bad_samples=1), seed=0, epoch=0, train=True)
    assert out["valid"].tolist() == [True, False]


def test_jpeg_is_read(tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (20, 20), (255, 0, 0)).save(buf, format="JPEG")
    path = tmp_path / "red.JPG"
    path.write_bytes(buf.getvalue())
    table = pa.table({"sample_id": [0], "path": [str(path)], "row": [-1], "label": [0], "size": [-1]})
    for augment, train in (("crop_flip", False), ("random_resized_crop", True)):  # PIL's path; libjpeg-turbo's
        out = transform_batch(batch_of(table), cfg=cfg(augment=augment), seed=0, epoch=0, train=train)
        red = out["image"][0]
        assert red[..., 0].mean() > 230 and red[..., 2].mean() < 25


def test_imagenets_flat_val_folder_is_named_and_split_into_class_folders(tmp_path, capsys):
    """Issue 59 item 2: a val/ of loose images is refused with the command that fixes it; `behemoth data
    split-val` moves each image into its class's folder from Kaggle's CSV (or FILENAME CLASS lines), and refuses,
    moving nothing, when labels and images disagree."""
    import pytest

    from behemoth.data.image.images import index_image_folder
    from behemoth.driver.commands.cli import main
    from behemoth.errors import DataError

    root = tmp_path / "imagenet"
    for cls in ("n01440764", "n01443537"):
        (root / "train" / cls).mkdir(parents=True)
        (root / "train" / cls / f"{cls}_1.JPEG").write_bytes(b"x")
    (root / "val").mkdir()
    for i in (1, 2, 3):
        (root / "val" / f"ILSVRC2012_val_0000000{i}.JPEG").write_bytes(b"x")
    with pytest.raises(DataError, match=r"val holds images directly: .*behemoth data split-val .*val --labels"):
        index_image_folder(root)
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_text("ImageId,PredictionString\nILSVRC2012_val_00000001,n01440764 1 2 3 4\n"
                   "ILSVRC2012_val_00000002,n01443537 5 6 7 8 n01443537 1 1 2 2\n")
    assert main(["data", "split-val", str(root / "val"), "--labels", str(csv)]) == 1  # one image has no label
    assert "1 images without a label (ILSVRC2012_val_00000003.JPEG)" in capsys.readouterr().err
    assert len(list((root / "val").glob("*.JPEG"))) == 3  # nothing moved
    csv.write_text(csv.read_text() + "ILSVRC2012_val_00000003,n01440764 1 2 3 4\n")
    assert main(["data", "split-val", str(root / "val"), "--labels", str(csv)]) == 0
    assert sorted(p.relative_to(root / "val").as_posix() for p in (root / "val").rglob("*.JPEG")) == [
        "n01440764/ILSVRC2012_val_00000001.JPEG", "n01440764/ILSVRC2012_val_00000003.JPEG",
        "n01443537/ILSVRC2012_val_00000002.JPEG"]


def _flat_val(tmp_path, names=("a", "b", "c")):
    val = tmp_path / "val"
    val.mkdir()
    for name in names:
        (val / f"{name}.JPEG").write_bytes(name.encode())
    return val


def _split(val, labels, capsys, *extra):
    from behemoth.driver.commands.cli import main

    code = main(["data", "split-val", str(val), "--labels", str(labels), *extra])
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") <= 1
    return code, err


def _tree(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("cls", ["../outside", "/abs/path", "x/y", "..", ""])
def test_split_val_refuses_a_class_that_is_not_a_plain_name_before_moving_anything(tmp_path, capsys, cls):
    """Issue 65 item 1: a class of `../outside` or `/abs/path` moved images out of the folder; one with `/`
    failed after earlier rows had moved. Every row is checked before anything moves."""
    val = _flat_val(tmp_path)
    labels = tmp_path / "LOC_val_solution.csv"
    labels.write_text(f"ImageId,PredictionString\na,n01 1 2\nb,n02 1 2\nc,{cls} 1 2\n")
    if cls == "":  # an empty class is an empty PredictionString
        labels.write_text("ImageId,PredictionString\na,n01 1 2\nb,n02 1 2\nc,\n")
    code, err = _split(val, labels, capsys)
    assert code == 1 and f"{labels}:4:" in err
    assert ("not a plain name" in err and repr(cls) in err) or "column PredictionString is empty" in err
    assert _tree(tmp_path) == ["LOC_val_solution.csv", "val/a.JPEG", "val/b.JPEG", "val/c.JPEG"]
    assert not (tmp_path / "outside").exists() and not Path("/abs/path").exists()


def test_split_val_refuses_a_file_name_with_a_folder(tmp_path, capsys):
    val = _flat_val(tmp_path, ["a"])
    labels = tmp_path / "labels.txt"
    labels.write_text("../a.JPEG n01\n")
    code, err = _split(val, labels, capsys)
    assert code == 1 and f"{labels}:1: the file name '../a.JPEG' is not a plain name" in err


def test_split_val_never_overwrites_a_file_in_a_class_folder(tmp_path, capsys):
    """Issue 65 item 1: a row naming an image whose class folder already holds a file of that name overwrote it."""
    val = _flat_val(tmp_path, ["a", "notes"])
    (val / "precious").mkdir()
    (val / "precious" / "notes.JPEG").write_bytes(b"precious")
    labels = tmp_path / "labels.txt"
    labels.write_text("a.JPEG n01\nnotes.JPEG precious\n")
    code, err = _split(val, labels, capsys)
    assert code == 1 and f"row {labels}:2 would move {val / 'notes.JPEG'} onto the existing" in err
    assert (val / "precious" / "notes.JPEG").read_bytes() == b"precious" and (val / "a.JPEG").exists()


@pytest.mark.parametrize("text, expected", [
    ("ImageId,PredictionString\na,\n", ":2: column PredictionString is empty"),
    ("ImageId,Label\na,n01\n", ":1: no column PredictionString in the header 'ImageId,Label'"),
    ("ImageId,PredictionString\na\n", ":2: column PredictionString is empty"),
    ("ImageId,PredictionString\na,n01 1\na,n02 1\n", ":3: image a is labelled n02, and n01 at"),
])
def test_split_val_names_the_csv_row_and_column_of_a_bad_row(tmp_path, capsys, text, expected):
    """Issue 65 item 1: an empty PredictionString was an IndexError, a missing column a KeyError (tracebacks)."""
    val = _flat_val(tmp_path, ["a"])
    labels = tmp_path / "LOC_val_solution.csv"
    labels.write_text(text)
    code, err = _split(val, labels, capsys)
    assert code == 1 and f"{labels}{expected}" in err and (val / "a.JPEG").exists()


def test_split_val_stopped_midway_is_finished_or_undone_by_a_rerun(tmp_path, capsys, monkeypatch):
    """Issue 65 item 1: after a failure midway the rerun refused ("labels without an image"): the folder could be
    neither finished nor undone. The rerun finishes it; --undo moves every image back."""
    import pathlib

    val = _flat_val(tmp_path)
    labels = tmp_path / "labels.txt"
    labels.write_text("a.JPEG n01\nb.JPEG n02\nc.JPEG n01\n")
    rename = pathlib.Path.rename

    def failing(self, target):
        if self.name == "b.JPEG":
            raise OSError(5, "Input/output error")
        return rename(self, target)

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "rename", failing)
        code, err = _split(val, labels, capsys)
    assert code == 1 and "moved 1 of 3 images, then could not move" in err and "rerun the same command" in err
    assert _tree(val) == ["b.JPEG", "c.JPEG", "n01/a.JPEG"]
    for extra in ([], ["--undo"], ["--undo"], []):  # finish, undo all, undo again (nothing to do), split again
        code, err = _split(val, labels, capsys, *extra)
        assert code == 0, err
        split = ["n01/a.JPEG", "n01/c.JPEG", "n02/b.JPEG"]
        assert _tree(val) == (["a.JPEG", "b.JPEG", "c.JPEG"] if extra else split)


def test_split_val_refuses_a_class_folder_that_is_a_link_out_of_the_folder(tmp_path, capsys):
    """A class folder that is a symlink (here to a folder outside val/) would take the images out of the folder
    as `../outside` did: refused, nothing moved."""
    val = _flat_val(tmp_path, ["a"])
    (tmp_path / "elsewhere").mkdir()
    (val / "n01").symlink_to(tmp_path / "elsewhere")
    labels = tmp_path / "labels.txt"
    labels.write_text("a.JPEG n01\n")
    code, err = _split(val, labels, capsys)
    assert code == 1 and f"row {labels}:1: {val / 'n01'} is not a folder of this one" in err
    assert (val / "a.JPEG").exists() and not any((tmp_path / "elsewhere").iterdir())
