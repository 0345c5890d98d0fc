"""Building a split's decoded cache (data/image/image_cache.py), once per node: `open_or_build` opens it where it is
complete, and otherwise builds it under the node's lock.

The cache's folder is meant to be on each node's own disk (a path, not a URI; on a network filesystem it
works, and the run says so: network_warning): one process per node builds it, under an exclusive lock of
`<key>.lock` that every other worker and trial on the node waits on, then finds it complete. Each builder
writes in a temporary folder of its own (`<key>.tmp-<host>-<pid>-<random>`, its lock held while it runs) and
removes only its own, or one it proves dead (this host's, its lock free): a folder shared by several nodes,
whose lock may not reach across them, never has one builder delete another's build. The building process first
reserves the cache's space on its disk (a full disk is one StorageFullError, not a SIGBUS through the memory
map), then decodes with Ray Data tasks on the cluster's CPUs, in order, and writes the rows as they come (one
shard in memory at a time); without Ray (unit tests, `workers=False`) it decodes in-process.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa

from behemoth.data.image.image_cache import (FORMAT, CachePlan, DecodedImages, check, file_sha256, free_disk,
                                      read_cache_manifest)
from behemoth.errors import DataError, StorageFullError
from behemoth.progress import progress

SHARD_BYTES = 64 << 20
BUILD_BLOCK_ROWS = 256  # rows per Ray Data decode task


def open_or_build(cache: CachePlan, table: pa.Table, *, workers: bool = True,
                  cpus_per_task: float = 1.0, log=print) -> DecodedImages:
    """The split's cache on this node: opened if complete and intact, else built (by the first process to take
    the node's lock; the others wait for it and open what it built)."""
    import PIL

    if cache.pillow and cache.pillow != PIL.__version__:  # this node would store other pixels under the same key
        raise DataError(f"the decoded image cache was planned with Pillow {cache.pillow} (the driver's), this node "
                        f"({_host()}) has Pillow {PIL.__version__}: its pixels could differ. Install the same "
                        f"Pillow on every node (or set data.cache: none)")
    folder = Path(cache.folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(folder.with_name(folder.name + ".lock")):
        problem = check(folder, cache)
        if problem is None:
            return DecodedImages(folder, read_cache_manifest(folder))
        if problem != "absent":
            log(f"[behemoth] decoded image cache {folder}: {problem}; building it again")
        began = time.monotonic()
        build(folder, cache, table, workers=workers, cpus_per_task=cpus_per_task, log=log)
        manifest = read_cache_manifest(folder)
        log(f"[behemoth] decoded {cache.rows} images once into {folder} ({manifest['bytes'] / 1e6:.1f} MB, "
            f"{time.monotonic() - began:.1f} s)")
        return DecodedImages(folder, manifest)


@contextmanager
def exclusive(lock_path: Path):
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the fd closes, also if this process dies
        yield
    finally:
        os.close(fd)


def build(folder: Path, cache: CachePlan, table: pa.Table, *, workers: bool, cpus_per_task: float,
          log=print) -> None:
    """Decode every row of `table` into a new cache, built in a temporary folder of this builder's own beside
    `folder` and renamed to it when complete. Its space is reserved before anything is decoded: a full disk
    ends the build with one StorageFullError (not retried). Whatever ends a build, what it wrote is removed."""
    _remove_dead_builds(folder, log)
    if folder.exists() and check(folder, cache) is not None:  # incomplete or damaged; not one another node's
        shutil.rmtree(folder, ignore_errors=True)                # builder has just completed
    with _build_folder(folder, cache) as tmp:
        shard_rows = max(1, SHARD_BYTES // (cache.size * cache.size * 3))
        shards = _reserved_shards(tmp, cache, shard_rows)
        valid, errors, sizes = _decode_into(shards, shard_rows, folder, cache, table, workers, cpus_per_task)
        _write_manifest(tmp, cache, shard_rows, valid, errors, sizes)
        _commit(tmp, folder, cache)


# A builder's temporary folder is `<key>.tmp-<host>-<pid>-<random>`: a cache folder on a shared filesystem is
# built beside other nodes' (and containers') builders, whose pids can be the same. In it, BUILDER_LOCK is held
# (flock) for as long as the build runs: the kernel releases it when the builder dies, however it dies.
BUILDER_LOCK = "builder.lock"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())


@contextmanager
def _build_folder(folder: Path, cache: CachePlan):
    """This builder's temporary folder, its lock held while the build runs; removed whatever ends the build
    (after _commit it is gone already). A full disk or quota ends it with one StorageFullError."""
    tmp = folder.with_name(f"{folder.name}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    lock = os.open(tmp / BUILDER_LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield tmp
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        from behemoth.storage.checkpoint import is_disk_full

        if is_disk_full(e):
            raise StorageFullError(_disk_full_message(folder, cache)) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)


def _remove_dead_builds(folder: Path, log) -> None:
    """Remove the temporary folders of this cache's builders that are proven dead: on this host, with their
    lock free. Never a live builder's: another host's is left (a lock on a network filesystem may not reach
    across nodes, so its builder may be alive), and said."""
    prefix = f"{folder.name}.tmp-"
    for temp in folder.parent.glob(f"{prefix}*"):
        host = temp.name[len(prefix):].rsplit("-", 2)[0]
        if host != _host():
            log(f"[behemoth] decoded image cache: {temp.name}: another host's build ({host}), left alone; remove "
                f"it if no build runs there")
        elif _lock_is_free(temp / BUILDER_LOCK):
            shutil.rmtree(temp, ignore_errors=True)


def _lock_is_free(path: Path) -> bool:
    """Whether no process holds the flock of `path`. No lock file: its builder is starting or committing."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # held: alive (or a filesystem without locks: not proven dead)
    finally:
        os.close(fd)


def _commit(tmp: Path, folder: Path, cache: CachePlan) -> None:
    """The complete cache in `tmp` renamed to `folder`. Where another node's builder has put one there first
    (the node's lock did not keep it out), that one is kept: made from the same key, it holds the same rows."""
    (tmp / BUILDER_LOCK).unlink()
    try:
        os.replace(tmp, folder)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or check(folder, cache) is not None:
            raise


def _reserved_shards(folder: Path, cache: CachePlan, shard_rows: int) -> list[Path]:
    """Every shard file of the cache, created at its full size with its disk blocks allocated. The rows are
    written through a memory map, where a page without room is a SIGBUS that kills the process (and a retry, the
    same way); reserved first, a full disk or quota is an OSError (ENOSPC, EDQUOT) here, before any decoding."""
    if free_disk(folder) < cache.nbytes:  # not even tried: filling the disk up would fail its other writers
        raise OSError(errno.ENOSPC, "No space left on device", str(folder))
    shards = []
    for number, first in enumerate(range(0, cache.rows, shard_rows)):
        path = folder / f"pixels-{number:05d}.npy"
        rows = min(shard_rows, cache.rows - first)
        with open(path, "wb") as f:  # a .npy header, then the rows' blocks (np.load maps them)
            shape = (rows, cache.size, cache.size, 3)
            np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False, "shape": shape})
            f.flush()
            os.posix_fallocate(f.fileno(), 0, f.tell() + rows * cache.size * cache.size * 3)
        shards.append(path)
    return shards


def _decode_into(shards: list[Path], shard_rows: int, folder: Path, cache: CachePlan, table: pa.Table,
                 workers: bool, cpus_per_task: float) -> tuple[np.ndarray, dict[str, str], np.ndarray | None]:
    """Decode every row into the reserved shards, in order; the valid flags, the errors of those that are not,
    and for views each image's upright (width, height)."""
    valid = np.zeros(cache.rows, dtype=bool)
    sizes = np.zeros((cache.rows, 2), dtype=np.int32) if cache.views else None
    errors: dict[str, str] = {}
    current, written = None, 0
    batches = _decoded_batches(table, cache, workers, cpus_per_task)
    total = -(-table.num_rows // BUILD_BLOCK_ROWS)
    for batch in progress(batches, f"decoding {cache.rows} images once", total=total, unit="block"):
        for i in range(len(batch["sample_id"])):
            sample = int(batch["sample_id"][i])
            if sample != written:
                raise DataError(f"decoding for {folder} returned sample {sample} where {written} was due")
            if written % shard_rows == 0:
                if current is not None:
                    current.flush()
                current = np.load(shards[written // shard_rows], mmap_mode="r+")
            current[written % shard_rows] = batch["pixels"][i]
            valid[written] = batch["valid"][i]
            if sizes is not None:
                sizes[written] = batch["sizes"][i]
            if not batch["valid"][i]:
                errors[str(written)] = str(batch["error"][i])
            written += 1
    if written != cache.rows:
        raise DataError(f"decoding for {folder} returned {written} of {cache.rows} images")
    if current is not None:
        current.flush()
    return valid, errors, sizes


def _write_manifest(folder: Path, cache: CachePlan, shard_rows: int, valid: np.ndarray, errors: dict,
                    sizes: np.ndarray | None = None) -> None:
    import PIL

    np.save(folder / "valid.npy", valid)
    entries = [_entry(folder, path.name) for path in sorted(folder.glob("pixels-*.npy"))]
    manifest = {"format": FORMAT, "rows": cache.rows, "size": cache.size, "image_column": cache.image_column,
                "pillow": PIL.__version__, "shard_rows": shard_rows,
                "shards": entries, "valid": _entry(folder, "valid.npy"), "errors": errors,
                "bytes": sum(e["bytes"] for e in entries)}
    if sizes is not None:
        np.save(folder / "sizes.npy", sizes)
        manifest["sizes"] = _entry(folder, "sizes.npy")
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _disk_full_message(folder: Path, cache: CachePlan) -> str:
    """The line a full disk ends the build with, in the words of a checkpoint's (checkpoints/saver.py)."""
    where = folder.parent
    return (f"the decoded image cache did not fit: no space left on the device of {where}; it needs about "
            f"{cache.nbytes / 1e6:.1f} MB, {free_disk(where) / 1e6:.1f} MB is free. What it had written is removed. "
            f"Free space there, or point data.cache_dir at a larger disk (or set data.cache: none), then rerun "
            f"the same command")


def _entry(folder: Path, name: str) -> dict:
    st = (folder / name).stat()
    return {"file": name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_sha256(folder / name)}


def _decoded_batches(table: pa.Table, cache: CachePlan, workers: bool, cpus_per_task: float):
    """The rows of `table` decoded and fitted (or as views), in order: by Ray Data tasks, or here
    (`workers=False`)."""
    from behemoth.data.image.image_batches import decode_fitted, decode_views

    decode = decode_views if cache.views else decode_fitted

    blocks = [table.slice(i, BUILD_BLOCK_ROWS) for i in range(0, table.num_rows, BUILD_BLOCK_ROWS)]
    kwargs = dict(size=cache.size, image_column=cache.image_column, max_pixels=cache.max_pixels,
                  **({} if cache.views else {"fit": cache.fit}))
    if not workers:
        for block in blocks:
            yield decode({k: block.column(k).to_numpy(zero_copy_only=False) for k in block.column_names}, **kwargs)
        return
    import ray.data

    from behemoth.data.pipeline import ordered_data_context

    ordered_data_context()
    ds = ray.data.from_blocks(blocks).map_batches(decode, batch_format="numpy", batch_size=None,
                                                   num_cpus=cpus_per_task, fn_kwargs=kwargs)
    yield from ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2)
