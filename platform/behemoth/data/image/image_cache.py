"""Decoded images, once per node: every image of a split decoded and centre-fitted once, kept as uint8 rows in
memory-mapped shard files that every epoch, restart, rerun and sweep trial on the node reads by global index.
This module holds what a cache is: its plan and key, the check that one is complete, and the reading of its
rows (DecodedImages); building one, once per node, is data/image/image_cache_build.py's.

What is stored is the deterministic part of the image pipeline (image_batches.decode_rgb, then
image_batches.center_fit to data.image_size): the base that crop_flip pads, crops and flips, and the rows that
evaluation uses as they are (the validation split's fitted from the shorter side at ImageData.eval_fit). The random part (drawn from (seed, epoch, sample id), image_batches.augment_fitted) and the
normalisation still run every epoch, on the worker, from these rows: the same pixels reach the model as without
the cache, so a run ends on the same weights (tests/integration/test_train_images.py). random_resized_crop crops
the original image, not a fitted one: it is cached only where the job asks (data.cache_side), as views of the
whole image (image_batches.decode_views, `views`: each image resized to S x S, its upright size in sizes.npy)
that every epoch's crop is taken from (decode.crop_from_view): the same windows, not the same pixels.

A split's cache is a folder `<data.cache_dir>/images/<key>` whose key hashes every input of the stored pixels
(cache_key: the samples in order, each file's size and modification time, the image column, the stored size,
the decoding code's and Pillow's versions, the cache format): a changed, added or touched file, another column
or another Pillow makes another key, so a stale cache is never read. In it: `pixels-00000.npy`, ... (uint8
[rows, S, S, 3], up to image_cache_build.SHARD_BYTES each), `valid.npy` (False: the image could not be
decoded, its error in manifest.json) and `manifest.json`, written last: its presence means complete. Each
shard's size, modification time and sha256 are in the manifest; a shard whose size differs, or whose time
differs and whose hash no longer matches (damaged, partly overwritten), makes the cache be built again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from behemoth.data.image.decode import MAX_IMAGE_PIXELS
from behemoth.data.image.image_config import ImageData
from behemoth.errors import DataError
from behemoth.storage.paths import is_inside
from behemoth.storage.store import Store

FORMAT = 2  # 2: the manifest names the image column and Pillow's version
# What decode_fitted stores: change it whenever decode_rgb or center_fit would give other pixels for the same bytes
PIXELS = "decode_rgb (EXIF upright, RGB, alpha dropped) then center_fit (bilinear shorter side, centre crop) v1"
# What decode_views stores instead (data.cache_side): change it whenever decode_views would give other pixels
VIEWS = "views: decode_rgb then the whole image resized to S x S (bilinear), its upright size in sizes.npy v1"


@dataclass(frozen=True)
class CachePlan:
    """Where a split's decoded cache lives on every node, and what it holds (travels to the workers)."""

    folder: str
    size: int
    rows: int
    image_column: str  # the parquet column decoded (image files and tar members ignore it)
    # False: centre-fitted rows (image_batches.decode_fitted); True: views of the whole image and their sizes, for
    # random_resized_crop (image_batches.decode_views, data.cache_side)
    views: bool = False
    # the driver's Pillow (part of the cache key: it decodes and resamples): a worker with another refuses
    pillow: str = ""
    # data.max_image_pixels (part of the key: it decides which images are stored as bad)
    max_pixels: int = MAX_IMAGE_PIXELS
    # centre-fitted rows: the shorter side the image is resized to before the crop (0: size; evaluation's rows:
    # ImageData.eval_fit). Part of the key.
    fit: int = 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.size * self.size * 3


def cache_key(table: pa.Table, size: int, image_column: str, views: bool = False,
              max_pixels: int = MAX_IMAGE_PIXELS, fit: int = 0) -> str:
    """A hash of every input of the stored pixels:
    - the samples in order: each one's file (absolute path), parquet row or tar member offset, and tar member
      length (the index's `path`, `row` and `size` columns);
    - each file's size, modification time, inode and change time (its content, without reading it);
    - `image_column`: which cell of a parquet row is decoded (a set may hold several image columns);
    - `size` (data.image_size), and how the pixels are made from the bytes: PIXELS (decode_rgb, center_fit)
      and Pillow's version (its decoders and resampling), with the cache FORMAT;
    - `max_pixels` (data.max_image_pixels): an image over it is stored as bad;
    - `fit`: the shorter side center_fit resizes to, where it is not `size` (evaluation's eval_crop_pct).
    Not inputs: the labels (read from the index every run, never stored) and the augmentation, normalisation
    and seed (applied to the stored rows every epoch)."""
    import PIL

    h = hashlib.sha256(f"behemoth decoded images v{FORMAT}\0{PIXELS}\0Pillow {PIL.__version__}\0{size}\0"
                       f"column {image_column}\0max pixels {max_pixels}\n".encode())
    if views:  # (centre-fitted caches keep the keys they had)
        h.update(f"{VIEWS}\n".encode())
    if fit and fit != size:  # (as do those fitted from the shorter side at size)
        h.update(f"fitted from the shorter side at {fit}\n".encode())
    for column in ("row", "size"):
        h.update(np.asarray(table.column(column).to_numpy(), dtype="<i8").tobytes())
    paths = [os.path.abspath(p) for p in table.column("path").to_pylist()]  # however the data folder was named
    for path in dict.fromkeys(paths):  # each file once, in first-seen order
        try:
            st = os.stat(path)
        except OSError as e:
            raise DataError(f"cannot read {path} ({e.strerror}): it is in the data set's index") from None
        # the inode and the change time too: a file rewritten in place with its size and modification time
        # put back (rsync -a, cp -p, tar x do that) keeps both of those, never its change time
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_ctime_ns}\n".encode())
    h.update("\n".join(paths).encode())
    return h.hexdigest()[:24]


def node_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_disk(folder: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) `folder`."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


# Filesystems whose files live on other machines (/proc/mounts' type): a cache there is read over the network
# and shared by every node's builders. Not fuse.* at large: rootless containers' fuse-overlayfs is a local disk.
NETWORK_FILESYSTEMS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "afs", "wekafs",
    "panfs", "ocfs2", "gfs2", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.juicefs",
    "fuse.glusterfs", "fuse.ceph-fuse", "fuse.cephfs", "fuse.blobfuse", "fuse.blobfuse2", "fuse.goofys",
    "fuse.mountpoint-s3",
}


def mount_table() -> str:
    """This machine's mounts, as /proc/mounts lists them ("" where it cannot be read)."""
    try:
        return Path("/proc/mounts").read_text()
    except OSError:
        return ""


def network_filesystem(folder: str | Path, mounts: str) -> str | None:
    """The type of the network filesystem that holds the absolute path `folder` (per `mounts`, the text of
    /proc/mounts: the mount with the longest mount point above it, the last one where points repeat), or None
    where it is on a local one."""
    path, best, kind = str(folder), "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # \040: a space
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind if kind in NETWORK_FILESYSTEMS else None


def network_warning(folder: str | Path) -> str | None:
    """What to tell a run whose cache folder is on a network filesystem (None where it is not)."""
    kind = network_filesystem(os.path.realpath(folder), mount_table())
    if kind is None:
        return None
    return (f"the decoded image cache's folder {folder} is on a network filesystem ({kind}): its rows are read "
            f"over the network, and the nodes share it (one node's lock may not keep another's builder out); set "
            f"data.cache_dir to a folder on each node's own disk (a local SSD, /tmp)")


def plan(table: pa.Table, size: int, cache_dir: str, image_column: str, views: bool = False,
         max_pixels: int = MAX_IMAGE_PIXELS, fit: int = 0) -> CachePlan:
    fit = 0 if fit == size else fit
    folder = Path(cache_dir).absolute() / "images" / cache_key(table, size, image_column, views, max_pixels, fit)
    import PIL

    return CachePlan(str(folder), size, table.num_rows, image_column, views, PIL.__version__, max_pixels, fit)


class DecodedImages:
    """A complete split cache, memory-mapped: `rows(ids)` gathers uint8 [n, S, S, 3] and the valid flags."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder, self.manifest = folder, manifest
        self.shard_rows = manifest["shard_rows"]
        self.shards = [np.load(folder / s["file"], mmap_mode="r") for s in manifest["shards"]]
        self.valid = np.load(folder / "valid.npy")
        self.errors = {int(k): v for k, v in manifest["errors"].items()}
        # views (data.cache_side): each row's original upright (width, height)
        self.sizes = np.load(folder / manifest["sizes"]["file"]) if "sizes" in manifest else None

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        shard, offset = np.divmod(ids, self.shard_rows)
        if len(self.shards) == 1:
            pixels = self.shards[0][offset]
        else:
            pixels = np.empty((len(ids), *self.shards[0].shape[1:]), dtype=np.uint8)
            for s in np.unique(shard):
                at = shard == s
                pixels[at] = self.shards[s][offset[at]]
        return pixels, self.valid[ids]


def read_cache_manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def check(folder: Path, cache: CachePlan) -> str | None:
    """None if the cache in `folder` is complete and intact; else what is wrong with it."""
    try:
        manifest = read_cache_manifest(folder)
    except FileNotFoundError:
        return "absent" if not folder.exists() else "incomplete (no manifest.json)"
    except (OSError, ValueError) as e:
        return f"unreadable manifest.json ({e})"
    made_for = (manifest.get("format"), manifest.get("rows"), manifest.get("size"), manifest.get("image_column"),
                "sizes" in manifest)
    if made_for != (FORMAT, cache.rows, cache.size, cache.image_column, cache.views):
        return "made for other data"
    for entry in [*manifest["shards"], manifest["valid"], *([manifest["sizes"]] if cache.views else [])]:
        # DecodedImages memory-maps folder / file: a name with a '/' or '..', or an absolute one, would read a
        # file outside the cache, so the manifest is damaged (and the cache built again)
        if not is_inside(entry["file"]) or "/" in entry["file"]:
            return f"manifest.json names {entry['file']!r}, not a file's plain name inside the cache's folder"
        path = folder / entry["file"]
        try:
            st = path.stat()
        except OSError:
            return f"{entry['file']} is missing"
        if st.st_size != entry["bytes"]:
            return f"{entry['file']} holds {st.st_size} bytes, not {entry['bytes']}"
        if st.st_mtime_ns != entry["mtime_ns"] and file_sha256(path) != entry["sha256"]:
            return f"{entry['file']} was changed after it was written (its sha256 differs)"
    return None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def decide_cache(cfg: ImageData, index) -> tuple[dict | None, str]:
    """data.cache resolved for this run: the splits' cache plans (None: decode every epoch), and why."""
    if cfg.cache == "none":
        return None, "none (data.cache=none): images are decoded every epoch"
    views = cfg.augment == "random_resized_crop" and cfg.cache_side > 0  # crops taken from stored views
    if (cfg.augment == "random_resized_crop" and not views) or not Store(cfg.cache_dir).is_local:
        why = "random_resized_crop crops the original (data.cache_side keeps views to crop from)" \
            if cfg.augment == "random_resized_crop" else f"data.cache_dir {cfg.cache_dir} is a URI, not a folder on each node"
        return None, f"none (auto: {why}): images are decoded every epoch"
    # training rows: views of the whole image at cache_side (random_resized_crop), else centre-fitted; evaluation
    # rows always centre-fitted at image_size, from the shorter side at eval_fit
    plans = {"train": plan(index.train, cfg.cache_side if views else cfg.image_size, cfg.cache_dir,
                                       cfg.image_column, views=views, max_pixels=cfg.max_image_pixels),
             "val": plan(index.val, cfg.image_size, cfg.cache_dir, cfg.image_column,
                                     max_pixels=cfg.max_image_pixels, fit=cfg.eval_fit())}
    need = sum(p.nbytes for p in plans.values())
    built = all(check(Path(p.folder), p) is None for p in plans.values())
    where = Path(plans["train"].folder).parent
    size = f"{need / 1e6:,.1f} MB for {sum(p.rows for p in plans.values()):,} images at {cfg.image_size}x{cfg.image_size}"
    if views:
        size += f" (train: whole-image views at {cfg.cache_side}x{cfg.cache_side} to crop from)"
    if cfg.cache == "auto" and not built:
        room = cfg.cache_max_share * min(node_memory(), free_disk(where))
        if need > room:
            return None, (f"none (auto: the decoded images, {size}, would take more than data.cache_max_share="
                          f"{cfg.cache_max_share} of this node's RAM or of the free disk at {where}): images are "
                          f"decoded every epoch")
    state = "built already" if built else "built on first use, once per node"
    return plans, f"decoded ({size}, in {where}; {state})"
