"""Ray Train's host of the worker side: a TorchTrainer's workers (every run, and every sweep trial of several
workers) read rank, device, storage and checkpoints from Ray Train and report through it. The one place that
calls ray.train.report (tests/unit/test_platform.py)."""

from __future__ import annotations

import math
import os

import ray
import ray.train
import ray.train.torch

from behemoth.hosts.contract import WorkerHost


def ray_checkpoint(path: str, fs):
    """A ray.train.Checkpoint (what Ray Train and Tune record): a path on a pyarrow filesystem."""
    return ray.train.Checkpoint(path, filesystem=fs)


def ray_node_id():
    """This process's Ray node id; None outside a Ray worker (a test writing a ledger from a real pipeline)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


class RayTrainHost(WorkerHost):
    """Ray Train's worker context (ray.train.get_context and friends), read when asked."""

    @property
    def report_interval_s(self) -> float:  # type: ignore[override]
        # its controller's poll interval (Ray Train propagates the driver's RAY_TRAIN_* variables; 2 s is
        # Ray's default, behemoth's driver sets 0.2 s: driver/ray_cluster/session.py)
        return float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0"))

    @property
    def rank(self) -> int:  # type: ignore[override]
        return ray.train.get_context().get_world_rank()

    @property
    def world(self) -> int:  # type: ignore[override]
        return ray.train.get_context().get_world_size()

    @property
    def run_name(self) -> str:  # type: ignore[override]
        return ray.train.get_context().get_experiment_name()

    @property
    def device(self):
        return ray.train.torch.get_device()

    def storage(self):
        storage = ray.train.get_context().get_storage()
        return storage.storage_filesystem, storage.experiment_fs_path

    def new_checkpoint_name(self) -> str:
        return ray.train.get_context().get_storage().make_default_checkpoint_dir_name()

    def latest_checkpoint(self):
        return ray.train.get_checkpoint()

    def reported_checkpoints(self) -> list:
        return [r.checkpoint for r in ray.train.get_all_reported_checkpoints()]

    def report(self, metrics, upload=None, *, folder=None, dir_name=None, async_upload=False) -> None:
        mode = ray.train.CheckpointUploadMode.ASYNC if async_upload else ray.train.CheckpointUploadMode.SYNC
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder) if folder else None,
                         checkpoint_dir_name=dir_name, checkpoint_upload_mode=mode, checkpoint_upload_fn=upload,
                         delete_local_checkpoint_after_upload=False)

    def persist(self, folder: str, dir_name: str):
        storage = ray.train.get_context().get_storage()
        return storage.persist_current_checkpoint(ray.train.Checkpoint.from_directory(folder), dir_name)

    def prepare_model(self, model, wrap_ddp: bool):
        # Ray Train's: to the device (and set as CUDA's current one); DDP where there are several workers
        return ray.train.torch.prepare_model(model, parallel_strategy="ddp" if wrap_ddp else None)

    def checkpoint_at(self, path: str, fs):
        return ray_checkpoint(path, fs)

    def prepared_data(self, loop_config: dict):
        # the driver put the prepared data into the object store once for all workers (a lane hands its own)
        return loop_config["data"] if "data" in loop_config else ray.get(loop_config["data_ref"])

    def node_id(self):
        return ray_node_id()

    def preemption_deadline(self):
        from behemoth.ray_internals.train_v2 import preemption_notice

        notice = preemption_notice()
        if notice is None:
            return None
        return math.inf if notice.deadline_ms is None else notice.deadline_ms / 1000

    def reclaimed(self) -> bool:
        import ray

        from behemoth.ray_internals.train_v2 import preemption_notice

        notice = preemption_notice()
        doomed = set((notice.preempted_node_to_ranks or {}) if notice is not None else ())
        if not doomed:
            return False
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        return not doomed & alive

    def quiet_console(self) -> None:
        from behemoth.ray_internals.train_v2 import quiet_report_log

        quiet_report_log()
