"""A sharded (DCP) checkpoint's index, read without running code from it.

torch.distributed.checkpoint keeps its index, state/.metadata, as a pickle. Here it is read by a restricted
unpickler that knows DCP's metadata classes, torch's sizes, dtypes and layouts, a path and plain containers,
nothing else, and builds nothing much larger than the file (an index larger than the shard files it indexes is
not read); then checked: every piece it places lies within a shard file the manifest lists, its tensors fit in
those files' bytes, and (in the current format) it declares no non-tensor entry. storage/shard_reader.py reads
the shards through it.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import ClassVar

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from behemoth.errors import CheckpointError
from behemoth.storage.checkpoint import LEGACY_SHARDED_FORMAT, STATE_DIR, VALUES_FILE, is_shard_file

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
