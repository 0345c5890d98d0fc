"""The copy of a lone worker's state in the driver node's memory (checkpoint.memory_copy; checkpoints/memory_copy.py
takes and loads it, worker/memory_copies.py decides when).

An actor on the driver's node keeps the newest copies a run's rank 0 sent. The driver's node is the cluster's head
under `ray job submit` (behemoth check-kuberay keeps the head off spot capacity): a preemption of a worker's node
leaves it. The actor belongs to the driver (it ends with the run, or with the driver, whose next attempt starts
from the checkpoints on disk as before).

A copy is sent as one Ray call whose arguments are the state's flat tensors (uint8 numpy views: Ray copies them
into the sender's object store as pickle's out-of-band buffers, once) and a small skeleton; Ray runs `keep` only once every argument
has reached the keeper's node, so a copy cut short by its sender's node vanishing never replaces the one
before it. Each copy is copied out of the object store into the keeper's own memory, so that nothing it
keeps depends on the sender, which owns the object and may be gone.
"""

from __future__ import annotations

import ray

KEPT = 2  # copies kept: the newest, and the one before it for the ranks still fetching it while one arrives


@ray.remote(num_cpus=0)
class StateKeeper:
    def __init__(self):
        self.copies: dict[int, tuple[bytes, list]] = {}

    def keep(self, step: int, skeleton: bytes, arrays: list) -> int:
        import numpy as np

        self.copies[step] = (skeleton, [np.array(a, copy=True) for a in arrays])
        for old in sorted(self.copies)[:-KEPT]:
            del self.copies[old]
        return step

    def newest(self) -> int:
        """The newest copy's step (-1: none yet)."""
        return max(self.copies, default=-1)

    def copy_at(self, step: int) -> tuple[bytes, list] | None:
        return self.copies.get(step)


def start_keeper():
    """Driver side: a keeper on this (the driver's) node, for one run."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return StateKeeper.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()


def stop_keeper(keeper) -> None:
    """Driver side: the run's keeper ended (its copies freed); the driver's own end ends it too."""
    if keeper is not None and ray.is_initialized():
        ray.kill(keeper)


class KeeperLink:
    """Worker side: rank 0 sends copies to the run's keeper, one in flight at a time; every rank reads them."""

    def __init__(self, keeper):
        self.keeper, self.in_flight = keeper, None

    def busy(self) -> bool:
        """Whether the last copy sent has not reached the keeper yet (the next would queue behind it)."""
        if self.in_flight is None:
            return False
        ready, _ = ray.wait([self.in_flight], timeout=0)
        if ready:
            self.in_flight = None
        return not ready

    def send(self, step: int, skeleton: bytes, arrays: list) -> None:
        self.in_flight = self.keeper.keep.remote(step, skeleton, arrays)

    def newest(self, timeout_s: float = 30.0) -> int:
        """The keeper's newest step; -1 where it has none, or cannot be reached (its node lost: the run goes on
        from its checkpoints)."""
        try:
            return ray.get(self.keeper.newest.remote(), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            return -1

    def fetch(self, step: int, timeout_s: float = 120.0) -> tuple[bytes, list] | None:
        try:
            return ray.get(self.keeper.copy_at.remote(step), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            return None
