"""The lane's host of the worker side: a sweep's trial of one worker trained inside its Tune actor, reused from
trial to trial (driver/sweep/lane.py is the lane's driver half). It writes what Ray Train's host would: the
run folder, its checkpoints (registered in report order by an upload thread), retention, and every report
through the run's recorder; evaluations go to Tune from the training thread."""

from __future__ import annotations

import gc
import json
import queue
import threading
import weakref
from datetime import datetime
from types import SimpleNamespace

import torch

from behemoth.hosts.contract import WorkerHost
from behemoth.hosts.ray_train import ray_checkpoint, ray_node_id
from behemoth.storage.filesystem import local
from behemoth.storage.paths import RunPlace
from behemoth.storage.run_store import RunStore

_MODELS: list = []  # a weak reference to each trial's model: none may outlive its trial (models_alive)


def models_alive() -> int:
    """How many models of the trials this lane hosted are still reachable (after a collection): a trial whose
    state outlives it (its model, with the optimizer and pipelines that hold on to it) counts here."""
    gc.collect()
    _MODELS[:] = [ref for ref in _MODELS if ref() is not None]
    return len(_MODELS)


class LaneHost(WorkerHost):
    """The worker host of a run trained in a lane: rank 0 of 1, the run folder on its storage, checkpoints
    registered as they are written (an upload thread keeps report order with checkpoint.async_save), each
    report recorded by the run's RunRecorder, and evaluations forwarded to Tune from the training thread."""

    def __init__(self, place: RunPlace, retain, recorder, fence, forward):
        """`place`: the run's; `retain`: checkpoint.keep, as Ray Train applies it (checkpoints/retention.kept_indices:
        the metrics of the run's checkpoints in report order -> the indices kept); `recorder`: the run's
        RunRecorder; `fence`: the sweep's lease fence (or None); `forward`: called with every report (Tune's)."""
        self.run_name, self.retain = place.name, retain
        self.folder = place.folder
        self.store = RunStore.at(place.folder)
        self.fs, self.run_path = self.store.fs, self.store.path
        self.recorder, self.fence, self.forward = recorder, fence, forward
        self._device = _lane_device()
        # the run's complete checkpoints with their metrics, oldest first (a resumed trial's are registered)
        self.kept = [(ray_checkpoint(path, self.fs), _metrics_of(path, self.fs))
                     for _, path in reversed(self.store.complete(as_named=False))]
        self.kept = [self.kept[i] for i in retain([m for _, m in self.kept])]
        self.last_metrics: dict = {}
        self._jobs: queue.Queue = queue.Queue()
        self._uploader: threading.Thread | None = None
        self._failed: BaseException | None = None

    @property
    def device(self) -> torch.device:
        return self._device

    def storage(self):
        return self.fs, self.run_path

    def new_checkpoint_name(self) -> str:
        return f"checkpoint_{datetime.now():%Y-%m-%d_%H-%M-%S.%f}"  # as Ray Train names them

    def latest_checkpoint(self):
        return self.kept[-1][0] if self.kept else None

    def reported_checkpoints(self) -> list:
        return [ckpt for ckpt, _ in self.kept]

    def report(self, metrics, upload=None, *, folder=None, dir_name=None, async_upload=False) -> None:
        self._raise_failed()
        job = (dict(metrics), upload, folder, dir_name or (upload and self.new_checkpoint_name()))
        if async_upload or self._uploader is not None:  # behind the uploads still queued: report order
            self._start_uploader()
            self._jobs.put(job)
            if upload is not None and not async_upload:  # a synchronous checkpoint is written when this returns
                self.drain()
        else:
            self._register(*job)
        if self.forward is not None:
            self.forward(metrics)  # Tune may stop the trial here (SystemExit in this, the training thread)

    def persist(self, folder: str, dir_name: str):
        return ray_checkpoint(self.store.put_folder(folder, dir_name), self.fs)

    def prepare_model(self, model, wrap_ddp: bool):
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        model = model.to(self._device)  # one worker: nothing to wrap (as Ray Train's prepare_model at world 1)
        _MODELS.append(weakref.ref(model))
        return model

    # ------------------------------------------------------------------------------------------------------
    def _register(self, metrics: dict, upload, folder, dir_name) -> None:
        """Write the report's checkpoint (if any), register it, apply retention, record the report."""
        ckpt = None
        if upload is not None:
            self.fence_check("writing a checkpoint into it")
            ckpt = upload(ray_checkpoint(folder, local()), dir_name)
            self.fence_check("registering the checkpoint it just wrote and applying checkpoint.keep")
            self.kept.append((ckpt, metrics))
            keep = self.retain([m for _, m in self.kept])
            for i, (old, _) in enumerate(self.kept):
                if i not in keep:
                    self.store.delete(old.path)
            self.kept = [self.kept[i] for i in keep]
        self.last_metrics = metrics
        self.recorder.after_report(SimpleNamespace(checkpoint=ckpt), [metrics])

    def fence_check(self, before: str) -> None:
        if self.fence is not None:
            self.fence.check(before)

    def _start_uploader(self) -> None:
        if self._uploader is None:
            self._uploader = threading.Thread(target=self._upload_jobs, name="behemoth-lane-upload", daemon=True)
            self._uploader.start()

    def _upload_jobs(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._failed is None:  # after a failure the rest is dropped, as Ray Train drops it
                    self._register(*job)
            except BaseException as e:  # noqa: BLE001 - raised in the training thread at its next report
                self._failed = e
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def drain(self) -> None:
        """Wait for every queued report; raise the first failure among them."""
        self._jobs.join()
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    def close(self) -> None:
        """End the upload thread once what is queued is done (its failure, if any, is kept for drain)."""
        if self._uploader is not None:
            self._jobs.put(None)
            self._uploader.join()
            self._uploader = None

    def result(self, returned: dict):
        """The run as driver/run/summary.summarise reads a Ray Train Result."""
        latest = self.latest_checkpoint()
        return SimpleNamespace(metrics=self.last_metrics, checkpoint=latest, best_checkpoints=list(self.kept),
                               return_value=returned)

    def checkpoint_at(self, path: str, fs):
        return ray_checkpoint(path, fs)

    def node_id(self):
        return ray_node_id()


def _lane_device() -> torch.device:
    """The lane's GPU where Tune gave its trial one (Ray sets CUDA_VISIBLE_DEVICES to it), else the CPU."""
    import ray

    return torch.device("cuda", 0) if ray.get_gpu_ids() and torch.cuda.is_available() else torch.device("cpu")


def _metrics_of(path: str, fs) -> dict:
    """The metrics a checkpoint was reported with (its metrics.json), {} where unreadable."""
    try:
        with fs.open_input_stream(f"{path.rstrip('/')}/metrics.json") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return {}
