"""A checkpoint in an object store as a local folder the processes of one node share.

The ranks of a node that restore the same checkpoint whole (a full checkpoint: under DDP every rank reads all
of it) download it once: the first to open it downloads every file its manifest lists, each checked against
its size and sha256 as it arrives (the manifest last, by rename: a copy is committed only when every file
matches), into a folder named by the checkpoint and its manifest's bytes; the others wait for that and read
the same files. Every user holds a shared flock on the copy while it reads; a copy nobody holds (its last user
closed it, or died: the kernel drops a dead process's locks, whatever its pid namespace) is removed by its
last closer, or by the next process that opens any checkpoint on the node. A removal takes the manifest
first, so a removal cut short leaves a copy that is never taken for complete.

The copies live in one folder of the node's temp folder that is this user's alone (0700, not a link); its own
flock orders opening, downloading and removing (one download at a time per node: the node's ranks restore the
same checkpoint). Where that folder is not this user's alone, each process downloads into a temporary folder of
its own, as Ray's download did.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from behemoth.storage.checkpoint import MANIFEST, read_manifest, read_manifest_bytes
from behemoth.errors import CheckpointError


@contextlib.contextmanager
def node_copy(fs, path: str, where: str, manifest_bytes: bytes | None = None) -> Iterator[Path]:
    """The checkpoint at `path` on the pyarrow filesystem `fs` (`where` names it in messages; its manifest's
    bytes read here unless given) as a local folder while the block runs, every file matching the manifest
    when it was downloaded (CheckpointError where the store's file does not: see _fetch)."""
    if manifest_bytes is None:
        manifest_bytes = read_manifest_bytes(path, fs, where)
    files = read_manifest(manifest_bytes, where)["files"]
    parent = own_temp_folder("behemoth-checkpoints")
    if parent is None:
        with tempfile.TemporaryDirectory(prefix="behemoth-checkpoint-") as d:
            _download(fs, path, files, manifest_bytes, Path(d), where)
            yield Path(d)
        return
    folder = parent / hashlib.sha256(path.encode() + b"\n" + manifest_bytes).hexdigest()[:32]
    with _locked(parent):
        for other in parent.iterdir():
            if other != folder:
                _remove_if_unused(other)
        if not (folder / MANIFEST).is_file():  # absent, a download cut short, or a removal cut short
            _remove(folder)
            folder.mkdir(mode=0o700)
            try:
                _download(fs, path, files, manifest_bytes, folder, where)
            except BaseException:
                _remove(folder)
                raise
        use = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        fcntl.flock(use, fcntl.LOCK_SH)  # never waits: exclusive locks are only tried, under the parent's
    try:
        yield folder
    finally:
        with _locked(parent):
            os.close(use)
            _remove_if_unused(folder)


def own_temp_folder(name: str) -> Path | None:
    """The node's temp folder's `name`-UID folder, made if needed, where it is a real folder of this user's
    that no one else may enter (another user could plant files in it); else None."""
    folder = Path(tempfile.gettempdir()) / f"{name}-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return folder


def _download(fs, path: str, files: dict, manifest_bytes: bytes, folder: Path, where: str) -> None:
    """Every file the manifest lists (`files`, its entries), a few at once, each checked against its size and
    sha256 as it arrives, then the manifest (by rename: its presence means the copy is complete and matches).
    A file the store does not have, or holds other bytes of, is the checkpoint's fault (CheckpointError); any
    other error is the store's (the worker fails and Ray retries, as with a failed download before)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        for done in [pool.submit(_fetch, fs, path, name, entry, folder, where) for name, entry in files.items()]:
            done.result()
    (folder / f"{MANIFEST}.tmp").write_bytes(manifest_bytes)
    os.replace(folder / f"{MANIFEST}.tmp", folder / MANIFEST)


def _fetch(fs, path: str, name: str, entry: dict, folder: Path, where: str) -> None:
    """One file into `folder`, matching its manifest entry. A stream can end early without an error (an S3
    response cut short: shutil.copyfileobj took that for the whole file, and the copy was committed): where
    the store holds the listed size, a short copy is fetched once more, then it is the store's failure
    (OSError), as RemoteShards treats a short ranged read; where the store's file itself differs, the
    checkpoint is damaged."""
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    size = entry.get("size")
    for _ in range(2):
        got, sha256 = _copy(fs, f"{path}/{name}", folder / name, f"checkpoint {where}", name)
        if (got, sha256) == (size, entry.get("sha256")):
            return
        if got == size or fs.get_file_info(f"{path}/{name}").size != size:
            raise CheckpointError(f"checkpoint {where}: {name} does not match its manifest (size or sha256; "
                                  f"{got} bytes, {size} listed)")
    raise OSError(f"checkpoint {where}: {name}: {got} of its {size} bytes came back, twice (a download cut short)")


def _copy(fs, source: str, target: Path, where: str, name: str) -> tuple[int, str]:
    """Copy `source` on `fs` to the local `target`; returns the (size, sha256) of what arrived. Missing, it is a
    CheckpointError naming `where` (what the file belongs to: "checkpoint PATH", a config key and its URI) and
    `name`."""
    digest, size = hashlib.sha256(), 0
    try:
        with fs.open_input_stream(source) as src, open(target, "wb") as dst:
            for piece in iter(lambda: src.read(8 << 20), b""):
                digest.update(piece)
                dst.write(piece)
                size += len(piece)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: {name} is missing") from None
    return size, digest.hexdigest()


def _remove_if_unused(folder: Path) -> None:
    """Remove a copy no process holds (called under the parent folder's lock, so nobody is taking it)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # in use
    finally:
        os.close(fd)
    _remove(folder)


def _remove(folder: Path) -> None:
    """The manifest first: a removal cut short leaves no copy that looks complete."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        (folder / MANIFEST).unlink()
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _locked(folder: Path):
    """flock on the folder itself (no lock file to leave behind); released when the descriptor closes, also if
    this process dies."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
