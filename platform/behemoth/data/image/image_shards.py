"""WebDataset tar shards as an image source (data.kind: image_webdataset): the index of (shard, member) pairs,
reading a member's bytes, and writing an ImageFolder as shards (`behemoth data shards`).

A WebDataset shard is a plain tar whose members are grouped into samples by their key, the member's name up to
the first dot of its base name: `00000017.png` and `00000017.cls` are one sample, its image and its class
index (decimal text); a sample's members are next to each other. Ray Data's read_webdataset streams whole shards
in their order; behemoth's exact order (a new permutation of all samples every epoch, resumable at any step)
needs any sample at any time, so the index records where each image's bytes lie in its shard (the member's data
offset and size, from the tar headers), and a decode task reads them with one ranged read. Class names come
from a `classes.txt` beside the first training shard (one per line, line i names class i), which `behemoth
data shards` writes; without it the classes are the class indices seen, sorted numerically, as text.
"""

from __future__ import annotations

import functools
import io
import os
import tarfile
from pathlib import Path

from behemoth.errors import DataError
from behemoth.progress import progress

# The still-image formats Pillow decodes (decode_rgb: a GIF's first frame, as RGB): an image folder's and a
# shard's alike, so that `behemoth data shards` of any folder gives shards this reader reads whole
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff")
LABEL_EXTENSION = "cls"
CLASSES_FILE = "classes.txt"


def split_key(name: str) -> tuple[str, str]:
    """A member's (sample key, extension): WebDataset's split at the first dot of the base name."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


def scan_shard(path: str) -> list[tuple[int, int, int]]:
    """One shard's samples in member order: (image data offset, image size, class index). A sample needs
    exactly one image member and a .cls member; anything else in the shard is ignored."""
    samples: dict[str, dict] = {}
    try:
        members = _members(path)
    except DataError:
        raise  # behemoth's own line already names the shard and what to do
    except (tarfile.TarError, OSError, ValueError, IndexError, KeyError, OverflowError) as e:
        # (tarfile raises more than TarError on a crafted header: ValueError, IndexError on sparse maps)
        fix = "decompress it" if _compressed(path) else "it is damaged or not a tar: write it again"
        raise DataError(f"cannot read {path} as an uncompressed tar shard ({e}): {fix} (`behemoth data shards` "
                        f"or `tar cf`)") from None
    last = None
    for name, offset, size, data in members:
        key, ext = split_key(name)
        if ext not in IMAGE_EXTENSIONS and ext != LABEL_EXTENSION:
            continue
        if key != last and key in samples:
            raise DataError(f"{path}: sample key {key} appears again at {name}, apart from its other members: a "
                            f"sample's members must be next to each other, each key once")
        sample, last = samples.setdefault(key, {}), key
        part = "image" if ext in IMAGE_EXTENSIONS else "label"
        if part in sample:
            raise DataError(f"{path}: sample {key} has two {part} members ({sample[part + '_name']}, {name})")
        sample[part + "_name"] = name
        sample[part] = (offset, size) if part == "image" else _class_index(data, path, name)
    out = []
    for key, sample in samples.items():
        if "image" not in sample or "label" not in sample:
            lacks = f".{LABEL_EXTENSION} member" if "image" in sample else \
                f"image member ({', '.join('.' + e for e in IMAGE_EXTENSIONS)})"
            raise DataError(f"{path}: sample {key} has no {lacks}; every sample key needs an image and a class")
        out.append((*sample["image"], sample["label"]))
    if not out:
        raise DataError(f"{path} holds no samples (image + .{LABEL_EXTENSION} members)")
    return out


def _members(path: str) -> list:
    """Every member's (name, data offset, size, label data): read directly, or by tarfile where the shard needs
    it (after the direct reader has checked every header, extended ones included)."""
    try:
        return list(_plain_members(path))
    except _NotPlain:
        return list(_tarfile_members(path))


def _compressed(path: str) -> bool:
    """Whether the file starts as gzip, bzip2, xz or zstd data."""
    try:
        with open(path, "rb") as f:
            start = f.read(6)
    except OSError:
        return False
    return start.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd"))


class _NotPlain(Exception):
    """A header _plain_members leaves to tarfile (long names, pax, a checksum it does not add up)."""


_READ = 1 << 16  # bytes read at a header: the next headers of small members come with it
_READ_AFTER_LARGE = 8 * tarfile.BLOCKSIZE  # after a larger member: the header, and a label member's data


# The largest extended header (a pax record set, a GNU long name) read: a long path's is a few hundred bytes.
# CPython's tarfile before 3.11.10 parses a crafted pax header in quadratic time (CVE-2024-6232: seconds at
# 80 KB, minutes at 1 MB, on every rank): behemoth checks every extended header itself before tarfile sees one.
MAX_EXTENDED = 8192


def _plain_members(path: str):
    """(name, data offset, size, data of a label member) of each regular file, from the 512-byte ustar/v7
    headers read directly: a shard is mostly headers and small members, and tarfile's per-member objects cost
    ~10x this per sample (1.1M samples: minutes). Raises _NotPlain, after the whole shard's headers are read
    and each extended one checked (_extended), where the shard needs tarfile (long names, pax, a checksum
    that does not add up: tarfile also accepts old signed sums, and names a damaged header) - but only once
    each header's size is known to be good: tarfile steps back over a negative size forever."""
    block = tarfile.BLOCKSIZE
    needs_tarfile, next_size = False, None  # (a pax record's size for the next member)
    with open(path, "rb") as f:
        fd, end = f.fileno(), os.fstat(f.fileno()).st_size
        offset, buf, at, want = 0, b"", 0, _READ
        while offset < end:  # (a shard may end after a member, without the end blocks: tarfile reads it too)
            if offset + block > end:
                raise tarfile.ReadError(f"the shard ends inside the header at byte {offset}")
            if not at <= offset <= at + len(buf) - block:
                buf, at = os.pread(fd, want, offset), offset
            header = buf[offset - at:offset - at + block]
            if header == tarfile.NUL * block:
                if os.pread(fd, block, offset + block).strip(tarfile.NUL):
                    raise tarfile.ReadError(f"bad tar header at byte {offset}: a zero block amid the members")
                break  # the end-of-archive blocks
            name = header[:100].split(b"\0", 1)[0]
            if header[257:262] == b"ustar" and header[345] != 0:  # (GNU headers hold times there: tarfile joins
                name = header[345:500].split(b"\0", 1)[0] + b"/" + name  # them too, so both readers agree)
            name, data = name.decode("utf-8", "surrogateescape"), offset + block
            kind, size = header[156:157], _size(header)
            if size is None:
                raise tarfile.ReadError(f"bad tar header at byte {offset} ({name!r}): its size field "
                                        f"{header[124:136]!r} is not a size")
            if kind in (b"x", b"g", b"X", b"L", b"K"):
                if size > MAX_EXTENDED:
                    raise tarfile.ReadError(f"bad tar header at byte {offset}: an extended header of {size} bytes "
                                            f"(behemoth reads up to {MAX_EXTENDED})")
                pax_size = _extended(path, kind, os.pread(fd, size, data), offset)
                if pax_size == "unreadable":
                    raise _NotPlain  # tarfile takes it from here, and its size check names the member
                next_size, needs_tarfile = pax_size, True
            elif next_size is not None:
                size, next_size = next_size, None
            if kind in (b"1", b"2", b"S"):  # (refused for what it is, before what it claims to hold is checked)
                _not_bytes(path, name, {b"1": "hard link", b"2": "symbolic link", b"S": "sparse file"}[kind])
            if data + size > end:
                raise tarfile.ReadError(f"the shard ends inside {name}, {data + size - end} bytes short")
            needs_tarfile = needs_tarfile or _checksum(header) != _octal(header[148:156])
            if kind in (b"0", b"\0", b"7") and not needs_tarfile:  # regular files
                label = None
                if split_key(name)[1] == LABEL_EXTENSION:
                    inside = data - at + size <= len(buf)
                    label = buf[data - at:data - at + size] if inside else os.pread(fd, size, data)
                yield name, data, size, label
            offset = data + -(-size // block) * block
            want = _READ if size < _READ else _READ_AFTER_LARGE
    if needs_tarfile:
        raise _NotPlain


def _extended(path: str, kind: bytes, data: bytes, offset: int):
    """Check an extended header before tarfile parses it: a pax record set must be well formed ("LENGTH
    key=value\n" records that add up to the header) and name no sparse file; a GNU long name is a name.
    Returns the size a pax record gives the next member (None: none; "unreadable": one that is not a size,
    which tarfile's own reading refuses, naming the member)."""
    if kind in (b"L", b"K"):
        return None
    at, size = 0, None
    body = data.rstrip(b"\0")  # (records end in a newline: what follows the last is padding)
    while at < len(body):
        space = body.find(b" ", at, at + 21)
        length = body[at:space] if space > at else b""
        if not length.isdigit() or not 0 < int(length) <= len(body) - at:
            raise tarfile.ReadError(f"bad tar header at byte {offset}: a pax record at byte {at} of it does not "
                                    f"start with its length")
        record = body[at:at + int(length)]
        key, eq, value = record[space - at + 1:-1].partition(b"=")
        if not record.endswith(b"\n") or not eq or not key:
            raise tarfile.ReadError(f"bad tar header at byte {offset}: a pax record at byte {at} of it is not "
                                    f"'LENGTH key=value'")
        if key.startswith(b"GNU.sparse"):
            raise DataError(f"{path}: the member after byte {offset} is a sparse file, not the bytes themselves: "
                            f"write the shard with `behemoth data shards`, or `tar cf` of the files")
        if key == b"size":
            size = int(value) if value.isdigit() else "unreadable"
        at += int(length)
    return size


def _octal(field: bytes) -> int | None:
    """A numeric field's octal digits; None where it holds anything else (int() would take a sign, '0o' or
    '_': a size of -1000 would step back forever)."""
    digits = field.split(b"\0", 1)[0].strip()
    if digits.translate(None, b"01234567"):
        return None
    return int(digits, 8) if digits else 0


def _size(header: bytes) -> int | None:
    """The size field: octal digits, or base-256 after a 0x80 byte (GNU's form for 8 GiB and more); None where
    it is neither, or negative (base-256 after 0xff)."""
    field = header[124:136]
    return int.from_bytes(field[1:], "big") if field[0] == 0x80 else None if field[0] & 0x80 else _octal(field)


def _checksum(header: bytes) -> int:
    return sum(header[:148]) + 8 * 0x20 + sum(header[156:])  # the checksum field counts as spaces


def _tarfile_members(path: str):
    with tarfile.open(path, mode="r:") as tar:  # "r:": uncompressed, so the data offsets are file offsets
        end = os.fstat(tar.fileobj.fileno()).st_size
        for member in tar:
            # Checked before tarfile reads on: it takes a negative size (a sign in the field, base-256 after
            # 0xff, a pax record) and steps back to the same header forever. (A sparse member's size is the
            # size it expands to.)
            if member.size < 0 or (member.size > end - member.offset_data and not member.issparse()):
                raise tarfile.ReadError(f"bad tar header at byte {member.offset} ({member.name!r}): its size "
                                        f"{member.size} is not a size within the shard's {end} bytes")
            if member.islnk() or member.issym() or member.issparse():
                _not_bytes(path, member.name, "hard link" if member.islnk() else
                           "symbolic link" if member.issym() else "sparse file")
            if member.isfile():
                label = tar.extractfile(member).read() if split_key(member.name)[1] == LABEL_EXTENSION else None
                yield member.name, member.offset_data, member.size, label
        # tarfile ends quietly at a damaged header after the first: what follows it must be the end blocks
        with open(path, "rb") as f:
            rest = os.pread(f.fileno(), 2 * tarfile.BLOCKSIZE, tar.offset)
        if rest.strip(tarfile.NUL):
            raise tarfile.ReadError(f"bad tar header at byte {tar.offset}")


def _not_bytes(path: str, name: str, what: str) -> None:
    """A link or a sparse member in place of an image or a class: refused (its offset does not hold the bytes)."""
    if split_key(name)[1] in (*IMAGE_EXTENSIONS, LABEL_EXTENSION):
        raise DataError(f"{path}: {name} is a {what}, not the bytes themselves: write the shard with `behemoth data "
                        f"shards`, or `tar cf` of the files (--hard-dereference)")


def _class_index(data: bytes, path: str, name: str) -> int:
    try:
        value = int(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise DataError(f"{path}: {name} holds {data[:40]!r}, not a class index (decimal text)") from None
    if value < 0:
        raise DataError(f"{path}: {name} holds a negative class index ({value})")
    return value


def index_shards(files: list[str]) -> list[tuple[str, int, int, int]]:
    """(shard, data offset, size, class index) per sample: shards in the order given, members in tar order."""
    entries = []
    for path in progress(files, "indexing tar shards", unit="shard"):
        entries += [(path, offset, size, label) for offset, size, label in scan_shard(path)]
    return entries


def classes_file(train_files: list[str]) -> Path:
    return Path(train_files[0]).parent / CLASSES_FILE


def class_names(train_files: list[str], labels: set[int]) -> tuple[list[str], dict[int, int]]:
    """The class names and each class index's position among them: from classes.txt beside the first training
    shard where there is one (class i is line i), else the indices seen, sorted."""
    named = classes_file(train_files)
    if named.is_file():
        try:
            classes = named.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise DataError(f"{named} is not UTF-8 text ({e}): one class name per line") from None
        if "" in classes:
            raise DataError(f"{named} line {classes.index('') + 1} is empty: line i names class i, every line a "
                            f"name")
        beyond = sorted(v for v in labels if v >= len(classes))
        if beyond:
            raise DataError(f"class index {beyond[0]} is beyond {named}'s {len(classes)} class names")
        return classes, {i: i for i in range(len(classes))}
    seen = sorted(labels)
    return [str(v) for v in seen], {v: i for i, v in enumerate(seen)}


def read_members(path: str, places: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of the members at (data offset, size) in one shard, the file opened once."""
    out = []
    with open(path, "rb") as f:
        for offset, size in places:
            data = os.pread(f.fileno(), size, offset)
            if len(data) != size:
                raise DataError(f"{path} ends {size - len(data)} bytes into the member at byte {offset}: the shard "
                                f"changed after it was indexed; rerun to index it again")
            out.append(data)
    return out


def member_name(path: str, offset: int) -> str:
    """The member whose data starts at `offset`, for messages (the header before it may hold a shortened name:
    tarfile reads the long-name records)."""
    try:
        st = os.stat(path)
        return f"{path}:{_names(path, st.st_size, st.st_mtime_ns)[offset]}"
    except (OSError, tarfile.TarError, DataError, KeyError, ValueError, IndexError, OverflowError):
        return f"{path} (the member at byte {offset})"


@functools.lru_cache(maxsize=4)
def _names(path: str, size: int, mtime_ns: int) -> dict[int, str]:
    """Member names by data offset (once per shard version: a decode task may name many bad images of one)."""
    return {at: name for name, at, _, _ in _members(path)}


def write_shards(index, out: Path, samples_per_shard: int) -> dict[str, int]:
    """An ImageFolder's index (images.index_image_folder) as WebDataset shards: OUT/{split}-NNNNNN.tar, samples
    in the index's order (so a run on the shards sees the samples of a run on the folder, by the same ids), each
    the file's bytes as `KEY.<suffix>` and its class index as `KEY.cls`; OUT/classes.txt names the classes.
    Members carry no owner or time: the same folder writes the same bytes. Returns shards per split."""
    if samples_per_shard < 1:
        raise DataError(f"samples per shard must be >= 1, got {samples_per_shard}")
    old = sorted(p.name for p in out.glob("*-*.tar")) if out.is_dir() else []
    if old:  # (shards of another split size would stay, and the job's globs would read them too)
        raise DataError(f"{out} holds shards already ({old[0]}, ...): remove them or write to another folder")
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split in ("train", "val"):
        table = getattr(index, split)
        files, labels = table.column("path").to_pylist(), table.column("label").to_pylist()
        shards = range(0, len(files), samples_per_shard)
        for n, start in enumerate(progress(shards, f"writing {split} shards", unit="shard")):
            _write_shard(out / f"{split}-{n:06d}.tar", range(start, min(start + samples_per_shard, len(files))),
                         files, labels)
        written[split] = len(shards)
    _write_atomically(out / CLASSES_FILE, "".join(f"{c}\n" for c in index.classes).encode())
    return written


def _write_shard(path: Path, ids: range, files: list[str], labels: list[int]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in ids:
            suffix = Path(files[i]).suffix.lower().lstrip(".")
            _add(tar, f"{i:08d}.{suffix}", Path(files[i]).read_bytes())
            _add(tar, f"{i:08d}.{LABEL_EXTENSION}", str(labels[i]).encode())
    os.replace(tmp, path)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
