"""Worker side: sharded checkpoints (checkpoint.format sharded; FSDP's default). Every rank writes its own
shards of the model and optimizer tensors with torch.distributed.checkpoint (DCP) into the checkpoint's state/
folder, in the background; rank 0 writes the state's other entries as JSON (state_values.json: DCP would
pickle them, and loading a pickle runs code), the small files (schedule, train state, job, ...) and, once
every rank has written and hashed its own files, the manifest over all of them, last. Nothing is gathered on
one rank. A sharded checkpoint loads at any world size (DCP reshards), under FSDP or DDP, through
behemoth.storage.shard_reader (nothing unpickled freely).

The order, per checkpoint: the training thread takes each rank's local state dict (views of its shards) and
starts dcp.async_save, which copies them into host buffers (before returning, or in DCP's staging thread while
the next forward and backward run: see ShardedWriter.start); the write and the commit (hashes gathered on
rank 0, manifest) run in Ray Train's upload thread. A dedicated gloo group
carries the checkpoint's collectives, so they never meet the training's on the default group, and a
checkpoint starts only once the previous one is committed: on every rank the group sees the same sequence.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from behemoth.storage import checkpoint
from behemoth.storage.checkpoint import SINGLE_PROCESS_WARNING, STATE_DIR, VALUES_FILE, Snapshot
from behemoth.errors import CheckpointError, PartlyLoadedError
from behemoth.hosts import collectives, faults
from behemoth.models.wrappers import unwrap

if TYPE_CHECKING:
    from behemoth.storage import shard_reader


def _state_dicts(model, optimizer, freeze_buffers: bool = False) -> dict:
    """{"model": ..., "optimizer": ...} keyed by parameter name: each rank's shards (DTensors) under FSDP,
    whole tensors under DDP. A fresh optimizer's state is created (zeros) so that a load has a target.
    `freeze_buffers`: the model's buffers (BatchNorm statistics, which the next forward changes in place) as
    copies taken now, so that the rest may be copied while that forward runs (they are small)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(unwrap(model), optimizer)
    if freeze_buffers:
        buffers = {name for name, _ in unwrap(model).named_buffers()}
        model_sd = {k: v.detach().clone() if k in buffers else v for k, v in model_sd.items()}
    return {"model": model_sd, "optimizer": optim_sd}


def _kept_stager(overlap: bool, pinned: bool):
    """DCP's DefaultStager (device -> host copies, from pinned buffers on a GPU), kept from one checkpoint to
    the next with its host buffers. torch 2.11's DefaultStager closes its inner StateDictStager after every
    stage, which empties the copy table the next stage needs (it fails on the state dict itself: KeyError:
    <class 'type'>): that inner close is made a no-op, so the buffers and the table stay until the process
    ends, as newer torch keeps them."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                          use_async_staging=overlap, use_non_blocking_copy=overlap and pinned))
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is not None:
        inner.close = lambda: None
    return stager


def own_files(folder: str | Path, rank: int) -> list[str]:
    """The files of a sharded checkpoint that `rank` wrote: its DCP data file(s), and for rank 0 the index
    and the non-tensor values (DCP's FileSystemWriter names a rank's files __RANK_N.distcp)."""
    state = Path(folder) / STATE_DIR
    names = sorted(p.name for p in state.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        names.append(".metadata")
    return [f"{STATE_DIR}/{name}" for name in names] + ([VALUES_FILE] if rank == 0 else [])


class ShardedWriter:
    """One per worker: starts each rank's DCP write, then commits the checkpoint from the upload thread."""

    def __init__(self, rank: int):
        self.rank = rank
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        if self.group is None:  # one process on purpose; DCP's warning saying so can come from its own threads
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        self.committed = threading.Event()  # the previous checkpoint's commit is over (or failed)
        self.committed.set()
        self.stagers: dict = {}  # overlap -> DCP's stager: its host buffers are reused checkpoint after checkpoint
        self.last_bytes = 0  # the bytes of this rank's state in the last checkpoint (a full disk's message)

    def agree(self, name: str) -> str:
        """Rank 0's `name` on every rank (the checkpoint folder, known before Ray Train's report)."""
        names = [name]
        if self.group is not None:
            dist.broadcast_object_list(names, src=0, group=self.group)
        return names[0]

    def start(self, model, optimizer, folder: str, overlap: bool = False):
        """Begin writing this rank's shards into `folder`/state (every rank calls it, same folder). Returns
        (written, staging): `written` completes when every rank's files are written. The state is copied
        to host buffers (kept from one checkpoint to the next) before this returns, or with `overlap` in
        DCP's staging thread while training goes on: then `staging.wait_sources_free()` must return before
        the weights change (the next optimizer update). The model's buffers, which a forward changes
        (BatchNorm statistics), are then copied on the device before this returns."""
        import torch.distributed.checkpoint as dcp

        self.committed.wait()
        self.committed.clear()
        try:
            Path(folder, STATE_DIR).mkdir(parents=True, exist_ok=True)
            # only tensors go through DCP; the rest (the same on every rank: the optimizer's settings) is JSON
            from behemoth.storage import shard_reader  # (DCP's modules, 0.5 s to import: only when used)

            tensors, values, _ = shard_reader.split_state(_state_dicts(model, optimizer, freeze_buffers=overlap))
            if self.rank == 0:
                Path(folder, VALUES_FILE).write_text(shard_reader.values_text(values))
            self.last_bytes = checkpoint.tensor_bytes(tensors)
            saved = dcp.async_save(tensors, checkpoint_id=f"{folder}/{STATE_DIR}",
                                   process_group=self.group, no_dist=self.group is None,
                                   async_stager=self._stager(overlap))
        except BaseException:
            self.committed.set()
            raise
        if overlap:
            return saved.upload_completion, Staging(saved.staging_completion)
        return saved, None

    def _stager(self, overlap: bool):
        if overlap not in self.stagers:
            self.stagers[overlap] = _kept_stager(overlap, pinned=torch.cuda.is_available())
        return self.stagers[overlap]

    def commit(self, written, folder: str, small: Snapshot | None, upload=None) -> None:
        """In the upload thread, every rank: wait for the write, hash this rank's files (rank 0 first writes
        `small`, the other files), `upload(names)` them when the folder is a local staging folder, gather
        the hashes on rank 0, which writes the manifest last."""
        try:
            with _as_checkpoint_error(f"writing the shards of {folder}"):
                written.result()
            if small is not None:
                checkpoint.write_files(folder, small, functools.partial(faults.disk_full, small.step))
            names = own_files(folder, self.rank)
            if small is not None:
                names += list(small.state_dicts) + list(small.texts)
            files = checkpoint.hash_files(folder, names, chunked=tuple(filter(checkpoint.is_shard_file, names)))
            if upload is not None:
                upload(names)
            gathered = [files]
            if self.group is not None:
                gathered = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
                dist.gather_object(files, gathered, dst=0, group=self.group)
            if self.rank == 0:
                faults.kill_in_upload(small.step)
                checkpoint.commit(folder, {k: v for f in gathered for k, v in f.items()},
                                  checkpoint.SHARDED_FORMAT)
                if upload is not None:
                    upload([checkpoint.MANIFEST])
        finally:
            self.committed.set()

    def wait(self) -> None:
        """Return once the last checkpoint is committed (its collectives are over on this rank)."""
        self.committed.wait()


class Staging:
    """A checkpoint's copy of the state to host memory, running in DCP's staging thread."""

    def __init__(self, future):
        self.future = future

    def wait_sources_free(self) -> None:
        self.future.result()


def load(folder: str | Path, model, optimizer=None, remote: "shard_reader.RemoteShards | None" = None,
         shared: bool = True) -> None:
    """Load a sharded checkpoint's model and optimizer state into this rank's objects (every rank calls it).
    In a folder every rank reads (`shared`), they share the hashing (rank r checks every world-th file);
    in a node's copy each rank checks every file. Either way all fail together, naming the file, when one
    does not match: they go on to the same next checkpoint. With `remote`
    (an object store), `folder` is this rank's own copy of the small files, all checked here, and the shard
    files are read by range where they are, each chunk checked as it arrives: a damaged chunk fails DCP's read
    step, which raises on every rank alike. Every rank reads the same verified index and values, so a
    checkpoint shard_reader refuses fails on every rank alike."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    d = Path(folder)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    manifest = checkpoint.read_manifest((d / checkpoint.MANIFEST).read_bytes(), d)
    names = sorted(manifest["files"])
    if remote is not None:  # the shard files are checked chunk by chunk as they are read
        mine = tuple(n for n in names if not checkpoint.is_shard_file(n))
    else:
        mine = tuple(names[rank::world] if shared else names)
    collectives.on_every_rank(lambda: checkpoint.verify(d, only=mine))
    target = _state_dicts(model, optimizer if optimizer is not None else [])
    if optimizer is None:
        target.pop("optimizer")
    try:
        with _as_checkpoint_error(f"checkpoint {remote.where if remote is not None else d}: loading its shards"):
            from behemoth.storage import shard_reader

            shard_reader.load_shards(d, manifest, target, no_dist=not dist.is_initialized(), remote=remote)
    except CheckpointError as e:
        # DCP copies each tensor into the live model and optimizer as it reads it: a chunk found damaged
        # mid-read (remote) leaves them holding part of this checkpoint (with the files checked first, never)
        if remote is None:
            raise
        raise PartlyLoadedError(str(e)) from e
    set_state_dict(unwrap(model), optimizer if optimizer is not None else [], model_state_dict=target["model"],
                   optim_state_dict=target.get("optimizer", {}))


@contextlib.contextmanager
def _as_checkpoint_error(what: str):
    """DCP's CheckpointException derives from BaseException: Ray Train's upload thread catches Exception only,
    so a failed write there would vanish and leave the run waiting for the report forever. As CheckpointError
    (its cause kept: a full disk is still recognised) it fails the worker like any checkpoint error."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        first = next(iter(e.failures.values()), None)
        reason = first[0] if isinstance(first, tuple) else first
        raise CheckpointError(f"{what} failed on rank(s) {sorted(e.failures)}: {reason!r}") from e
