"""The checkpoint format: a directory of files with a manifest written last, verified on load.
Taking the state from live objects and loading it back into them: behemoth.checkpoints.live_state.

A checkpoint directory holds:
  model.pt, optimizer.pt, scheduler.pt   torch state dicts (the model unwrapped from DDP; under FSDP the full
                                         state gathered by torch.distributed.checkpoint's get_state_dict; a
                                         numbered optimizer state with its parameters' names, `param_names`)
  scaler.pt                              the fp16 gradient scaler's state (train.precision fp16 only)
  comm_hook.pt                           each rank's gradient-compression state (PowerSGD only)
  train_state.json                       step, epoch, step in epoch, samples consumed, world size
  <the task's files>                    small texts a task keeps (Task.checkpoint_files; images: classes.json)
  tokenizer/                             the run's tokenizer as it saved itself, its chat template included
                                         (Task.kept_files: what export and generate read, never a path the
                                         job.yaml names)
  metrics.json                           the metrics reported with it (evaluation when one was due)
  job.yaml                               the job config that produced it
  manifest.json                          format version, every other file's size and sha256 — written last

A sharded checkpoint (checkpoint.format sharded: FSDP's default) holds, instead of model.pt and optimizer.pt,
  state/.metadata, state/__R_0.distcp    the model and optimizer tensors as torch.distributed.checkpoint (DCP)
                                         wrote them: one file per rank R with that rank's shards, and the index
  state_values.json                      the state's other entries (the optimizer's param_groups: lr, ...)
and its manifest (format 3) lists every rank's files: rank 0 writes it last, once every rank has written and
hashed its own (behemoth.checkpoints.sharded). It loads at any world size, under FSDP or DDP, and nothing in it is
unpickled freely (behemoth.storage.shard_reader). Format 2, written before, held the param_groups as pickles inside
DCP: it still loads, those entries with weights_only.

No RNG state is stored: the loop reseeds from (seed, rank, step) every step and augmentation draws from
(seed, epoch, sample), so random state is a function of the position, which train_state.json records.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (torch is imported where tensors are written or measured: the config and data checks load this module)
from behemoth.storage.filesystem import filesystem, read_file  # noqa: F401 (read_file: the format's reader too)
from behemoth.storage.paths import is_inside
from behemoth.errors import CheckpointError
from behemoth.storage.train_state import TrainState  # (the loop's position: train_state.json)

FORMAT_VERSION = 1  # model.pt, optimizer.pt: the full state, written by one process
SHARDED_FORMAT = 3  # state/: DCP shards (tensors only), written by every rank; state_values.json: the rest
LEGACY_SHARDED_FORMAT = 2  # the param_groups pickled inside DCP: read with weights_only (shard_reader)
SHARDED_FORMATS = (LEGACY_SHARDED_FORMAT, SHARDED_FORMAT)
VALUES_FILE = "state_values.json"
MANIFEST = "manifest.json"
MODEL_FILE = "model.pt"  # a full checkpoint's weights; the rest of it (optimizer, schedule, ...) is the run's
EMA_FILE = "ema.pt"  # the weight average (train.ema_decay): the weights evaluation, eval and export use
STATE_DIR = "state"
# What DCP warns when it runs without a process group: in a one-process use that is what is meant.
SINGLE_PROCESS_WARNING = "torch.distributed is disabled"
# A shard file's manifest entry also holds the sha256 of each CHUNK_BYTES piece ("chunks"): a reader that needs
# only some of a file's bytes (a rank of a resharded restore, an export of the model's entries) fetches and
# checks whole chunks around them, not the file. Small enough that a rank's slices cost little beyond their
# own bytes, large enough that a ranged GET per chunk is cheap against its transfer.
CHUNK_BYTES = 4 << 20


@dataclass
class Snapshot:
    """The training state copied to host memory: what a checkpoint directory will hold, file by file.
    Taking it is the only part of a checkpoint the training step waits for when saving in the background."""

    state_dicts: dict  # file name -> state dict of CPU tensors (torch.save)
    texts: dict  # file name (maybe in a folder: tokenizer/...) -> text, or bytes (a task's kept files)
    step: int
    copies: Any = None  # checkpoints.live_state.Copies: tensor copies possibly still in flight (snapshot(overlap=True))

    def wait_sources_free(self) -> None:
        if self.copies is not None:
            self.copies.wait_sources_free()


def write(directory: str | Path, snap: Snapshot, before_manifest=None, after_file=None) -> Path:
    """Write a snapshot as a checkpoint directory; the manifest goes last, so its presence means complete.
    `before_manifest`: called when every other file is written, `after_file(path)` after each state file (the
    failure tests' kill and full-disk points: hosts/faults.py)."""
    d = write_files(directory, snap, after_file)
    files = hash_files(d, sorted([*snap.state_dicts, *snap.texts]))
    if before_manifest is not None:
        before_manifest()
    commit(d, files, FORMAT_VERSION)
    return d


def write_files(directory: str | Path, snap: Snapshot, after_file=None) -> Path:
    """A snapshot's files (not the manifest) into `directory`, created if needed; `after_file(path)` after each
    state file."""
    import torch

    if snap.copies is not None:
        snap.copies.wait_done()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name, sd in snap.state_dicts.items():
        # Through a Python file: a full disk then surfaces as OSError ENOSPC (under torch's RuntimeError);
        # torch.save to a path reports only "unexpected pos ..." from its zip writer.
        with open(d / name, "wb") as f:
            torch.save(sd, f)
        if after_file is not None:
            after_file(d / name)
    for name, text in snap.texts.items():
        (d / name).parent.mkdir(exist_ok=True)  # (a kept folder: tokenizer/)
        if isinstance(text, bytes):
            (d / name).write_bytes(text)
        else:
            (d / name).write_text(text)
    return d


def hash_files(directory: str | Path, names: list[str], chunked: tuple[str, ...] = ()) -> dict:
    """{name: {size, sha256}} of files in `directory` (names relative to it): a manifest's entries. The files
    in `chunked` also get {chunk_bytes, chunks}: the sha256 of each CHUNK_BYTES piece, in the same pass."""
    d = Path(directory)
    entries = {}
    for name in names:
        with open(d / name, "rb") as f:
            whole, chunks, size = hashlib.sha256(), [], 0
            for piece in iter(lambda: f.read(CHUNK_BYTES), b""):
                whole.update(piece)
                size += len(piece)
                if name in chunked:
                    chunks.append(hashlib.sha256(piece).hexdigest())
        entries[name] = {"size": size, "sha256": whole.hexdigest()}
        if name in chunked:
            entries[name].update(chunk_bytes=CHUNK_BYTES, chunks=chunks)
    return entries


def is_shard_file(name: str) -> bool:
    """A rank's DCP data file in a sharded checkpoint (state/__R_0.distcp), not the index or a small file."""
    return name.startswith(f"{STATE_DIR}/") and name.endswith(".distcp")


def has_chunk_hashes(manifest: dict, names) -> bool:
    """Whether every file in `names` has its chunks' hashes in the manifest (checkpoints written before they
    were recorded have none: such a file is fetched and checked whole)."""
    entries = [manifest["files"].get(n, {}) for n in names]
    return all(isinstance(e.get("chunks"), list) and isinstance(e.get("chunk_bytes"), int) and e["chunk_bytes"] > 0
               for e in entries)


def commit(directory: str | Path, files: dict, format_version: int) -> None:
    """Write the manifest over `files` (hash_files' entries), atomically: the checkpoint is now complete."""
    d = Path(directory)
    tmp = d / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format_version": format_version, "files": files}, indent=1))
    os.replace(tmp, d / MANIFEST)


def weight_files(manifest: dict) -> tuple[str, ...]:
    """The files holding a checkpoint's model weights: model.pt (ema.pt, the weight average, where the run kept
    one: what it evaluated), or a sharded one's state/ folder."""
    if manifest.get("format_version") in SHARDED_FORMATS:
        return tuple(name for name in manifest["files"] if name.startswith(STATE_DIR + "/"))
    return (EMA_FILE,) if EMA_FILE in manifest["files"] else (MODEL_FILE,)


def is_sharded_format(directory: str | Path) -> bool:
    """Whether a local checkpoint folder's manifest says it is sharded (False when it has none: verification
    names that)."""
    try:
        return json.loads((Path(directory) / MANIFEST).read_text()).get("format_version") in SHARDED_FORMATS
    except (OSError, ValueError, AttributeError):
        return False


def verify(directory: str | Path, only: tuple[str, ...] | None = None) -> dict:
    """Check every file (or the files named in `only`) against the manifest. Returns the manifest or raises
    CheckpointError naming the file."""
    d = Path(directory)
    manifest_path = d / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {d} has no {MANIFEST}: it was not completely written")
    manifest = read_manifest(manifest_path.read_bytes(), d, only)
    for name, expected in manifest["files"].items():
        if only is not None and name not in only:
            continue
        p = d / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint {d}: {name} is missing")
        if p.stat().st_size != expected["size"] or _sha256(p) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {d}: {name} does not match its manifest (size or sha256)")
    return manifest


def read_manifest(text: bytes | str, where, only: tuple[str, ...] | None = None) -> dict:
    """A manifest's contents, checked: readable, this format, and listing every file in `only`."""
    try:
        manifest = json.loads(text)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {where}: {MANIFEST} is unreadable ({e})") from None
    if manifest.get("format_version") not in (FORMAT_VERSION, *SHARDED_FORMATS):
        raise CheckpointError(f"checkpoint {where} has format {manifest.get('format_version')}, "
                              f"this behemoth reads {FORMAT_VERSION}, {LEGACY_SHARDED_FORMAT} and {SHARDED_FORMAT}")
    # a copy of the checkpoint writes each listed file under its name (node_copy, RemoteShards): a name that
    # leaves the folder would write wherever its reader may
    if not isinstance(files, dict) or not all(is_inside(name) for name in files):
        raise CheckpointError(f"checkpoint {where}: {MANIFEST} lists a file name outside the checkpoint's folder")
    unlisted = [name for name in only or () if name not in files]
    if unlisted:
        raise CheckpointError(f"checkpoint {where}: {', '.join(unlisted)} not in its {MANIFEST}")
    return manifest


def read_manifest_bytes(path: str, fs, where: str) -> bytes:
    """The manifest of the checkpoint at `path` on the pyarrow filesystem `fs`, as stored. Missing, it is the
    checkpoint's fault (CheckpointError, the same on every rank); any other error is the store's."""
    try:
        return read_file(f"{path}/{MANIFEST}", fs)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {where} has no {MANIFEST}: it was not completely written") from None


def read_verified(ckpt: str, name: str, fs=None, manifest: dict | None = None) -> bytes:
    """One small file of a checkpoint (a local folder, a URI, or a path on the pyarrow `fs`), checked against
    its manifest (`manifest`: read already) as `verify` checks every file: a CheckpointError naming the file
    where it is not listed, missing, or not what was written (a damaged or edited file counts as damage)."""
    if manifest is None:
        manifest = read_manifest(read_manifest_bytes(ckpt, fs, ckpt), ckpt, only=(name,))
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"checkpoint {ckpt}: {name} not in its {MANIFEST}")
    try:
        data = read_file(f"{ckpt}/{name}", fs)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt}: {name} is missing") from None
    if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"checkpoint {ckpt}: {name} does not match its manifest (size or sha256)")
    return data


def read_json(ckpt: str, name: str, fs=None) -> Any:
    """A checkpoint's JSON file, checked against its manifest (read_verified)."""
    data = read_verified(ckpt, name, fs)
    try:
        return json.loads(data)
    except ValueError as e:  # (written so: its manifest was made over it)
        raise CheckpointError(f"checkpoint {ckpt}: {name} is not JSON ({e})") from None


def job_sections(data: bytes, ckpt: str) -> dict:
    """A checkpoint's job.yaml (its bytes, read_verified first: an edited one is damage, never a config to read)
    as a mapping of sections, each a mapping (or null): what export builds a config from and a rerun compares
    with. Anything else is one CheckpointError naming the checkpoint (a list for `train:` is not a config)."""
    import yaml

    try:
        raw = yaml.safe_load(data.decode()) or {}
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: its job.yaml is not YAML ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"checkpoint {ckpt}: its job.yaml does not hold a job config (a mapping of sections)")
    for section, value in raw.items():
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(f"checkpoint {ckpt}: its job.yaml's {section} is a {type(value).__name__}, "
                                  f"not a section (a mapping of keys)")
    return as_written_then(raw)


def as_written_then(raw: dict) -> dict:
    """A job's sections written by an earlier behemoth (a checkpoint's job.yaml, a sweep's record) with the keys
    added since that meant something then: an image job without data.eval_crop_pct was evaluated at 1 (left
    out, it would now take the pretrained model's crop). Keys added since whose absence reads as None need none."""
    data = raw.get("data") or {}
    if "image_size" in data and "eval_crop_pct" not in data:
        raw = {**raw, "data": {**data, "eval_crop_pct": 1.0}}
    return raw


def verified_state(ckpt: str) -> TrainState:
    """A checkpoint's train_state.json checked against its manifest (read_verified), as one CheckpointError naming
    the checkpoint where it is damaged or, written so, not a train state."""
    data = read_verified(ckpt, "train_state.json")
    try:
        return TrainState(**json.loads(data))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: its train_state.json is not a train state "
                              f"({' '.join(str(e).split())})") from None


def read_state(directory: str | Path, fs=None) -> TrainState:
    """A checkpoint's train_state.json: a local folder, a URI (s3://...), or a path on the pyarrow `fs`."""
    return TrainState(**json.loads(read_file(f"{directory}/train_state.json", fs)))


# The names a run's checkpoint folders are written under: Ray Train's timestamps (a lane's too, as Ray Train
# names them: checkpoint_2026-01-01_00-00-00.000000; Ray's older numbering, checkpoint_000001, reads the same) and
# a rescue's (checkpoints/rescue.py: checkpoint_rescue_step000000045, _rank1 where two ranks write). Nothing else
# in a run folder is one: a folder a user made there (an export into runs/x/checkpoint_best_hf, a copy kept as
# checkpoint_..._old) is never restored, retired, or removed as an upload cut short.
CHECKPOINT_NAME = re.compile(r"checkpoint_(\d[\d._-]*|rescue_step\d+(_rank\d+)?)")


def checkpoint_folders(run_dir: str | Path, fs=None) -> list[tuple[str, bool]]:
    """(path, complete) of each checkpoint folder in a run folder (a name CHECKPOINT_NAME matches), complete
    meaning its manifest is there. `fs`: the pyarrow filesystem `run_dir` is a path on; None: `run_dir` is a
    local path or a URI. The paths are paths on that filesystem (a URI's without its scheme: see
    complete_checkpoints for URIs back)."""
    import pyarrow.fs

    fs, run_dir = filesystem(run_dir, fs)
    found = []
    for entry in fs.get_file_info(pyarrow.fs.FileSelector(str(run_dir), allow_not_found=True)):
        if entry.type == pyarrow.fs.FileType.Directory and CHECKPOINT_NAME.fullmatch(entry.base_name):
            manifest = fs.get_file_info(f"{entry.path}/{MANIFEST}")
            found.append((entry.path, manifest.type == pyarrow.fs.FileType.File))
    return found


def complete_checkpoints(folder: str | Path, fs=None) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints in a run folder whose manifest was written, newest step first: local,
    a URI (the paths come back as URIs under `folder`: paths.entry_uri), or a path on the pyarrow filesystem `fs`.
    Unreadable train state counts as step -1 (verification names the problem when it is restored)."""
    from behemoth.storage import paths

    given_fs = fs
    fs, where = filesystem(folder, fs)
    found = []
    for path, complete in checkpoint_folders(where, fs):
        if complete:
            try:
                step = read_state(path, fs).step
            except (OSError, ValueError, TypeError):
                step = -1
            found.append((step, path if given_fs is not None else paths.entry_uri(str(folder), path)))
    return sorted(found, reverse=True)


def is_disk_full(e: BaseException | None) -> bool:
    """A full disk or quota: an OSError saying so (errno, or pyarrow's message), here or in what caused it
    (torch.save raises a RuntimeError over the file's OSError; DCP collects each rank's in `failures`)."""
    import errno

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and (e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in
                                       str(e) or "Disk quota exceeded" in str(e)):
            return True
        # torch.distributed.checkpoint's CheckpointException: {rank: (exception, traceback)} of every rank
        failures = (getattr(e, "failures", None) or {}).values()
        if any(is_disk_full(f[0] if isinstance(f, tuple) else f) for f in failures):
            return True
        e = e.__cause__ or e.__context__
    return False


def snapshot_bytes(snap: Snapshot) -> int:
    """About the bytes a snapshot takes on disk: its tensors' and texts' sizes (torch.save adds little)."""
    return tensor_bytes(snap.state_dicts) + sum(len(t if isinstance(t, bytes) else t.encode())
                                                for t in snap.texts.values())


def tensor_bytes(tree) -> int:
    """The bytes of the tensors in a state dict (nested dicts and lists); of a DTensor, this rank's shard."""
    import torch

    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.numel() * local.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return stream_sha256(f)


def stream_sha256(f) -> str:
    """The sha256 of what an open binary file or pyarrow stream holds from its position to its end."""
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()
