"""Worker side: saving checkpoints through ray.train.report (synchronously, or with only a snapshot in the
step's way), and uploading them to the run's storage with the manifest last."""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import time

import ray
import ray.train

from behemoth import checkpoint
from behemoth.checkpoint import TrainState
from behemoth.config import JobConfig, dump_yaml
from behemoth.metrics import PhaseClock
from behemoth.tasks import Task
from behemoth.worker import checkpointing, parallel
from behemoth.worker.collectives import gather_to_rank0
from behemoth.worker.run import Run


class CheckpointSaver:
    """Checkpoints through ray.train.report, from rank 0 (DDP keeps the ranks identical: one copy of the state
    is the whole state; FSDP gathers the full state on rank 0).

    With checkpoint.async_save the step waits only for a host-memory snapshot of the state, and under DDP
    only for part of it: the parameters and optimizer state are copied while the next step's forward and
    backward run, and that step waits for the copy before its optimizer update (`before_update`). Writing
    the files, the manifest and the upload run in Ray Train's upload thread (CheckpointUploadMode.ASYNC,
    which still registers checkpoints in report order). `last_block_s` is how long the last checkpoint held
    the training loop (at the report, and before the next update), reported with the next metrics.
    """

    def __init__(self, cfg: JobConfig, task: Task, rank: int, clock: PhaseClock | None = None):
        self.cfg, self.task, self.rank, self.clock = cfg, task, rank, clock
        self.last_block_s = None
        # Host buffers the snapshots copy into, reused while no write of an earlier snapshot still reads them.
        self.buffers: dict = {}
        self.buffers_free = threading.Event()
        self.buffers_free.set()
        self.copying = None  # the last snapshot while its copy may still read the live state

    def before_update(self) -> None:
        """Called before every optimizer update: the snapshot's copy of the state must be complete."""
        if self.copying is not None:
            t0 = time.perf_counter()
            self.copying.wait_sources_free()
            self.copying = None
            waited = time.perf_counter() - t0
            self.last_block_s += waited
            if self.clock is not None:
                self.clock.add("checkpoint", waited)

    def save_and_report(self, metrics: dict, state: TrainState, run: Run) -> None:
        t0 = time.perf_counter()
        hook_states = gather_to_rank0(run.hook_state.to_bytes()) if run.hook_state is not None else None
        snap, reuse = None, self.buffers_free.is_set()
        if self.rank == 0 or parallel.is_sharded(run.model):
            snap = checkpointing.snapshot(**run.parts(),
                                       state=state, classes=self.task.classes(), job_yaml=dump_yaml(self.cfg),
                                       hook_states=hook_states, buffers=self.buffers if reuse else None,
                                       overlap=self.cfg.checkpoint.async_save, metrics=metrics)
        if not self.cfg.checkpoint.async_save:
            with tempfile.TemporaryDirectory() as tmp:
                ckpt = ray.train.Checkpoint.from_directory(str(checkpoint.write(tmp, snap))) if snap else None
                upload = functools.partial(upload_manifest_last, step=snap.step) if snap else None
                ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_fn=upload)
        elif snap is None:
            ray.train.report(metrics)
        else:
            if reuse:
                self.buffers_free.clear()  # until the upload thread has written this snapshot
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tempfile.mkdtemp()),
                             checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                             checkpoint_upload_fn=self._write_then_upload(snap, self.buffers_free if reuse else None))
        self.copying = snap
        self.last_block_s = time.perf_counter() - t0

    @staticmethod
    def _write_then_upload(snap, written):
        """The upload function Ray Train calls in its upload thread: write the snapshot into the (empty) local
        checkpoint folder, free its buffers, then upload it (Ray deletes the local folder after)."""

        def write_then_upload(ckpt, dir_name):
            try:
                checkpoint.write(ckpt.path, snap)
            finally:
                if written is not None:
                    written.set()
            return upload_manifest_last(ckpt, dir_name, snap.step)

        return write_then_upload


def upload_manifest_last(ckpt, dir_name: str, step: int):
    """Copy a written checkpoint folder to the run's storage (local or URI) with its manifest last: Ray's own
    copy moves the files in parallel, so a copy cut short (the worker or node dies) could leave a manifest
    beside incomplete files. Uploaded this way, a folder in the run folder without a manifest is an upload
    that did not finish (restore_latest removes it), and one with a manifest has all its files."""
    import shutil

    import pyarrow.fs

    storage = ray.train.get_context().get_storage()
    held = tempfile.mkdtemp(prefix="manifest-")
    try:
        shutil.move(os.path.join(ckpt.path, checkpoint.MANIFEST), held)
        persisted = storage.persist_current_checkpoint(ckpt, dir_name)
        checkpoint.fault_injection_point(step)
        pyarrow.fs.copy_files(os.path.join(held, checkpoint.MANIFEST), f"{persisted.path}/{checkpoint.MANIFEST}",
                              source_filesystem=pyarrow.fs.LocalFileSystem(),
                              destination_filesystem=persisted.filesystem)
    finally:
        shutil.rmtree(held, ignore_errors=True)
    return persisted
