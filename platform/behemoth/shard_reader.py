"""Reading a sharded checkpoint (shared floor) without running code from it.

torch.distributed.checkpoint (DCP) keeps its index, state/.metadata, as a pickle, and loads a non-tensor entry
with torch.load(weights_only=False): as DCP ships, loading a checkpoint runs whatever the folder's files say.
The manifest's sha256 proves the files are whole, not who wrote them. Here:

- the index is read by a restricted unpickler that knows DCP's metadata classes, torch's sizes, dtypes and
  layouts, a path and plain containers, nothing else; then checked: every file it names is a shard file
  the manifest lists, and (in the current format) it declares no non-tensor entry;
- no non-tensor state goes through DCP: the optimizer's settings (param_groups: lr, betas, ...) are written
  as JSON beside it (state_values.json, by DCP's key). A format-2 checkpoint, written before, holds them as
  DCP byte entries: those load with weights_only=True (plain values only), never unpickled freely.

Writing the shards stays in behemoth.worker.sharded; this module is what every reader goes through: a resume
(sharded.load), and export, evaluation and fine-tuning (read_sharded_weights).
"""

from __future__ import annotations

import json
import pathlib
import pickle
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from behemoth.checkpoint import (LEGACY_SHARDED_FORMAT, MANIFEST, SINGLE_PROCESS_WARNING, STATE_DIR, VALUES_FILE,
                                 read_manifest)
from behemoth.errors import CheckpointError

INDEX_FILE = f"{STATE_DIR}/.metadata"

# What DCP's index may name (the classes DCP 2.x pickles into it): anything else would be a call into other code.
_INDEX_CLASSES = {
    **{("torch.distributed.checkpoint.metadata", c.__name__): c for c in (
        dcp_metadata.Metadata, dcp_metadata.StorageMeta, dcp_metadata.MetadataIndex,
        dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties, dcp_metadata._MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a layout by name, from a table
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # the writer's checkpoint id
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    **{("builtins", c.__name__): c for c in (set, frozenset, bytearray)},
    # dtypes pickle as attributes of torch (torch.float32); vars(), not getattr: no lazy import is triggered
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _INDEX_CLASSES.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's index never holds (refused, "
                                         f"not loaded: a checkpoint's files may not run code)")
        return found


def read_index(directory: str | Path, manifest: dict) -> dcp_metadata.Metadata:
    """A sharded checkpoint's DCP index, unpickled with only DCP's metadata classes allowed and checked against
    the manifest (`directory`'s, already read and verified by the caller)."""
    d = Path(directory)
    where = f"checkpoint {d}: {INDEX_FILE}"
    try:
        with open(d / INDEX_FILE, "rb") as f:
            index = _IndexUnpickler(f).load()
    except Exception as e:  # any failure to parse it: nothing but the allowed classes ran
        raise CheckpointError(f"{where} is not DCP's index of the shards: {e}") from None
    if not (isinstance(index, dcp_metadata.Metadata) and isinstance(index.state_dict_metadata, dict)
            and isinstance(index.storage_data, dict)
            and isinstance(index.storage_meta, (dcp_metadata.StorageMeta, type(None)))):
        raise CheckpointError(f"{where} is not DCP's index of the shards (it holds a {type(index).__name__})")
    legacy = manifest["format_version"] == LEGACY_SHARDED_FORMAT
    for key, meta in index.state_dict_metadata.items():
        if isinstance(meta, dcp_metadata.BytesStorageMetadata) and not legacy:
            raise CheckpointError(f"{where} declares {key} as non-tensor data: this format keeps none in the "
                                  f"shards (they are in {VALUES_FILE})")
    for info in index.storage_data.values():
        name = getattr(info, "relative_path", None)
        # DCP opens state/<name>: only a shard file of this folder that the manifest vouches for
        if (not isinstance(info, dcp_filesystem._StorageInfo) or not isinstance(name, str) or "/" in name
                or "\\" in name or f"{STATE_DIR}/{name}" not in manifest["files"]):
            raise CheckpointError(f"{where} names {name}, which is not a shard file its manifest lists")
    return index


class _IndexedReader(FileSystemReader):
    """DCP's file reader, given the index read_index has read: DCP's own read_metadata would pickle.load it
    (and, failing, fall back to per-rank index files)."""

    def __init__(self, path: Path, index: dcp_metadata.Metadata):
        super().__init__(path)
        self.index = index

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
                index: dcp_metadata.Metadata | None = None) -> None:
    """Load a sharded checkpoint into `target` (a nested state dict; every rank calls this unless `no_dist`):
    its tensors in place through DCP (resharded to this world size), its other values from state_values.json
    (a format-2 checkpoint's from DCP, weights_only); a tuple stays a tuple where the target has one.
    `index`: read_index's, when the caller has read it already."""
    import torch.distributed.checkpoint as dcp

    d = Path(directory)
    index = index if index is not None else read_index(d, manifest)
    tensors, values, paths = split_state(target)
    legacy = manifest["format_version"] == LEGACY_SHARDED_FORMAT
    flat = {**tensors, **values} if legacy else tensors
    with warnings.catch_warnings():  # "no process group: loading in a single process" is what no_dist means
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        try:
            dcp.load(flat, storage_reader=_IndexedReader(d / STATE_DIR, index), planner=_PlainBytesPlanner(),
                     no_dist=no_dist)
        except CheckpointException as e:  # every rank sees every rank's failures: all raise the same
            ours = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
            refused = next((f for f in ours if isinstance(f, CheckpointError)), None)
            if refused is None:
                raise
            raise CheckpointError(f"checkpoint {d}: {refused}") from None
    saved = flat if legacy else _read_values(d, manifest) if values else {}
    for key, live in values.items():
        if key not in saved:
            raise CheckpointError(f"checkpoint {d}: {VALUES_FILE} has no {key}, which this run's state has")
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


def read_sharded_weights(directory: str | Path) -> dict:
    """A sharded checkpoint's model weights as one state dict of whole tensors, read by this process alone (no
    collective, even inside a process group: export, evaluation, fine-tuning on one rank): only the model's
    entries, whose shapes and dtypes the checkpoint's index gives. The caller has verified the files."""
    d = Path(directory)
    manifest = read_manifest((d / MANIFEST).read_bytes(), d)
    index = read_index(d, manifest)
    target = {}
    for key, meta in index.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, dcp_metadata.TensorStorageMetadata):
            try:
                target[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            except (TypeError, RuntimeError, AttributeError) as e:
                raise CheckpointError(f"checkpoint {d}: {INDEX_FILE} gives {key} no valid shape and dtype "
                                      f"({e})") from None
    load_shards(d, manifest, target, no_dist=True, index=index)
    return {key[len("model."):]: value for key, value in target.items()}
