"""Reading a sharded checkpoint (shared floor) without running code from it.

torch.distributed.checkpoint (DCP) keeps its index, state/.metadata, as a pickle, and loads a non-tensor entry
with torch.load(weights_only=False): as DCP ships, loading a checkpoint runs whatever the folder's files say.
The manifest's sha256 proves the files are whole, not who wrote them. Here:

- the index is read by a restricted unpickler that knows DCP's metadata classes, torch's sizes, dtypes and
  layouts, a path and plain containers, nothing else, and builds nothing much larger than the file (an index
  larger than the shard files it indexes is not read); then checked: every piece it places lies within a
  shard file the manifest lists, its tensors fit in those files' bytes, and (in the current format) it
  declares no non-tensor entry;
- no non-tensor state goes through DCP: the optimizer's settings (param_groups: lr, betas, ...) are written
  as JSON beside it (state_values.json, by DCP's key). A format-2 checkpoint, written before, holds them as
  DCP byte entries: those load with weights_only=True (plain values only), never unpickled freely.

Writing the shards stays in behemoth.worker.sharded; this module is what every reader goes through: a resume
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
import pathlib
import pickle
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import ClassVar

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
from behemoth.storage.filesystem import read_file

INDEX_FILE = f"{STATE_DIR}/.metadata"

# What DCP's index may name (the classes DCP 2.x pickles into it): anything else would be a call into other code.
# None of them allocates from a number in the file (as bytearray(n) would: refused, with set and frozenset, which
# DCP's index never names), and the unpickler charges what a call copies (_IndexUnpickler.charge), item by item:
_INDEX_CLASSES = {
    # DCP's dataclasses: built by NEWOBJ (object.__new__, no argument used) and BUILD (fields set from a pickled
    # dict; TensorProperties.__setstate__ unpacks a 5-tuple); called, each only stores its arguments, but
    # MetadataIndex, which copies its offset into a torch.Size. The enum looks a value up among its 3 members.
    **{("torch.distributed.checkpoint.metadata", c.__name__): c for c in (
        dcp_metadata.Metadata, dcp_metadata.StorageMeta, dcp_metadata.MetadataIndex,
        dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties, dcp_metadata._MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,  # as above
    ("torch", "Size"): torch.Size,  # a tuple of the pickled ints: as long as the pickled sequence
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a layout by name, from a table
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # the writer's checkpoint id, parsed from the pickled strings
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    # dtypes pickle as attributes of torch (torch.float32): objects, never called (a dtype is not callable);
    # vars(), not getattr: no lazy import is triggered
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}
_INDEX_OBJECTS = {id(value) for value in _INDEX_CLASSES.values()}
_SIZED = (str, bytes, tuple, list, dict, set, frozenset)
# The index beyond one entry per stored piece of a tensor: DCP's Metadata and StorageMeta, a few hundred bytes
_INDEX_HEADER_BYTES = 4096


class _IndexUnpickler(pickle._Unpickler):
    """DCP's index unpickled with only _INDEX_CLASSES, building nothing much larger than the file: Python's own
    unpickler over the file's bytes in memory (CPython's C one sizes its memo array from an index in the file:
    9 bytes of LONG_BINPUT 2**31 fill 32 GiB; a length in the file reads at most what is there), and no object
    but a string or one of the allowed names used twice (DCP's index never shares another): a list shared by
    many calls, or a tuple holding its inner one twice, would build or hash far more than the file holds."""

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.budget = len(data)  # what the calls and BUILDs may copy in all (a genuine index: well under it)

    def find_class(self, module: str, name: str):
        found = _INDEX_CLASSES.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's index never holds (refused, "
                                         f"not loaded: a checkpoint's files may not run code)")
        return found

    def shared(self) -> None:
        """The object on the stack was fetched from the memo (or duplicated): only an immutable name."""
        obj = self.stack[-1]
        if not _is_name(obj):
            raise pickle.UnpicklingError(f"it uses one {type(obj).__name__} in two places, which DCP's index never "
                                         f"does (refused: a shared object lets a small file build a large one)")

    def build(self) -> None:
        """Before BUILD: its target is an object this file made (BUILD sets attributes: on a class, an enum
        member or a dtype they would outlast this load), and its state is charged."""
        if _is_name(self.stack[-2]) or isinstance(self.stack[-2], type):
            raise pickle.UnpicklingError(f"it sets attributes of {type(self.stack[-2]).__name__} "
                                         f"{self.stack[-2]!r}, which DCP's index never does (refused)")
        self.charge(self.stack[-1])

    @staticmethod
    def keys(keys: list) -> None:
        """Before SETITEM(S): DCP's index keys its dicts by name (a string, whose hash Python salts per process)
        or by MetadataIndex (a name with offsets). Other keys are refused: ints, say, can all be made to hash
        alike, and a dict of n of them takes n**2 steps to build (an hour from a 13 MB file)."""
        for key in keys:
            if not (type(key) is str or (type(key) is dcp_metadata.MetadataIndex and type(key.fqn) is str)):
                raise pickle.UnpicklingError(f"it keys a dict by {type(key).__name__}, which DCP's index never "
                                             f"does (refused: keys that hash alike take quadratic time)")

    def charge(self, *arguments) -> None:
        """Before a call or BUILD: the items or characters it may copy from its `arguments` (and their items)."""
        for x in arguments:
            self.budget -= len(x) if isinstance(x, _SIZED) else 1
            if type(x) is tuple:
                self.budget -= sum(len(item) for item in x if isinstance(item, _SIZED))
        if self.budget < 0:
            raise pickle.UnpicklingError("it builds more than its own size in objects (refused)")


def _is_name(obj) -> bool:
    """A string, or an object of the allow-list's (a class, a dtype, a layout, an enum member): what the index may
    use in several places."""
    return (type(obj) is str or id(obj) in _INDEX_OBJECTS
            or isinstance(obj, (torch.dtype, torch.layout, dcp_metadata._MEM_FORMAT_ENCODING)))


def _refused(what: str):
    def load(self):
        raise pickle.UnpicklingError(f"it holds {what}, which DCP's index never does (refused)")
    return load


def _checked(opcode: bytes, check):
    """The unpickler's handler of `opcode`, with `check(unpickler)` run before it (or after, for a memo get)."""
    load = pickle._Unpickler.dispatch[opcode[0]]
    after = opcode in (pickle.GET, pickle.BINGET, pickle.LONG_BINGET, pickle.DUP)

    def checked(self):
        if not after:
            check(self)
        load(self)
        if after:
            check(self)
    return checked


for _opcode, _check in ((pickle.GET, _IndexUnpickler.shared), (pickle.BINGET, _IndexUnpickler.shared),
                        (pickle.LONG_BINGET, _IndexUnpickler.shared), (pickle.DUP, _IndexUnpickler.shared),
                        (pickle.REDUCE, lambda u: u.charge(u.stack[-1])),
                        (pickle.NEWOBJ, lambda u: u.charge(u.stack[-1])),
                        (pickle.NEWOBJ_EX, lambda u: u.charge(u.stack[-1], u.stack[-2])),
                        (pickle.BUILD, _IndexUnpickler.build)):
    _IndexUnpickler.dispatch[_opcode[0]] = _checked(_opcode, _check)
_SETITEM, _SETITEMS = pickle._Unpickler.dispatch[pickle.SETITEM[0]], pickle._Unpickler.dispatch[pickle.SETITEMS[0]]


def _checked_setitem(self):
    self.keys(self.stack[-2:-1])  # (the stack: ..., dict, key, value)
    _SETITEM(self)


def _checked_setitems(self):
    self.keys(self.stack[::2])  # (the items since the MARK, key, value, ...: the dict is under the mark)
    _SETITEMS(self)


def _small_long(self):
    """LONG1: an int of at most 8 bytes (DCP's sizes and offsets); larger ones make every use costly."""
    n = self.read(1)[0]
    if n > 8:
        raise pickle.UnpicklingError(f"it holds an int of {n} bytes, which DCP's index never does (refused)")
    self.append(pickle.decode_long(self.read(n)))


def _short_text_int(self):
    """Protocol 0's INT and LONG: decimal text, at most 20 digits (longer ones parse in quadratic time)."""
    data = self.readline()
    if len(data) > 22:
        raise pickle.UnpicklingError(f"it holds an int of {len(data) - 1} digits, which DCP's index never does "
                                     f"(refused)")
    text = data[:-1].rstrip(b"L")
    self.append({b"00": False, b"01": True}.get(text) if text in (b"00", b"01") else int(text, 0))


_IndexUnpickler.dispatch[pickle.SETITEM[0]] = _checked_setitem
_IndexUnpickler.dispatch[pickle.SETITEMS[0]] = _checked_setitems
_IndexUnpickler.dispatch[pickle.LONG1[0]] = _small_long
_IndexUnpickler.dispatch[pickle.INT[0]] = _IndexUnpickler.dispatch[pickle.LONG[0]] = _short_text_int
# DCP writes none of these: bytearray(n) fills n bytes from a length in the file; INST and OBJ (protocols 0 and
# 1) call a class with arguments uncharged; EXT1/2/4 take objects from copyreg's cache, past find_class; LONG4
# is an int of any length
_IndexUnpickler.dispatch[pickle.BYTEARRAY8[0]] = _refused("a bytearray")
for _name in ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "LONG4"):
    _IndexUnpickler.dispatch[getattr(pickle, _name)[0]] = _refused(f"an {_name} opcode")


def read_index(directory: str | Path, manifest: dict, name: str | None = None) -> dcp_metadata.Metadata:
    """A sharded checkpoint's DCP index, unpickled with only DCP's metadata classes allowed and checked against
    the manifest (`directory`'s, already read and verified by the caller): its size, the shard files it names
    and the bytes it places in them. `name`: the checkpoint's in messages (where `directory` is a local copy of
    its small files)."""
    d = Path(directory)
    where = f"checkpoint {name or d}: {INDEX_FILE}"
    shard_sizes = {entry_name[len(STATE_DIR) + 1:]: entry.get("size")
                   for entry_name, entry in manifest["files"].items()
                   if is_shard_file(entry_name) and isinstance(entry, dict) and type(entry.get("size")) is int}
    index = _unpickle_index(d / INDEX_FILE, sum(shard_sizes.values()), where)
    if not (isinstance(index, dcp_metadata.Metadata) and isinstance(index.state_dict_metadata, dict)
            and isinstance(index.storage_data, dict)
            and isinstance(index.storage_meta, (dcp_metadata.StorageMeta, type(None)))):
        raise CheckpointError(f"{where} is not DCP's index of the shards (it holds a {type(index).__name__})")
    legacy = manifest["format_version"] == LEGACY_SHARDED_FORMAT
    for key, meta in index.state_dict_metadata.items():
        if isinstance(meta, dcp_metadata.BytesStorageMetadata) and not legacy:
            raise CheckpointError(f"{where} declares {key} as non-tensor data: this format keeps none in the "
                                  f"shards (they are in {VALUES_FILE})")
    _check_storage(index, shard_sizes, where)
    _check_tensors(index, sum(shard_sizes.values()), where)
    return index


def _unpickle_index(path: Path, shard_bytes: int, where: str):
    """The index file unpickled (_IndexUnpickler), refused unread where it is larger than the shard files it
    indexes could need: DCP's index holds about a hundred bytes per stored piece of a tensor, and each piece
    takes a kilobyte or more in its shard file (torch.save's archive)."""
    size = path.stat().st_size
    if size > shard_bytes + _INDEX_HEADER_BYTES:
        raise CheckpointError(f"{where} is {size} bytes, more than the shard files it indexes ({shard_bytes} "
                              f"bytes) could need: refused, not read")
    try:
        return _IndexUnpickler(path.read_bytes()).load()
    except Exception as e:  # noqa: BLE001 - any failure to parse it: nothing but the allowed classes ran
        raise CheckpointError(f"{where} is not DCP's index of the shards: {e}") from None


def _check_storage(index: dcp_metadata.Metadata, shard_sizes: dict, where: str) -> None:
    """Every stored piece lies in a shard file the manifest lists, within its size, and the pieces placed in a
    file fit it (so the index has at most one entry per byte of the shards)."""
    placed = dict.fromkeys(shard_sizes, 0)
    for info in index.storage_data.values():
        name = getattr(info, "relative_path", None)
        # DCP opens state/<name>: only a shard file of this folder that the manifest vouches for
        if not isinstance(info, dcp_filesystem._StorageInfo) or not isinstance(name, str) or name not in placed:
            raise CheckpointError(f"{where} names {name}, which is not a shard file its manifest lists")
        if getattr(info, "transform_descriptors", None):  # behemoth writes none: DCP would decompress into memory
            raise CheckpointError(f"{where} asks for transforms of its stored bytes "
                                  f"({info.transform_descriptors!r}), which behemoth never writes: refused")
        offset, length, size = info.offset, info.length, shard_sizes[name]
        if not (type(offset) is int and type(length) is int and offset >= 0 and 0 < length <= size - offset):
            raise CheckpointError(f"{where} places {length!r} bytes at {offset!r} of {name} beyond its {size} bytes")
        placed[name] += length
    for name, total in placed.items():
        if total > shard_sizes[name]:
            raise CheckpointError(f"{where} places {total} bytes in {name}, more than its {shard_sizes[name]}")


def _check_tensors(index: dcp_metadata.Metadata, shard_bytes: int, where: str) -> None:
    """Every tensor has a valid shape and dtype, and all of them fit the shard files' bytes (an export allocates
    each model tensor from its declared size; DCP stores each tensor's bytes once), with no more entries or
    chunks than stored pieces."""
    tensors = [(key, meta) for key, meta in index.state_dict_metadata.items()
               if not isinstance(meta, dcp_metadata.BytesStorageMetadata)]
    claimed = chunks = 0
    for key, meta in tensors:
        size, dtype = getattr(meta, "size", None), getattr(getattr(meta, "properties", None), "dtype", None)
        if not (isinstance(meta, dcp_metadata.TensorStorageMetadata) and isinstance(size, tuple)
                and all(type(n) is int and n >= 0 for n in size) and isinstance(dtype, torch.dtype)
                and isinstance(meta.chunks, list)):
            raise CheckpointError(f"{where} gives {key} no valid shape, dtype and chunks")
        claimed += _elements(size, shard_bytes) * dtype.itemsize
        chunks += len(meta.chunks)
        if claimed > shard_bytes:
            break
    if claimed > shard_bytes:
        raise CheckpointError(f"{where} declares tensors of {claimed} bytes in all, more than its shard files hold "
                              f"({shard_bytes} bytes)")
    if max(chunks, len(index.state_dict_metadata)) > len(index.storage_data):
        raise CheckpointError(f"{where} declares more entries or chunks than it stores pieces")


def _elements(size: tuple, bound: int) -> int:
    """The element count of a shape, multiplied up only while it stays within `bound` (else bound + 1): a shape
    of huge dimensions costs no huge products."""
    if 0 in size:
        return 0
    count = 1
    for n in size:
        count *= n
        if count > bound:
            return bound + 1
    return count


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
