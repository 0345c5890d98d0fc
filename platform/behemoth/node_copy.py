"""A checkpoint in an object store as a local folder the processes of one node share (shared floor).

The ranks of a node that restore the same checkpoint whole (a full checkpoint: under DDP every rank reads all
of it) download it once: the first to open it downloads every file its manifest lists (the manifest last) into
a folder named by the checkpoint and its manifest's bytes, the others wait for that under the same lock and
read the same files, and the last one to close removes it. Each user of the folder leaves a mark named by its
process id; a process that died holding the folder leaves a mark the next closer finds dead, so the folder
still goes. The folders live in one folder of the node's temp folder that is this user's alone (0700, not a
link); where it is not, each process downloads into a temporary folder of its own, as Ray's download did.
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
from pathlib import Path

from behemoth.checkpoint import MANIFEST, read_file, read_manifest
from behemoth.errors import CheckpointError


@contextlib.contextmanager
def node_copy(fs, path: str, where: str) -> Iterator[Path]:
    """The checkpoint at `path` on the pyarrow filesystem `fs` (`where` names it in messages) as a local
    folder while the block runs; the caller verifies the files (a copy is only as good as the download)."""
    try:
        manifest_bytes = read_file(f"{path}/{MANIFEST}", fs)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {where} has no {MANIFEST}: it was not completely written") from None
    names = list(read_manifest(manifest_bytes, where)["files"])
    parent = own_temp_folder("behemoth-checkpoints")
    if parent is None:
        with tempfile.TemporaryDirectory(prefix="behemoth-checkpoint-") as d:
            _download(fs, path, names, manifest_bytes, Path(d), where)
            yield Path(d)
        return
    folder = parent / hashlib.sha256(path.encode() + b"\n" + manifest_bytes).hexdigest()[:32]
    mark = folder / f".user-{os.getpid()}"
    with _locked(parent):
        if not (folder / MANIFEST).is_file():  # absent, or a download cut short
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(mode=0o700)
            _download(fs, path, names, manifest_bytes, folder, where)
        mark.touch()
    try:
        yield folder
    finally:
        with _locked(parent):
            mark.unlink(missing_ok=True)
            if not any(_alive(m) for m in folder.glob(".user-*")):
                shutil.rmtree(folder, ignore_errors=True)


def _download(fs, path: str, names: list[str], manifest_bytes: bytes, folder: Path, where: str) -> None:
    """Every file the manifest lists, then the manifest (its presence: the copy is complete). A file the store
    does not have is the checkpoint's fault (CheckpointError); any other error is the store's (the worker fails
    and Ray retries, as with a failed download before)."""
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            with fs.open_input_stream(f"{path}/{name}") as src, open(folder / name, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {where}: {name} is missing") from None
    (folder / MANIFEST).write_bytes(manifest_bytes)


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


def _alive(mark: Path) -> bool:
    """Whether the process a user mark names still runs."""
    try:
        os.kill(int(mark.name.rsplit("-", 1)[1]), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True  # not a process id of ours to judge: keep the folder
    return True
