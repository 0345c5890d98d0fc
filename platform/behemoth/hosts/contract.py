"""The worker contract: what the training loop, the worker room and the tasks' worker halves need of the
process that hosts them.

They read rank, world size, device, the run's storage and its checkpoints, their prepared data, and report,
through `hosts.current()` (hosts/__init__.py), a `WorkerHost`:

- under Ray Train (a TorchTrainer's workers: every run, and every sweep trial of several workers) it is
  hosts/ray_train.py's `RayTrainHost`, which asks Ray Train;
- in a sweep's warm lane (a trial of one worker trained in a Tune actor reused from trial to trial) it is
  hosts/lane.py's `LaneHost`, which writes the same run folder, checkpoints, manifests and records.

worker/ and tasks/ never import ray (tests/unit/test_platform.py): every Ray call they need is a method here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # annotations only: reading a job config imports this module, and needs no torch
    import torch

# A checkpoint's writer: (the checkpoint's empty local folder, its name in the run folder) -> the checkpoint
# where it now lies (the host's checkpoint value: `checkpoint_at`).
UploadFn = Callable[[object, str], object]


class WorkerHost:
    """What the training loop needs of its host. Checkpoints are the host's checkpoint values (`checkpoint_at`:
    a path and a pyarrow filesystem, as `.path` and `.filesystem`); nothing here needs Ray Train running."""

    rank: int = 0
    world: int = 1
    run_name: str = ""  # the run folder's name (a sweep trial's: its trial id)
    # How often the host takes a report without making the reporter wait (worker/report_sender.py);
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

    def checkpoint_at(self, path: str, fs):
        """The host's checkpoint value for the checkpoint folder `path` on the pyarrow filesystem `fs`."""
        raise NotImplementedError

    def prepared_data(self, loop_config: dict):
        """The task's prepared data, as the driver handed it to the loop (in `loop_config`)."""
        return loop_config["data"]

    def node_id(self) -> Optional[str]:
        """The id of the cluster node this worker runs on; None outside a cluster."""
        return None

    def preemption_deadline(self) -> Optional[float]:
        """Where the host says this worker's node is about to be reclaimed (a spot instance's notice): the
        deadline (time.time() seconds; math.inf without one); None where no notice came."""
        return None

    def reclaimed(self) -> bool:
        """Whether every node a notice named is gone already (the group may end: the next one is sized without
        them); False where the host cannot tell (the hold then lasts to the deadline and its grace)."""
        return False

    def quiet_console(self) -> None:
        """Keep the host's own per-report log lines off the console (behemoth prints progress lines)."""
