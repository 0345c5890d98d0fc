"""The one seam between the worker side (the training loop, the tasks' worker halves) and what hosts it.

The loop and the worker room (reports, checkpoints, restore, evaluation) and the tasks' worker halves read
rank, world size, device, the run's storage and its checkpoints, and report, through `current()`:

- under Ray Train (a TorchTrainer's workers: every run, and every sweep trial of several workers) it is
  `RayTrainContext`, which asks Ray Train;
- in a sweep's warm lane (driver/sweep/lane.py: a trial of one worker trained in a Tune actor reused from
  trial to trial) it is the lane's, which writes the same run folder, checkpoints, manifests and records.

`hosted(ctx)` makes a context current while a block runs (the lane); outside one, Ray Train's is current.
Nothing else in the worker room or the tasks calls ray.train.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # annotations only: reading a job config imports this module, and needs no torch
    import torch

# A checkpoint's writer: (the checkpoint's empty local folder, its name in the run folder) -> the checkpoint
# where it now lies (a ray.train.Checkpoint: a path on the run's pyarrow filesystem).
UploadFn = Callable[[object, str], object]


class WorkerContext:
    """What the training loop needs of its host. Checkpoints are ray.train.Checkpoint values (a path and a
    pyarrow filesystem); nothing here needs Ray Train to be running."""

    rank: int = 0
    world: int = 1
    run_name: str = ""  # the run folder's name (a sweep trial's: its trial id)
    # How often the host takes a report without making the reporter wait (worker/report.py ReportSender);
    # 0: every report at once, in the training thread.
    report_interval_s: float = 0.0

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def storage(self) -> tuple[object, str]:
        """(the run storage's pyarrow filesystem, the run folder's path on it)."""
        raise NotImplementedError

    def new_checkpoint_name(self) -> str:
        raise NotImplementedError

    def latest_checkpoint(self):
        """The run's newest registered checkpoint, or None."""
        raise NotImplementedError

    def reported_checkpoints(self) -> list:
        """The run's registered checkpoints (those its retention keeps), oldest first."""
        raise NotImplementedError

    def report(self, metrics: dict, upload: Optional[UploadFn] = None, *, folder: Optional[str] = None,
               dir_name: Optional[str] = None, async_upload: bool = False) -> None:
        """Report `metrics`; with `upload`, a checkpoint that it writes (from the empty local `folder`, named
        `dir_name`), in the host's upload thread where `async_upload` (registered in report order)."""
        raise NotImplementedError

    def persist(self, folder: str, dir_name: str):
        """Copy a checkpoint staged in the local `folder` into the run folder as `dir_name`; its checkpoint."""
        raise NotImplementedError

    def prepare_model(self, model: torch.nn.Module, wrap_ddp: bool) -> torch.nn.Module:
        """The model on this worker's device, wrapped in DDP where `wrap_ddp` and there are several workers."""
        raise NotImplementedError


class RayTrainContext(WorkerContext):
    """Ray Train's worker context (ray.train.get_context and friends), read when asked."""

    @property
    def report_interval_s(self) -> float:  # type: ignore[override]
        # its controller's poll interval (Ray Train propagates the driver's RAY_TRAIN_* variables; 2 s is
        # Ray's default, behemoth's driver sets 0.2 s: driver/ray_session.py)
        import os

        return float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0"))

    @property
    def rank(self) -> int:  # type: ignore[override]
        import ray.train

        return ray.train.get_context().get_world_rank()

    @property
    def world(self) -> int:  # type: ignore[override]
        import ray.train

        return ray.train.get_context().get_world_size()

    @property
    def run_name(self) -> str:  # type: ignore[override]
        import ray.train

        return ray.train.get_context().get_experiment_name()

    @property
    def device(self) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()

    def storage(self):
        import ray.train

        storage = ray.train.get_context().get_storage()
        return storage.storage_filesystem, storage.experiment_fs_path

    def new_checkpoint_name(self) -> str:
        import ray.train

        return ray.train.get_context().get_storage().make_default_checkpoint_dir_name()

    def latest_checkpoint(self):
        import ray.train

        return ray.train.get_checkpoint()

    def reported_checkpoints(self) -> list:
        import ray.train

        return [r.checkpoint for r in ray.train.get_all_reported_checkpoints()]

    def report(self, metrics, upload=None, *, folder=None, dir_name=None, async_upload=False) -> None:
        import ray.train

        mode = ray.train.CheckpointUploadMode.ASYNC if async_upload else ray.train.CheckpointUploadMode.SYNC
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder) if folder else None,
                         checkpoint_dir_name=dir_name, checkpoint_upload_mode=mode, checkpoint_upload_fn=upload,
                         delete_local_checkpoint_after_upload=False)

    def persist(self, folder: str, dir_name: str):
        import ray.train

        storage = ray.train.get_context().get_storage()
        return storage.persist_current_checkpoint(ray.train.Checkpoint.from_directory(folder), dir_name)

    def prepare_model(self, model, wrap_ddp: bool):
        import ray.train.torch

        # Ray Train's: to the device (and set as CUDA's current one); DDP where there are several workers
        return ray.train.torch.prepare_model(model, parallel_strategy="ddp" if wrap_ddp else None)


_RAY_TRAIN = RayTrainContext()
_lock = threading.Lock()
_hosted: Optional[WorkerContext] = None  # a lane's, for every thread of its process (its upload thread too)


def current() -> WorkerContext:
    """The context of the run this process trains now: a lane's while it hosts one, else Ray Train's."""
    return _hosted or _RAY_TRAIN


@contextlib.contextmanager
def hosted(ctx: WorkerContext):
    """`ctx` is current while the block runs (a lane trains one run at a time in its process)."""
    global _hosted
    with _lock:
        if _hosted is not None:
            raise RuntimeError("a worker context is already hosted in this process")
        _hosted = ctx
    try:
        yield ctx
    finally:
        with _lock:
            _hosted = None


def device() -> torch.device:
    """This worker's device (a shorthand the tasks' worker halves use)."""
    return current().device
