"""Worker side: the copy of a lone worker's state in the driver node's memory (checkpoint.memory_copy), taken and
loaded back.

Where one worker trains (an elastic run waiting for its replacement, a one-worker run) no live peer can write
its state when its node goes without notice (checkpoints/rescue.py), and a checkpoint on disk costs its write:
at a small state about what the plain script's `torch.save` costs (BENCHMARKS.md, "What a checkpoint costs at
the storm's shape"). A copy costs a host snapshot and one transfer: its tensors go as flat bytes (no per-tensor
pickling, no hash), their structure as a small pickle, to the run's keeper (hosts/state_keeper.py). A restarted
group resumes from the newest copy where it is newer than the newest checkpoint on disk, exactly as from that
checkpoint: it holds what one holds of the loop's position (the model, optimizer, schedule, scaler, weight
average and train state; no files of the task, which the run folder's checkpoints keep).

A copy is not a checkpoint: it lives as long as the run's driver, is never registered, never retained, never
exported; the disk checkpoints go on (further apart while copies protect the run: worker/reporting.py).
"""

from __future__ import annotations

import pickle
from dataclasses import asdict, dataclass

import torch

from behemoth.checkpoints import live_state
from behemoth.checkpoints.trainables import Trainables
from behemoth.errors import CheckpointError
from behemoth.hosts import collectives
from behemoth.hosts.console import console
from behemoth.models.wrappers import is_sharded, unwrap
from behemoth.storage.checkpoint import EMA_FILE, MODEL_FILE, TrainState, tensor_bytes

# The largest state copied (model, optimizer, weight average): the keeper holds two copies in the head's memory
MAX_BYTES = 2 << 30


@dataclass(frozen=True)
class _Tensor:
    """A tensor's place in the skeleton: its bytes are the flat buffer's [offset, offset + nbytes)."""
    offset: int
    nbytes: int
    dtype: str
    shape: tuple


def flatten(tree, tensors: list):
    """`tree` (nested dicts, lists and tuples of tensors and plain values) with each tensor replaced by a _Tensor
    placing it in one flat buffer after the tensors already in `tensors`, to which it is appended."""
    end = [sum(t.numel() * t.element_size() for t in tensors)]

    def walk(node):
        if isinstance(node, torch.Tensor):
            nbytes = node.numel() * node.element_size()
            tensors.append(node.detach())
            end[0] += nbytes
            return _Tensor(end[0] - nbytes, nbytes, str(node.dtype).removeprefix("torch."), tuple(node.shape))
        if isinstance(node, dict):
            return type(node)((k, walk(v)) for k, v in node.items())
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        return node

    return walk(tree)


def pack(tensors: list, flat: torch.Tensor | None) -> torch.Tensor:
    """`tensors`' bytes one after the other in a host buffer: `flat`, reused where it has their size."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    if flat is None or flat.numel() != size:
        flat = torch.empty(size, dtype=torch.uint8)
    at = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        flat[at:at + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))  # (from a GPU: copied to the host)
        at += n
    return flat


def unflatten(tree, flat):
    """`flatten`'s inverse over the flat buffer's bytes (a numpy uint8 array): each tensor in memory of its own."""
    if isinstance(tree, _Tensor):
        piece = torch.tensor(flat[tree.offset:tree.offset + tree.nbytes], dtype=torch.uint8)
        return piece.view(getattr(torch, tree.dtype)).reshape(tree.shape)
    if isinstance(tree, dict):
        return type(tree)((k, unflatten(v, flat)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(unflatten(v, flat) for v in tree)
    return tree


class MemoryCopy:
    """Rank 0's copies of the run's state to the keeper (`link`: hosts.state_keeper.KeeperLink)."""

    def __init__(self, link, run: Trainables):
        self.link, self.run = link, run
        self.flat: torch.Tensor | None = None  # the host buffer the state is packed into, reused from copy to copy

    def fits(self) -> bool:
        """Whether this run's state is copied at all: DDP or one process (FSDP's shards are each rank's own)
        and at most MAX_BYTES, counted before the first step as the weights' bytes x 3 (and Adam's two moments,
        which the optimizer makes at its first step), the weight average's bytes on top (an fp32 average of a
        bf16 model is twice its weights)."""
        if is_sharded(self.run.model):
            return False
        weights = tensor_bytes(live_state.trained_state(unwrap(self.run.model)))
        average = tensor_bytes(self.run.ema.state_dict()) if self.run.ema is not None else 0
        return weights * 3 + average <= MAX_BYTES

    def state_dicts(self) -> dict:
        """What a checkpoint holds of the loop's state, as the live objects' state dicts (no copy taken)."""
        run = self.run
        dicts = {MODEL_FILE: live_state.trained_state(unwrap(run.model)), "optimizer.pt": run.optimizer.state_dict(),
                 "scheduler.pt": run.scheduler.state_dict()}
        if run.scaler is not None and run.scaler.is_enabled():
            dicts["scaler.pt"] = run.scaler.state_dict()
        if run.ema is not None:
            dicts[EMA_FILE] = run.ema.state_dict()
        return dicts

    def send(self, state: TrainState) -> bool:
        """Copy the state after `state.step` to the keeper; False where the last copy is still on its way (this
        one is skipped: copies do not queue). Between steps: nothing changes the state while it is packed, and
        Ray has copied the buffer into its object store when the call returns (the buffer is free again)."""
        if self.link.busy():
            return False
        tensors: list = []
        skeleton = flatten({"dicts": self.state_dicts(), "state": asdict(state)}, tensors)
        self.flat = pack(tensors, self.flat)
        self.link.send(state.step, pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL), [self.flat.numpy()])
        return True


def restore_newer(link, run: Trainables, than_step: int) -> TrainState | None:
    """On every rank: load the keeper's newest copy into `run` where it is newer than `than_step` (the checkpoint
    the group restored, -1: none); its TrainState, or None (the checkpoint stands). Every rank loads the same
    copy, or none does (a rank that cannot fetch it)."""
    newest = collectives.from_rank0(link.newest() if collectives.rank() == 0 else None)
    if newest <= than_step:
        return None

    def fetched():
        got = link.fetch(newest)
        if got is None:
            raise CheckpointError(f"the copy of step {newest} in the driver's memory could not be read")
        return got

    try:
        skeleton, arrays = collectives.on_every_rank(fetched)
    except CheckpointError as e:
        console(f"WARNING: {e}: resuming from the checkpoint of step {than_step} instead")
        return None
    copy = unflatten(pickle.loads(skeleton), arrays[0])  # (this run's own rank 0 sent it)
    dicts = copy["dicts"]
    live_state.load_model_and_optimizer(dicts[MODEL_FILE], dicts["optimizer.pt"], f"the copy of step {newest}",
                                        model=run.model, optimizer=run.optimizer)
    live_state.load_the_rest(dicts.get, ema=run.ema, scheduler=run.scheduler, scaler=run.scaler)
    return TrainState(**copy["state"])
