"""Worker side: the few collective operations the loop and checkpoints need, each a no-op in a single process
(the host made the process group, or none: a lane).

All ranks call them at the same points (decided by the step counter alone), so none can deadlock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from behemoth.errors import CheckpointError


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the group (0 in a single process)."""
    return dist.get_rank() if distributed() else 0


def all_reduce_sum(t: torch.Tensor) -> None:
    if distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)


def gather_to_rank0(obj):
    """[obj of rank 0, obj of rank 1, ...] on rank 0, None elsewhere."""
    if not distributed():
        return [obj]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def union_across_ranks(ids: set) -> set:
    if not distributed():
        return set(ids)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(ids))
    return set().union(*map(set, gathered))




def from_rank0(obj):
    """Rank 0's obj on every rank."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_every_rank(attempt):
    """attempt()'s result, where it succeeded on every rank; where it raised CheckpointError on any rank, every
    rank raises that error (the first such rank's, naming it). A checkpoint one rank alone skips (its node's
    copy damaged) would leave it on another step than the rest: the replicas diverge silently and a later
    collective hangs. So every rank calls this at the same point, and all skip or keep a checkpoint together."""
    try:
        result, problem = attempt(), None
    except CheckpointError as e:
        result, problem = None, str(e)
    if distributed():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((f"on rank {rank}: {p}" for rank, p in enumerate(problems) if p is not None), None)
    if problem is not None:
        raise CheckpointError(problem)
    return result
