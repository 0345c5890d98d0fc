"""WebDataset tar shards (data.kind image_webdataset): written from an ImageFolder by `behemoth data shards`,
indexed by (shard, member data offset), read with one ranged read per image, the index kept in
data.cache_dir/index until a shard changes."""

import io
import re
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from behemoth.data.image import image_batches, image_shards
from behemoth.data.image.image_batches import transform_batch
from behemoth.data.image.images import (
    DataError,
    ImageData,
    index_image_folder,
    index_webdataset,
)
from behemoth.driver.commands.cli import main
from behemoth.errors import BadSampleError


def batch_of(table) -> dict:
    return {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}


@pytest.fixture
def shards(image_root, tmp_path):
    out = tmp_path / "shards"
    assert main(["data", "shards", str(image_root), "--out", str(out), "--samples-per-shard", "40"]) == 0
    return out


def files(out, split):
    return [str(p) for p in sorted(out.glob(f"{split}-*.tar"))]


def test_shards_hold_the_folders_samples_in_its_order_and_decode_to_the_same_pixels(image_root, shards):
    """96 train images in shards of 40 (3 shards), 24 val (1): the same sample ids, labels and class names as
    the folder's index, each image's bytes read back from its member, and the same decoded, augmented batch."""
    folder = index_image_folder(image_root)
    assert [len(files(shards, s)) for s in ("train", "val")] == [3, 1]
    index = index_webdataset([str(shards / "train-*.tar")], [str(shards / "val-*.tar")])
    assert index.classes == folder.classes
    for split in ("train", "val"):
        ours, theirs = getattr(index, split), getattr(folder, split)
        assert ours.column("sample_id").to_pylist() == theirs.column("sample_id").to_pylist()
        assert ours.column("label").to_pylist() == theirs.column("label").to_pylist()
        originals = [Path(p).read_bytes() for p in theirs.column("path").to_pylist()]
        read = image_batches._load_bytes(batch_of(ours), "image")
        assert read == originals
    cfg = ImageData(root="unused", image_size=16, crop_padding=2)
    a = transform_batch(batch_of(index.train), cfg=cfg, seed=3, epoch=1, train=True)
    b = transform_batch(batch_of(folder.train), cfg=cfg, seed=3, epoch=1, train=True)
    assert np.array_equal(a["image"], b["image"]) and np.array_equal(a["label"], b["label"])
    # the same folder writes the same bytes (no owner or time in the members)
    again = shards.parent / "again"
    assert main(["data", "shards", str(image_root), "--out", str(again), "--samples-per-shard", "40"]) == 0
    assert [Path(p).read_bytes() for p in files(again, "train")] == [Path(p).read_bytes() for p in files(shards, "train")]
    # a folder holding shards is not written over (shards of another size would stay and be read too)
    assert main(["data", "shards", str(image_root), "--out", str(again), "--samples-per-shard", "90"]) == 1
    assert len(files(again, "train")) == 3


def test_a_folder_of_every_still_image_format_makes_shards_read_whole(tmp_path):
    """image_folder reads bmp, gif and tiff; `data shards` copies each file's suffix into its member's name, and
    the shard reader took png/jpg/jpeg/webp only: those samples had no image member, and their shards failed."""
    from PIL import Image

    root = tmp_path / "mixed"
    formats = ("png", "jpg", "webp", "bmp", "gif", "tif", "tiff")
    for split, n in (("train", 2), ("val", 1)):
        for c, colour in (("red", (200, 0, 0)), ("blue", (0, 0, 200))):
            (root / split / c).mkdir(parents=True)
            for k in range(n):
                for ext in formats:
                    Image.new("RGB", (12, 10), colour).save(root / split / c / f"{k}.{ext}")
    folder = index_image_folder(root)
    assert folder.train.num_rows == 2 * 2 * len(formats)
    out = tmp_path / "shards"
    assert main(["data", "shards", str(root), "--out", str(out), "--samples-per-shard", "9"]) == 0
    index = index_webdataset(files(out, "train"), files(out, "val"))
    assert index.train.column("label").to_pylist() == folder.train.column("label").to_pylist()
    assert index.val.num_rows == folder.val.num_rows == 2 * len(formats)
    cfg = ImageData(root="unused", image_size=8, augment="none")
    decoded = transform_batch(batch_of(index.train), cfg=cfg, seed=0, epoch=0, train=False)
    assert decoded["valid"].all()


def test_the_decoded_cache_of_shards_holds_the_folders_pixels(image_root, shards, tmp_path):
    from behemoth.data.image import image_cache, image_cache_build

    folder = index_image_folder(image_root)
    index = index_webdataset(files(shards, "train"), files(shards, "val"))
    decoded = []
    for table in (folder.train, index.train):
        plan = image_cache.plan(table, 12, str(tmp_path / "cache"), "image")
        decoded.append(image_cache_build.open_or_build(plan, table, workers=False, log=lambda line: None))
    assert decoded[0].folder != decoded[1].folder  # each source its own cache
    ids = np.arange(folder.train.num_rows)
    (a, valid_a), (b, valid_b) = decoded[0].rows(ids), decoded[1].rows(ids)
    assert np.array_equal(a, b) and valid_a.all() and valid_b.all()


def test_the_index_is_kept_until_a_shard_changes(shards, tmp_path, monkeypatch):
    """With a cache folder the index is kept: a second build reads no shard; a rewritten shard is read again."""
    train, val = files(shards, "train"), files(shards, "val")
    first = index_webdataset(train, val, tmp_path / "cache")
    assert len(list((tmp_path / "cache" / "index").glob("*.arrow"))) == 1
    scanned = []
    real = image_shards.scan_shard
    monkeypatch.setattr(image_shards, "scan_shard", lambda path: scanned.append(path) or real(path))
    kept = index_webdataset(train, val, tmp_path / "cache")
    assert scanned == [] and kept.train.equals(first.train) and kept.val.equals(first.val)
    assert kept.classes == first.classes
    image = image_batches._load_bytes(batch_of(first.train.slice(0, 1)), "image")[0]
    _tar(train[2], {"00000096.png": image, "00000096.cls": b"2"}, mode="a")  # a sample more in the last shard
    grown = index_webdataset(train, val, tmp_path / "cache")
    assert scanned == train + val and grown.train.num_rows == first.train.num_rows + 1
    assert grown.train.column("label").to_pylist()[-1] == 2


def test_classes_without_classes_txt_are_the_indices_seen_in_numeric_order(shards, tmp_path):
    png = image_batches._load_bytes(
        batch_of(index_webdataset(files(shards, "train"), files(shards, "val")).train.slice(0, 1)), "image")[0]
    path = _tar(tmp_path / "s.tar", {"a.png": png, "a.cls": b"10", "b.png": png, "b.cls": b"2"})
    index = index_webdataset([path], [path])
    assert index.classes == ["2", "10"] and index.train.column("label").to_pylist() == [1, 0]


def test_a_class_only_the_validation_shards_hold_is_refused(shards, tmp_path):
    """Without classes.txt the classes were the indices seen in train and val together: a class only validation
    held made a class never trained on, whose samples always counted wrong. Refused, as image_folder and
    image_parquet refuse it."""
    png = image_batches._load_bytes(
        batch_of(index_webdataset(files(shards, "train"), files(shards, "val")).train.slice(0, 1)), "image")[0]
    train = _tar(tmp_path / "train.tar", {"a.png": png, "a.cls": b"0", "b.png": png, "b.cls": b"1"})
    val = _tar(tmp_path / "val.tar", {"c.png": png, "c.cls": b"0", "d.png": png, "d.cls": b"2"})
    with pytest.raises(DataError, match=r"val.tar: label\(s\) '2' are not among the training rows' labels"):
        index_webdataset([train], [val])


def test_the_kept_index_holds_across_working_folders_and_goes_with_classes_txt(shards, tmp_path, monkeypatch):
    """A sweep's trials run in folders of their own: absolute shard paths keep one index; a new classes.txt
    makes another (its names are in the index)."""
    train, val = files(shards, "train"), files(shards, "val")
    index_webdataset(train, val, tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    kept = index_webdataset(train, val, tmp_path / "cache")
    assert len(list((tmp_path / "cache" / "index").glob("*.arrow"))) == 1
    names = (shards / "classes.txt").read_text().splitlines()
    (shards / "classes.txt").write_text("".join(f"renamed_{n}\n" for n in names))
    renamed = index_webdataset(train, val, tmp_path / "cache")
    assert renamed.classes == [f"renamed_{n}" for n in names] and kept.classes == names
    (shards / "classes.txt").write_text("a\n\nb\n")
    with pytest.raises(DataError, match="classes.txt line 2 is empty"):
        index_webdataset(train, val, tmp_path / "cache")


def _tar(path, members: dict[str, bytes], mode="w"):
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            _add_member(tar, name, data)
    return str(path)


def _add_member(tar, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_bad_shards_are_named(shards, tmp_path):
    png = Path(files(shards, "train")[0]).read_bytes()  # any bytes: these fail before decoding
    cases = {
        "no_label.tar": ({"a.png": png}, "sample a has no .cls member"),
        "no_image.tar": ({"a.cls": b"1"}, "sample a has no image member"),
        "bad_label.tar": ({"a.png": png, "a.cls": b"dog"}, r"a.cls holds b'dog', not a class index"),
        "two_images.tar": ({"a.png": png, "a.jpg": png, "a.cls": b"0"}, r"sample a has two image members \(a.png, a.jpg\)"),
        "two_labels.tar": ({"a.png": png, "a.cls": b"0", "a.CLS": b"3"}, "sample a has two label members"),
        "apart.tar": ({"a.png": png, "b.png": png, "b.cls": b"0", "a.cls": b"0"}, "sample key a appears again at a.cls"),
        "empty.tar": ({"readme.txt": b"hi"}, "holds no samples"),
    }
    for name, (members, message) in cases.items():
        with pytest.raises(DataError, match=message):
            image_shards.scan_shard(_tar(tmp_path / name, members))
    gz = _tar(tmp_path / "c.tar.gz", {"a.png": png, "a.cls": b"0"}, mode="w:gz")
    with pytest.raises(DataError, match="c.tar.gz as an uncompressed tar shard .*: decompress it"):
        image_shards.scan_shard(gz)
    for fmt in (tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT):  # read directly, and by tarfile (a long name)
        path = tmp_path / f"link{fmt}.tar"
        target = "d" * 120 + "/b.png" if fmt == tarfile.PAX_FORMAT else "b.png"
        with tarfile.open(path, "w", format=fmt) as tar:
            _add_member(tar, target, png)
            link = tarfile.TarInfo("a.png")
            link.type, link.linkname = tarfile.LNKTYPE, target
            tar.addfile(link)
        with pytest.raises(DataError, match="a.png is a hard link, not the bytes themselves"):
            image_shards.scan_shard(str(path))
    # a damaged header after the first: refused, not the shard's rest silently dropped (both readers)
    for fmt in (tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT):
        path = tmp_path / f"damaged{fmt}.tar"
        first = "b" * 120 if fmt == tarfile.PAX_FORMAT else "b"  # a long name first: read by tarfile
        names = [f"{first}.png", f"{first}.cls", "a.png", "a.cls"]
        with tarfile.open(path, "w", format=fmt) as tar:
            for name in names:
                _add_member(tar, name, b"0" if name.endswith(".cls") else png)
        data = bytearray(path.read_bytes())
        with tarfile.open(path) as tar:
            second = next(m.offset for m in tar.getmembers() if m.name == "a.cls")
        data[second + 148:second + 156] = b"0000000\0"  # its checksum
        path.write_bytes(bytes(data))
        with pytest.raises(DataError, match="bad tar header at byte"):
            image_shards.scan_shard(str(path))
    (shards / "classes.txt").write_text("only\n")
    with pytest.raises(DataError, match="class index 1 is beyond .*classes.txt's 1 class names"):
        index_webdataset(files(shards, "train"), files(shards, "val"))


def test_an_undecodable_member_is_named_by_shard_and_member(tmp_path):
    from PIL import Image

    good = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(good, format="PNG")
    path = _tar(tmp_path / "s.tar", {"k0.png": good.getvalue(), "k0.cls": b"0",
                                     "k1.png": b"\x89PNG\r\n\x1a\nnot a png", "k1.cls": b"1"})
    index = index_webdataset([path], [path])
    with pytest.raises(BadSampleError, match=r"cannot decode image .*s.tar:k1.png"):
        transform_batch(batch_of(index.train), cfg=ImageData(root="unused", image_size=8), seed=0, epoch=0, train=False)
    assert image_batches.describe_samples(index.train, [1]) == [f"{path}:k1.png"]
    # a name longer than the header's 100 bytes (a pax record holds it) is named whole
    long = "é" * 80 + "/k1.png"
    path = _tar(tmp_path / "long.tar", {"k0.png": good.getvalue(), "k0.cls": b"0", long: b"broken",
                                        long.replace(".png", ".cls"): b"1"})
    assert image_shards.member_name(path, image_shards.scan_shard(path)[1][0]) == f"{path}:{long}"


def test_config_needs_the_shard_files_and_names_them_as_its_source():
    from behemoth.config import ConfigError

    with pytest.raises(ConfigError, match="data.kind is image_webdataset: set data.train_files and data.val_files"):
        ImageData(kind="image_webdataset", train_files=["x.tar"]).validate()
    # data.root left from an ImageFolder job does not name the data a model card describes
    data = ImageData(kind="image_webdataset", root="images", train_files=["s/train-*.tar"], val_files=["v.tar"])
    assert data.source() == "s/train-*.tar"


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_header_reader_agrees_with_tarfile(tmp_path, fmt):
    """Headers are read directly (tarfile's objects cost ~10x per sample); a shard with long names (GNU or pax
    headers) is left to tarfile. Either way: tarfile's names, data offsets and sizes, folders and links skipped."""
    long = "d" * 120
    members = {"x/00000001.png": b"p" * 700, "x/00000001.cls": b"3", f"{long}/00000002.jpg": b"j" * 513,
               f"{long}/00000002.cls": b" 1\n", "00000003.png": b"", "00000003.cls": b"0"}
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=fmt) as tar:
        folder = tarfile.TarInfo("x")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("x/link")  # not a sample's member: skipped (one named .png is refused)
        link.type, link.linkname = tarfile.SYMTYPE, "00000001.png"
        tar.addfile(link)
    expected = list(image_shards._tarfile_members(str(path)))
    assert [m[0] for m in expected] == list(members)
    if fmt == tarfile.USTAR_FORMAT:  # the long folder fits ustar's 155-byte prefix
        assert list(image_shards._plain_members(str(path))) == expected
    else:
        with pytest.raises(image_shards._NotPlain):
            list(image_shards._plain_members(str(path)))
    found = image_shards.scan_shard(str(path))
    labels = {"x/00000001": 3, f"{long}/00000002": 1, "00000003": 0}
    assert found == [(offset, size, labels[name.split(".")[0]]) for name, offset, size, _ in expected
                     if not name.endswith(".cls")]
    for (offset, size, _), name in zip(found, ["x/00000001.png", f"{long}/00000002.jpg", "00000003.png"]):
        assert image_shards.read_members(str(path), [(offset, size)]) == [members[name]]


def test_a_shard_cut_after_indexing_is_named(shards):
    index = index_webdataset(files(shards, "train"), files(shards, "val"))
    last = files(shards, "train")[-1]
    with open(last, "r+b") as f:
        f.truncate(1024)
    with pytest.raises(DataError, match="train-000002.tar ends .* the shard changed after it was indexed"):
        image_batches._load_bytes(batch_of(index.train.slice(80, 8)), "image")


def test_a_cut_or_holed_shard_is_refused_not_read_short(tmp_path):
    """A shard cut inside a header, inside an image or inside a label, or with a zero block amid its members:
    refused naming the shard (read short, it would lose samples or change a label without a word)."""
    path = tmp_path / "s.tar"
    _tar(path, {"a.png": b"p" * 600, "a.cls": b"1", "b.png": b"q" * 700, "b.cls": b"12"})
    whole = path.read_bytes()
    with tarfile.open(path) as tar:
        at = {m.name: (m.offset, m.offset_data) for m in tar.getmembers()}
    for cut in (at["b.png"][0] + 100, at["b.png"][1] + 300, at["b.cls"][1] + 1):
        path.write_bytes(whole[:cut])
        with pytest.raises(DataError, match="s.tar as an uncompressed tar shard .*the shard ends inside.*damaged"):
            image_shards.scan_shard(str(path))
    holed = whole[:at["b.png"][0]] + b"\0" * 512 + whole[at["b.png"][0]:]
    path.write_bytes(holed)
    with pytest.raises(DataError, match="bad tar header at byte .*zero block amid the members"):
        image_shards.scan_shard(str(path))
    path.write_bytes(whole[:at["b.cls"][1] + 512])  # ends after its last member, without the end blocks
    assert [label for _, _, label in image_shards.scan_shard(str(path))] == [1, 12]


def test_the_header_reader_agrees_with_tarfile_across_its_read_buffer(tmp_path):
    """Members around the reader's 64 KiB read: headers and labels split by its end, members larger than it."""
    for first in range(65_000, 66_600, 211):
        members = {"a.png": b"p" * first, "a.cls": b"3", "b.png": b"q" * 200_000, "b.cls": b"4", "c.png": b"r",
                   "c.cls": b"5"}
        path = _tar(tmp_path / f"{first}.tar", members)
        assert list(image_shards._plain_members(path)) == list(image_shards._tarfile_members(path))


def test_links_and_sparse_members_in_place_of_an_image_are_refused(tmp_path):
    for kind, what in ((tarfile.SYMTYPE, "symbolic link"), (tarfile.GNUTYPE_SPARSE, "sparse file")):
        path = tmp_path / f"{what}.tar"
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            info = tarfile.TarInfo("a.png")
            info.type, info.linkname = kind, "elsewhere.png" if kind == tarfile.SYMTYPE else ""
            tar.addfile(info)
            _add_member(tar, "a.cls", b"0")
        with pytest.raises(DataError, match=f"a.png is a {what}, not the bytes themselves"):
            image_shards.scan_shard(str(path))


def _header(name: str, size_field: bytes, kind: bytes = b"0") -> bytes:
    """A ustar header with any size field and a checksum that adds up, as a crafted shard would carry."""
    header = bytearray(tarfile.BLOCKSIZE)
    header[:len(name)] = name.encode()
    header[100:124] = b"0000644\0" + b"0000000\0" * 2  # mode, uid, gid
    header[124:136] = size_field.ljust(12, b"\0")
    header[136:148] = b"00000000000\0"  # mtime
    header[156:157], header[257:265] = kind, b"ustar\x0000"
    header[148:156] = b" " * 8  # the checksum counts its own field as spaces
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def _member(name: str, data: bytes) -> bytes:
    return _header(name, b"%011o" % len(data)) + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


_END = b"\0" * (2 * tarfile.BLOCKSIZE)
_NOT_A_SIZE = r"bad tar header at byte 2560 \('b.png'\): its size field b'{}.*' is not a size\)"
_BAD_SIZES = {  # a size field -> what the refusal says
    b"-0001000": _NOT_A_SIZE.format("-0001000"),
    b"+0001000": _NOT_A_SIZE.format(r"\+0001000"),
    b"0o1000": _NOT_A_SIZE.format("0o1000"),
    b"00000009zz": _NOT_A_SIZE.format("00000009zz"),
    b"\xff" * 12: _NOT_A_SIZE.format(r"\\xff"),  # base-256, negative
    b"77777777777": r"the shard ends inside b.png, \d+ bytes short",  # larger than the bytes left
    b"\x80" + b"\0" * 6 + b"\x10" + b"\0" * 4: r"the shard ends inside b.png, \d+ bytes short",  # base-256, 64 GiB
}


@pytest.mark.timeout(20)  # each case takes milliseconds; a reader stepping back over a size never ended
@pytest.mark.parametrize("size_field", list(_BAD_SIZES), ids=repr)
@pytest.mark.parametrize("first", ["plain", "long_name"])
def test_a_crafted_size_field_is_one_error_naming_the_shard_never_a_hang(tmp_path, size_field, first):
    """A header with a negative, non-octal or too large size and a checksum that adds up, after a sample read
    by the direct reader, or after a long (pax) name that leaves the shard to tarfile: one DataError naming
    the shard and the header. (A negative size stepped both readers back to the same header forever.)"""
    name = "d" * 120 + "/a" if first == "long_name" else "a"
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        _add_member(tar, f"{name}.png", b"p" * 600)
        _add_member(tar, f"{name}.cls", b"1")
    head = path.read_bytes().rstrip(b"\0")
    head += b"\0" * (-len(head) % tarfile.BLOCKSIZE)
    path.write_bytes(head + _header("b.png", size_field) + b"q" * 2048 + _END)
    message = _BAD_SIZES[size_field]
    if first == "long_name":  # the direct reader checks every header, extended ones too, before tarfile reads any
        message = message.replace("byte 2560", r"byte \d+")
    with pytest.raises(DataError, match=rf"cannot read {path} as an uncompressed tar shard \(({message})"):
        image_shards.scan_shard(str(path))


@pytest.mark.timeout(20)
def test_a_negative_size_in_a_pax_record_or_the_first_header_is_refused(tmp_path):
    """tarfile takes a size from a pax record too: its reader is checked as well as the direct one; so is the
    name lookup a decode error uses."""
    path = tmp_path / "pax.tar"
    record = b"14 size=-1000\n"
    pax = _header("././@PaxHeader", b"%011o" % len(record), kind=b"x") + record.ljust(tarfile.BLOCKSIZE, b"\0")
    path.write_bytes(_member("a.png", b"p" * 600) + _member("a.cls", b"1") + pax + _header("b.png", b"0") + _END)
    with pytest.raises(DataError, match=rf"{path} as an uncompressed tar shard \(bad tar header at byte \d+ "
                                        r"\('b.png'\): its size -1000 is not a size"):
        image_shards.scan_shard(str(path))
    assert image_shards.member_name(str(path), 512) == f"{path} (the member at byte 512)"
    path.write_bytes(_header("b.png", b"-1000") + _END)
    with pytest.raises(DataError, match=rf"{path} as an uncompressed tar shard \(bad tar header at byte 0 "):
        image_shards.scan_shard(str(path))


def _pax(records: bytes, kind: bytes = b"x") -> bytes:
    return (_header("././@PaxHeader", b"%011o" % len(records), kind=kind)
            + records + b"\0" * (-len(records) % tarfile.BLOCKSIZE))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("n", [20_000, 80_000])
def test_a_crafted_pax_header_is_refused_in_linear_time(tmp_path, n):
    """A pax header of "1" x n in front of a valid sample: CPython's tarfile (before 3.11.10) parses it in
    quadratic time (1 s at 20k, 5.6 s at 80k here, minutes at 1 MB, on every rank); behemoth refuses it before
    tarfile sees it, naming the shard and the header's offset, in milliseconds; so is the name lookup a decode
    error uses."""
    path = tmp_path / "pax.tar"
    path.write_bytes(_pax(b"1" * n) + _member("a.png", b"p" * 600) + _member("a.cls", b"1") + _END)
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=rf"cannot read {path} as an uncompressed tar shard \(bad tar header at "
                                        rf"byte 0: an extended header of {n} bytes \(behemoth reads up to 8192\)"):
        image_shards.scan_shard(str(path))
    assert image_shards.member_name(str(path), 1024) == f"{path} (the member at byte 1024)"
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize("records, says", [
    (b"1" * 4000, "a pax record at byte 0 of it does not start with its length"),
    (b"15 size=-1000\n", "a pax record at byte 0 of it does not start with its length"),  # 14 bytes, says 15
    (b"12 path=a.png" + b"30 path=b.png\n", "a pax record at byte 0 of it is not 'LENGTH key=value'"),
    (b"9 novalue\n", "a pax record at byte 0 of it is not 'LENGTH key=value'"),
])
def test_a_malformed_pax_record_is_one_error_naming_the_header(tmp_path, records, says):
    path = tmp_path / "pax.tar"
    path.write_bytes(_member("a.png", b"p" * 600) + _member("a.cls", b"1") + _pax(records) + _member("b.png", b"q")
                     + _END)
    with pytest.raises(DataError, match=rf"{path} as an uncompressed tar shard \(bad tar header at byte 2560: "
                                        rf"{re.escape(says)}"):
        image_shards.scan_shard(str(path))


def test_sparse_members_in_any_form_are_one_error(tmp_path):
    """GNU sparse 1.0 (pax records) made tarfile raise ValueError, an old-style sparse header flagged
    'extended' at the end of the file IndexError: each was a traceback. Now one DataError line each."""
    sparse = b"".join(b"%d %s\n" % (len(k) + len(v) + 3 + len(str(len(k) + len(v) + 3)), k + b"=" + v)
                      for k, v in ((b"GNU.sparse.major", b"1"), (b"GNU.sparse.minor", b"0"),
                                   (b"GNU.sparse.name", b"a.png"), (b"GNU.sparse.realsize", b"600")))
    path = tmp_path / "sparse1.tar"
    path.write_bytes(_pax(sparse) + _member("GNUSparseFile.0/a.png", b"p" * 600) + _member("a.cls", b"1") + _END)
    with pytest.raises(DataError, match=rf"{path}: the member after byte 0 is a sparse file"):
        image_shards.scan_shard(str(path))
    old = bytearray(_header("a.png", b"%011o" % 600, kind=b"S"))
    old[482] = 1  # isextended: more sparse headers follow (here: the end of the file)
    old[148:156] = b" " * 8
    old[148:156] = b"%06o\0 " % sum(old)
    path = tmp_path / "sparse0.tar"
    path.write_bytes(_member("b.png", b"q") + _member("b.cls", b"1") + bytes(old))
    with pytest.raises(DataError, match=rf"^{path}: a.png is a sparse file, not the bytes themselves: write the "):
        image_shards.scan_shard(str(path))


def test_zero_length_members_are_stepped_over_an_empty_label_is_named(tmp_path):
    path = tmp_path / "s.tar"
    path.write_bytes(_member("a.png", b"") + _member("a.cls", b"2") + _member("b.png", b"p") + _member("b.cls", b"")
                     + _END)
    with pytest.raises(DataError, match=rf"{path}: b.cls holds b'', not a class index"):
        image_shards.scan_shard(str(path))
    path.write_bytes(_member("a.png", b"") + _member("a.cls", b"2") + _END)  # (an empty image: a bad image)
    assert image_shards.scan_shard(str(path)) == [(512, 0, 2)]


def _job_with_a_negative_size_shard(tmp_path) -> tuple[Path, Path]:
    """(the job's config, its shard): a shard whose third member's size field is -1000 (valid checksum)."""
    import yaml
    from conftest import job_dict

    shard = tmp_path / "train-000000.tar"
    shard.write_bytes(_member("a.png", b"p" * 600) + _member("a.cls", b"1") + _header("b.png", b"-0001000") + _END)
    job = job_dict(tmp_path, tmp_path / "runs")
    job["data"].update(kind="image_webdataset", train_files=[str(shard)], val_files=[str(shard)])
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job))
    return cfg, shard


@pytest.mark.timeout(60)
def test_check_of_a_set_with_a_negative_size_shard_answers_in_one_line(tmp_path, capsys):
    """`behemoth check` indexes the shards before Ray starts: a crafted shard hung it; now one line, at once."""
    import time

    cfg, shard = _job_with_a_negative_size_shard(tmp_path)
    started = time.monotonic()
    assert main(["check", str(cfg)]) == 1
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot read {shard} as an uncompressed tar shard (bad tar header at byte" in err
    assert took < 10, took  # it answers in well under a second; 10 s leaves room for a loaded machine


def test_check_of_an_image_job_answers_before_importing_torch(tmp_path):
    """Reading an image job's config and indexing its shards import neither torch, transformers nor Ray, so the
    check's one line about a crafted shard does not wait for them (torch alone took ~1.5 s here). A fresh
    process: this one has torch imported by other tests."""
    import os
    import subprocess
    import sys

    from conftest import WORKER_PYTHONPATH

    cfg, _ = _job_with_a_negative_size_shard(tmp_path)
    code = ("import contextlib, io, sys\n"
            "from behemoth.driver.commands.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    code = main(['check', {str(cfg)!r}])\n"
            "print(code, sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": WORKER_PYTHONPATH})
    assert done.stdout.strip() == "1 []", done.stdout + done.stderr
