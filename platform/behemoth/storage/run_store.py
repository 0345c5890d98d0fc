"""RunStore: where a run's checkpoints live, decided once, and every checkpoint listed, written, opened and deleted
through it.

A run folder is on a local file system (a disk, or a mount every node shares) or in an object store. The
difference shapes every checkpoint operation, and is asked here only, once, when the store is made:
- **writing**: on a file system a checkpoint's files go straight into its folder in the run folder, manifest
  last (it needs its size on disk once, not twice); an object store needs local files to upload, so they are
  staged in a local folder and uploaded manifest last (`CheckpointWrite`);
- **claiming a name**: a file system's `mkdir` is atomic, so of several writers racing for one checkpoint name
  one wins (the rescue's live workers); an object store has no such operation (`claim` says so);
- **opening**: a file system's checkpoint is read where it lies; an object store's is read by range (a sharded
  one whose manifest has chunk hashes) or copied once per node (`opened`);
- **listing and deleting**: the complete checkpoints (manifest written) and the removal of one, the same verbs
  for both.

The checkpoints room (saver, rescue, live_state, retention) and a sweep lane's host (hosts/lane.py) hold a
RunStore made from their run's place and never ask which kind of place it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from behemoth.storage import filesystem
from behemoth.storage.store import Store


class RunStore:
    """A run folder's checkpoints: `RunStore(fs, path)` (a pyarrow filesystem and the run folder's path on it: a
    worker host's `storage()`) or `RunStore.at(folder)` (a local path or a URI: the driver's RunPlace.folder).
    Paths it lists come back as it was named: paths on `fs`, or under `folder` (URIs for a URI)."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, str(path)
        self._named = None  # the folder as the user named it (RunStore.at), for listings in the same form
        # the one question, asked once: files written in place and folders claimed by mkdir, or staged and uploaded
        self.in_place = Store(self.path, fs).is_local

    @classmethod
    def at(cls, folder: str | Path) -> RunStore:
        fs, path = filesystem.filesystem(folder)
        store = cls(fs, path)
        store._named = str(folder)
        return store

    @classmethod
    def of_checkpoint(cls, ckpt) -> RunStore:
        """The store of a host's checkpoint value (`.path`, `.filesystem`): its run folder."""
        return cls(ckpt.filesystem, ckpt.path.rstrip("/").rpartition("/")[0])

    def folder(self, name: str) -> str:
        """Checkpoint `name`'s folder in the run folder (a path on `fs`)."""
        return f"{self.path}/{name}"

    # ---- listing and deleting ----------------------------------------------------------------------------
    def complete(self, as_named: bool = True) -> list[tuple[int, str]]:
        """(step, path) of the run's complete checkpoints (manifest written), newest step first. `as_named`
        False: paths on `fs` (as a host's checkpoint values hold them) however the store was named."""
        from behemoth.storage.checkpoint import complete_checkpoints

        if self._named is not None and as_named:
            return complete_checkpoints(self._named)
        return complete_checkpoints(self.path, self.fs)

    def partial(self) -> list[str]:
        """The paths on `fs` of the run's checkpoint folders without a manifest (writes or uploads cut short)."""
        from behemoth.storage.checkpoint import checkpoint_folders

        return [path for path, complete in checkpoint_folders(self.path, self.fs) if not complete]

    def delete(self, path: str) -> None:
        """Remove a checkpoint's folder (a path as `complete` gives it, or a host checkpoint's `.path`)."""
        fs, where = filesystem.filesystem(path, None if filesystem.is_uri(path) else self.fs)
        fs.delete_dir(where)

    def put_folder(self, local_folder: str, name: str) -> str:
        """Copy a local folder's files in as checkpoint `name`; returns its folder (a path on `fs`)."""
        dest = self.folder(name)
        Store(dest, self.fs).put_folder(local_folder)
        return dest

    # ---- writing -----------------------------------------------------------------------------------------
    def writing(self, name: str, staging: str | None = None,
                before_manifest: Callable[[], None] = lambda: None) -> CheckpointWrite:
        """A checkpoint `name` to write: its files go to `CheckpointWrite.folder`. `staging`: an empty local
        folder the caller removes (a host's checkpoint folder), used where the files are staged; without one a
        staged write makes its own (removed by `clean`). `before_manifest`: called once every other file is at its
        place and the manifest is not (the failure tests' kill point: hosts/faults.py)."""
        return CheckpointWrite(self, name, staging, before_manifest)

    def claim(self, name: str) -> bool | None:
        """Take checkpoint `name` for this writer alone, by making its folder: True for the writer that made it,
        False where another writer has. None where the place cannot say (an object store has no atomic folder):
        the caller then keeps its writers' names apart itself."""
        if not self.in_place:
            return None
        try:
            os.makedirs(self.folder(name), exist_ok=False)
            return True
        except FileExistsError:
            return False

    def release(self, name: str) -> None:
        """Give back a claimed name whose checkpoint was not written (its empty folder removed)."""
        if self.in_place:
            os.rmdir(self.folder(name))

    # ---- opening -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def opened(self, path: str) -> Iterator[tuple[Path, object, bool]]:
        """The checkpoint at `path` (on `fs`) as (a local folder, its shards read where they are or None,
        whether the folder is a copy on this node). In place: the run folder's own (shared by every rank of a
        cluster). In an object store, a sharded checkpoint whose manifest has its shard files' chunk hashes: its
        small files in a temporary folder of this process, the shard files read by range
        (shard_reader.RemoteShards: each rank fetches only its plan's bytes); any other checkpoint (a full one,
        or sharded before chunk hashes): downloaded whole once per node, the node's ranks sharing the copy
        (node_copy)."""
        from behemoth.storage import shard_reader
        from behemoth.storage.checkpoint import read_manifest_bytes
        from behemoth.storage.node_copy import node_copy

        if self.in_place:
            yield Path(path), None, False
            return
        text = read_manifest_bytes(path, self.fs, path)
        remote = shard_reader.remote_shards(self.fs, path, path, text)
        if remote is None:
            with node_copy(self.fs, path, path, text) as d:
                yield d, None, True
            return
        with tempfile.TemporaryDirectory(prefix="behemoth-restore-") as d:
            remote.download_rest(d)
            yield Path(d), remote, True


class CheckpointWrite:
    """One checkpoint being written. Its files go to `folder`: the checkpoint's own folder in the run folder
    where the store writes in place, else a local staging folder whose files are uploaded (`upload`, or
    `finish` for a whole folder), the manifest last. `dest` is where the checkpoint ends up (a path on the
    store's filesystem)."""

    def __init__(self, store: RunStore, name: str, staging: str | None, before_manifest: Callable[[], None]):
        self.store, self.name, self.dest = store, name, store.folder(name)
        self._before_manifest = before_manifest
        self._own_staging = not store.in_place and staging is None
        if store.in_place:
            self.folder = self.dest
        else:
            self.folder = tempfile.mkdtemp(prefix="behemoth-stage-") if staging is None else staging

    def write(self, snap, after_file=None) -> None:
        """A snapshot's files into `folder`, the manifest last (`after_file(path)` after each state file); in
        place the before-manifest call comes here, staged it comes in `finish`."""
        from behemoth.storage.checkpoint import write

        write(self.folder, snap, before_manifest=self._before_manifest if self.store.in_place else None,
              after_file=after_file)

    @property
    def upload(self) -> Callable[[list[str]], None] | None:
        """Where the files are staged: a function that uploads the named files of `folder` to `dest`; None in
        place (nothing to upload)."""
        if self.store.in_place:
            return None

        def put(names: list[str]) -> None:
            for name in names:
                Store(f"{self.dest}/{name}", self.store.fs).put_file(os.path.join(self.folder, name))

        return put

    def finish(self, persist: Callable[[str, str], object], checkpoint_at: Callable[[str, object], object]):
        """The written checkpoint as the host's checkpoint value. In place: `checkpoint_at(dest, fs)`. Staged:
        `persist(folder, name)` (the host's upload of a folder) without the manifest, the before-manifest call,
        then the manifest: a copy cut short (the worker or node dies) leaves a folder without a manifest, which
        restore removes, never a manifest beside incomplete files."""
        from behemoth.storage.checkpoint import MANIFEST

        if self.store.in_place:
            return checkpoint_at(self.dest, self.store.fs)
        held = tempfile.mkdtemp(prefix="manifest-")
        try:
            shutil.move(os.path.join(self.folder, MANIFEST), held)
            persisted = persist(self.folder, self.name)
            self._before_manifest()
            Store(f"{persisted.path}/{MANIFEST}", persisted.filesystem).put_file(os.path.join(held, MANIFEST))
        finally:
            shutil.rmtree(held, ignore_errors=True)
        return persisted

    def clean(self) -> None:
        """Remove the staging folder this write made itself (none in place, nor a caller's)."""
        if self._own_staging:
            shutil.rmtree(self.folder, ignore_errors=True)

    def abandon(self) -> None:
        """Remove what this write wrote (its folder in the run folder, or the staged files): a write that failed
        (a full disk) leaves nothing; the run's other checkpoints are untouched."""
        shutil.rmtree(self.folder, ignore_errors=True)
