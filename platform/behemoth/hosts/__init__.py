"""Who hosts the worker side, and the contract between them: worker/ and tasks/ reach Ray only through a host
(data/'s pipelines are Ray Data's own, on the workers too).

- `contract`: `WorkerHost`, what the loop, the worker room and the tasks' worker halves need of their host
  (rank, device, storage, checkpoints, prepared data, report).
- `ray_train`: Ray Train's host (a TorchTrainer's workers).
- `lane`: a sweep's warm lane's host (a one-worker trial in a reused Tune actor).
- `lease_fence`: the run lock's fence in Ray Train's workers, around each checkpoint upload (a Ray Train
  callback that runs in the workers, so it lives with their host).
- `rescue_callback`: the rescue checkpoint's hook in Ray Train's workers' shutdown (checkpoints/rescue.py).
- `state_keeper`: the actor on the driver's node that keeps a lone worker's copies of its state
  (checkpoint.memory_copy), started by the driver, reached by the workers.
- What a worker process has of its host, below the worker and checkpoints rooms that both use it:
  `collectives` (the few collectives over the host's process group, each a no-op in one process or a lane),
  `console` (a line for the user's console, not print: Ray Train's patch would double it) and `faults` (fault
  injection for the failure tests, switched on by a variable in the workers' environment; none in runs).

Here: which host is current. `hosted(host)` makes one current while a block runs (a lane, a data bench's
consumer); outside one, Ray Train's is. And `when_stopped(hook)`: what runs when the host stops the group under
the loop (`stopping()`, called by Ray Train's shutdown through rescue_callback).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING, Optional

from behemoth.hosts.contract import UploadFn, WorkerHost

if TYPE_CHECKING:
    import torch

__all__ = ["UploadFn", "WorkerHost", "current", "device", "hosted", "stopping", "when_stopped"]

_lock = threading.Lock()
_hosted: Optional[WorkerHost] = None  # a lane's, for every thread of its process (its upload thread too)
_ray_train: Optional[WorkerHost] = None
_stop_hook: Optional[weakref.WeakMethod] = None  # the loop's rescue's, held weakly (when_stopped)


def current() -> WorkerHost:
    """The host of the run this process trains now: a lane's while it hosts one, else Ray Train's."""
    global _ray_train
    if _hosted is not None:
        return _hosted
    if _ray_train is None:  # imported when first asked: reading a job config needs no Ray
        from behemoth.hosts.ray_train import RayTrainHost

        _ray_train = RayTrainHost()
    return _ray_train


@contextlib.contextmanager
def hosted(host: WorkerHost):
    """`host` is current while the block runs (a lane trains one run at a time in its process)."""
    global _hosted
    with _lock:
        if _hosted is not None:
            raise RuntimeError("a worker host is already hosted in this process")
        _hosted = host
    try:
        yield host
    finally:
        with _lock:
            _hosted = None


def device() -> torch.device:
    """This worker's device (a shorthand the tasks' worker halves use)."""
    return current().device


def when_stopped(hook) -> None:
    """`hook()` runs when the host stops this process's worker group (Ray Train's shutdown of its workers, which
    waits up to 5 s for it: hosts/rescue_callback.py): the loop's rescue checkpoint. The latest hook replaces any
    earlier one (one loop trains in a worker process at a time). `hook`, a bound method, is held weakly: it keeps
    nothing of a finished run alive (a sweep's lane trains trial after trial in one process)."""
    global _stop_hook
    _stop_hook = weakref.WeakMethod(hook)


def stopping() -> None:
    """The host stops the worker group: run the hook (if any, and its object is still alive)."""
    hook = _stop_hook() if _stop_hook is not None else None
    if hook is not None:
        hook()
