"""Reading a sharded checkpoint without running code from it.

torch.distributed.checkpoint (DCP) keeps its index, state/.metadata, as a pickle, and loads a non-tensor entry
with torch.load(weights_only=False): as DCP ships, loading a checkpoint runs whatever the folder's files say.
The manifest's sha256 proves the files are whole, not who wrote them. Here:

- the index is read by a restricted unpickler and checked against the shard files (storage/dcp_index.py);
- no non-tensor state goes through DCP: the optimizer's settings (param_groups: lr, betas, ...) are written
  as JSON beside it (state_values.json, by DCP's key). A format-2 checkpoint, written before, holds them as
  DCP byte entries: those load with weights_only=True (plain values only), never unpickled freely.

Writing the shards stays in behemoth.checkpoints.sharded; this module is what every reader goes through: a resume
(sharded.load), and export, evaluation and fine-tuning (read_sharded_weights).

A checkpoint in an object store is read where it is (RemoteShards): its small files are fetched, but of the
shard files only the pieces that this reader's DCP load plan asks for (a rank's own slices of the tensors; an
export's model entries), by ranged reads of whole CHUNK_BYTES chunks, each checked against the manifest's
sha256 for it before any of its bytes is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import warnings
from collections import OrderedDict
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from behemoth.errors import CheckpointError
from behemoth.storage.checkpoint import (LEGACY_SHARDED_FORMAT, MANIFEST, SHARDED_FORMATS, SINGLE_PROCESS_WARNING,
                                         STATE_DIR, VALUES_FILE, has_chunk_hashes, is_shard_file, read_manifest,
                                         read_manifest_bytes)
from behemoth.storage.dcp_index import INDEX_FILE, read_index
from behemoth.storage.filesystem import read_file

class RemoteShards:
    """The shard files of a sharded checkpoint on a pyarrow filesystem (`path` on `fs`; `where` names it in
    messages), read by range. `fetched`: the bytes read from the store so far, small files included."""

    def __init__(self, fs, path: str, manifest_bytes: bytes, where: str):
        self.fs, self.path, self.where = fs, path, where
        self.manifest_bytes = manifest_bytes
        self.manifest = read_manifest(manifest_bytes, where)
        self.fetched = len(manifest_bytes)

    @property
    def total(self) -> int:
        """The bytes of every file of the checkpoint, as its manifest lists them."""
        return sum(entry["size"] for entry in self.manifest["files"].values())

    def download_rest(self, target: str | Path, only: tuple[str, ...] | None = None) -> None:
        """The manifest and the checkpoint's files other than the shard files (or those of them in `only`)
        into the local folder `target`, where the caller verifies them."""
        Path(target, MANIFEST).write_bytes(self.manifest_bytes)
        for name in self.manifest["files"]:
            if is_shard_file(name) or (only is not None and name not in only):
                continue
            Path(target, name).parent.mkdir(parents=True, exist_ok=True)
            try:  # another error (the store unreachable) is the worker's, as a download's was: Ray retries it
                data = read_file(f"{self.path}/{name}", self.fs)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {self.where}: {name} is missing") from None
            self.fetched += len(data)
            Path(target, name).write_bytes(data)

    @contextlib.contextmanager
    def open(self, name: str):
        """A shard file (`name` relative to state/) as a seekable stream of checked bytes."""
        f = _CheckedRanges(self, name)
        try:
            yield f
        finally:
            f.close()


def remote_shards(fs, path: str, where: str, manifest_bytes: bytes | None = None) -> RemoteShards | None:
    """RemoteShards for the checkpoint at `path` on `fs` (its manifest's bytes read here unless given), or None
    where it is not sharded or its manifest has no chunk hashes for its shard files (written before they were
    recorded: read whole, as before)."""
    text = manifest_bytes if manifest_bytes is not None else read_manifest_bytes(path, fs, where)
    shards = RemoteShards(fs, path, text, where)
    names = [name for name in shards.manifest["files"] if is_shard_file(name)]
    if shards.manifest["format_version"] not in SHARDED_FORMATS or not has_chunk_hashes(shards.manifest, names):
        return None
    return shards


class _CheckedRanges(io.RawIOBase):
    """One shard file read by range: the chunks around what is read are fetched (one ranged read per run of
    missing chunks) and each checked against its sha256 in the manifest. The chunks of the tensor being read
    stay until the next one's are fetched; of the others the last few used, since the next tensor (DCP's
    reads go in file order) often starts in the chunk the previous one ended in."""

    KEPT = 4

    def __init__(self, shards: RemoteShards, name: str):
        super().__init__()
        self.file, self.pos, self.kept = None, 0, OrderedDict()  # kept: chunk index -> its checked bytes
        self.shards, self.name = shards, f"{STATE_DIR}/{name}"
        entry = shards.manifest["files"].get(self.name)
        if entry is None:
            raise CheckpointError(f"{self.name} is not in its {MANIFEST}")
        self.size, self.chunk, self.hashes = entry["size"], entry["chunk_bytes"], entry["chunks"]
        try:
            self.file = shards.fs.open_input_file(f"{shards.path}/{self.name}")
        except FileNotFoundError:
            raise CheckpointError(f"{self.name} is missing") from None
        size = self.file.size()
        if size != self.size or len(self.hashes) != -(-size // self.chunk):
            self.close()
            raise CheckpointError(f"{self.name} does not match its manifest (size {size}, manifest {self.size}, "
                                  f"{len(self.hashes)} chunk hashes)")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def fetch(self, start: int, end: int, hold: bool = False) -> None:
        """Have the chunks holding bytes [start, end) fetched and checked. `hold`: they are what the next
        reads need (a tensor's bytes: torch.load reads its end first, then from its start), so they stay until
        the next hold; of the others only the last few used."""
        if end <= start:
            return
        needed = range(start // self.chunk, (min(end, self.size) - 1) // self.chunk + 1)
        if hold:
            others = [i for i in self.kept if i not in needed]
            for i in others[:max(0, len(others) - self.KEPT)]:
                del self.kept[i]
            for i in others[-self.KEPT:]:  # a slice of a larger read keeps that whole buffer alive: copied once
                if len(self.kept[i].obj) != len(self.kept[i]):
                    self.kept[i] = memoryview(bytes(self.kept[i]))
        missing = [i for i in needed if i not in self.kept]
        while missing:
            run = 1
            while run < len(missing) and missing[run] == missing[0] + run:
                run += 1
            first, missing = missing[0], missing[run:]
            offset = first * self.chunk
            want = min(self.size, offset + run * self.chunk) - offset
            data = memoryview(self.file.read_at(want, offset))
            if len(data) != want:  # a response cut short (S3's read returns what came): once more, then an I/O error
                data = memoryview(self.file.read_at(want, offset))
                if len(data) != want:
                    raise OSError(f"{self.name}: {len(data)} of {want} bytes came back from offset {offset}")
            self.shards.fetched += len(data)
            for k in range(run):
                piece = data[k * self.chunk:(k + 1) * self.chunk]
                if hashlib.sha256(piece).hexdigest() != self.hashes[first + k]:
                    at = (first + k) * self.chunk
                    raise CheckpointError(f"{self.name} does not match its manifest (the sha256 of its bytes "
                                          f"{at}-{at + len(piece)} differs)")
                self.kept[first + k] = piece

    def readinto(self, b) -> int:
        out, done = memoryview(b).cast("B"), 0
        n = max(0, min(len(out), self.size - self.pos))
        self.fetch(self.pos, self.pos + n)
        while done < n:
            index, within = divmod(self.pos, self.chunk)
            piece = self.kept[index]
            self.kept.move_to_end(index)
            k = min(n - done, len(piece) - within)
            out[done:done + k] = piece[within:within + k]
            done, self.pos = done + k, self.pos + k
        return n

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.kept.clear()
        super().close()


class _RemoteStreams(dcp_filesystem.FileSystemBase):
    """What DCP's FileSystemReader opens its files through, for RemoteShards: a shard file by its name."""

    def __init__(self, shards: RemoteShards):
        self.shards = shards

    def create_stream(self, path, mode):
        return self.shards.open(str(path))

    def concat_path(self, path, suffix):
        return suffix  # the reader's path is the state/ folder; files are named relative to it

    def init_path(self, path):
        return path

    def rename(self, path, new_path):
        raise io.UnsupportedOperation("shard files read by range are read only")

    def mkdir(self, path):
        raise io.UnsupportedOperation("shard files read by range are read only")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def exists(self, path) -> bool:
        return f"{STATE_DIR}/{path}" in self.shards.manifest["files"]

    def rm_file(self, path):
        raise io.UnsupportedOperation("shard files read by range are read only")


class _IndexedReader(FileSystemReader):
    """DCP's file reader, given the index read_index has read: DCP's own read_metadata would pickle.load it
    (and, failing, fall back to per-rank index files). With `remote`, the shard files are read by range where
    they are, each tensor's bytes fetched (whole checked chunks) as DCP comes to it."""

    def __init__(self, path: Path, index: dcp_metadata.Metadata, remote: RemoteShards | None = None):
        super().__init__(path)
        self.index, self.remote = index, remote
        if remote is not None:
            self.fs = _RemoteStreams(remote)

    def read_data(self, plan, planner):
        if self.remote is not None:  # in file order: each chunk is fetched once, the last one kept for the next
            where = {r.storage_index: self.storage_data[r.storage_index] for r in plan.items}
            plan = dataclasses.replace(plan, items=sorted(plan.items, key=lambda r: (
                where[r.storage_index].relative_path, where[r.storage_index].offset)))
        return super().read_data(plan, planner)

    def _slice_file(self, file, sinfo):
        if self.remote is not None:  # the whole tensor's bytes in one ranged read, not torch.load's small reads
            file.fetch(sinfo.offset, sinfo.offset + sinfo.length, hold=True)
        return super()._slice_file(file, sinfo)

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if self.index.storage_meta is None:
            self.index.storage_meta = dcp_metadata.StorageMeta()
        self.index.storage_meta.load_id = self.load_id
        return self.index


class _PlainBytesPlanner(DefaultLoadPlanner):
    """DCP's planner, but a non-tensor entry (only a format-2 checkpoint has them) loads with weights_only."""

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:  # weights_only refuses anything but tensors and plain values, naming it
            raise CheckpointError(f"{fqn} in the shards is not plain data, refused: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def split_state(state: dict) -> tuple[dict, dict, dict]:
    """DCP's flat view of a nested state dict: (its tensors by DCP key, its other values by key, key -> path
    in `state`). The keys are those DCP itself gives a nested state dict."""
    flat, paths = flatten_state_dict(state)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in flat.items() if k not in tensors}, paths


def values_text(values: dict) -> str:
    """The non-tensor entries of a state dict as JSON (state_values.json); one that is not plain data (numbers,
    strings, booleans, None, lists, tuples, dicts) is an error naming it."""
    for key, value in values.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"a sharded checkpoint keeps the state's non-tensor entries as JSON: {key} is a "
                                  f"{type(value).__name__}") from None
    return json.dumps(values, indent=1)


def load_shards(directory: str | Path, manifest: dict, target: dict, no_dist: bool,
                index: dcp_metadata.Metadata | None = None, remote: RemoteShards | None = None) -> None:
    """Load a sharded checkpoint into `target` (a nested state dict; every rank calls this unless `no_dist`):
    its tensors in place through DCP (resharded to this world size), its other values from state_values.json
    (a format-2 checkpoint's from DCP, weights_only); a tuple stays a tuple where the target has one.
    `index`: read_index's, when the caller has read it already. `remote`: the shard files are read there, by
    range (`directory` holds the other files)."""
    import torch.distributed.checkpoint as dcp

    d = Path(directory)
    where = remote.where if remote is not None else d
    index = index if index is not None else read_index(d, manifest, str(where))
    tensors, values, paths = split_state(target)
    legacy = manifest["format_version"] == LEGACY_SHARDED_FORMAT
    flat = {**tensors, **values} if legacy else tensors
    with warnings.catch_warnings():  # "no process group: loading in a single process" is what no_dist means
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        try:
            dcp.load(flat, storage_reader=_IndexedReader(d / STATE_DIR, index, remote),
                     planner=_PlainBytesPlanner(), no_dist=no_dist)
        except CheckpointException as e:  # every rank sees every rank's failures: all raise the same
            ours = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
            refused = next((f for f in ours if isinstance(f, CheckpointError)), None)
            if refused is not None:
                raise CheckpointError(f"checkpoint {where}: {refused}") from None
            failed_io = next((f for f in ours if isinstance(f, OSError)), None)
            if failed_io is not None:  # the store, not the checkpoint: the worker fails and Ray retries it
                raise OSError(f"checkpoint {where}: reading its shards failed: {failed_io}") from e
            # DCP's CheckpointException is a BaseException, which `except Exception` would miss
            raise CheckpointError(f"checkpoint {where}: reading its shards failed: {ours[0]!r}") from e
    saved = flat if legacy else _read_values(d, manifest) if values else {}
    for key, live in values.items():
        if key not in saved:
            raise CheckpointError(f"checkpoint {where}: {VALUES_FILE} has no {key}, which this run's state has")
        value = saved[key]
        set_element(target, paths[key], tuple(value) if isinstance(live, tuple) and isinstance(value, list)
                    else value)


def _read_values(d: Path, manifest: dict) -> dict:
    if VALUES_FILE not in manifest["files"]:
        raise CheckpointError(f"checkpoint {d}: {VALUES_FILE} is not in its manifest")
    try:
        values = json.loads((d / VALUES_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {d}: {VALUES_FILE} is unreadable ({e})") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"checkpoint {d}: {VALUES_FILE} is not a JSON object")
    return values


def read_sharded_weights(directory: str | Path, remote: RemoteShards | None = None) -> dict:
    """A sharded checkpoint's model weights as one state dict of whole tensors, read by this process alone (no
    collective, even inside a process group: export, evaluation, fine-tuning on one rank): only the model's
    entries, whose shapes and dtypes the checkpoint's index gives. The caller has verified the files (with
    `remote`, those in `directory`: the shard files are read by range, the model's bytes only, and checked)."""
    d = Path(directory)
    manifest = read_manifest((d / MANIFEST).read_bytes(), d)
    index = read_index(d, manifest, remote.where if remote is not None else None)
    target = {}
    for key, meta in index.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, dcp_metadata.TensorStorageMetadata):
            try:
                target[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            except (TypeError, RuntimeError, AttributeError) as e:
                raise CheckpointError(f"checkpoint {d}: {INDEX_FILE} gives {key} no valid shape and dtype "
                                      f"({e})") from None
    load_shards(d, manifest, target, no_dist=True, index=index, remote=remote)
    return {key[len("model."):]: value for key, value in target.items()}
