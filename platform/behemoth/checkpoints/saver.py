"""Worker side: saving checkpoints through the run's report (synchronously, or with only a snapshot in the
step's way), and uploading them to the run's storage with the manifest last. The host (Ray Train, or a
sweep's lane) is reached through hosts/."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import threading
import time
import uuid

from behemoth.storage import checkpoint
from behemoth.storage.checkpoint import TrainState
from behemoth.storage.run_store import CheckpointWrite, RunStore
from behemoth.config import JobConfig, dump_yaml
from behemoth.errors import StorageFullError
from behemoth.metrics import PhaseClock
from behemoth import hosts
from behemoth.hosts import faults
from behemoth.checkpoints import live_state
from behemoth.hosts.collectives import gather_to_rank0
from behemoth.checkpoints.trainables import Trainables
from behemoth.checkpoints.sharded import ShardedWriter
from behemoth.models.wrappers import is_sharded


class CheckpointSaver:
    """Checkpoints through the run's report, from rank 0 (DDP keeps the ranks identical: one copy of the state
    is the whole state; FSDP gathers the full state on rank 0).

    With checkpoint.async_save the step waits only for a host-memory snapshot of the state, and under DDP
    only for part of it: the parameters and optimizer state are copied while the next step's forward and
    backward run, and that step waits for the copy before its optimizer update (`before_update`). Writing
    the files, the manifest and the upload run in the host's upload thread (Ray Train's CheckpointUploadMode.ASYNC,
    which still registers checkpoints in report order; a lane's own). `block_metrics()`: how long the last
    checkpoint held the training loop (at the report, and before the next update), reported with the next
    metrics.
    """

    def __init__(self, cfg: JobConfig, rank: int, task_files: dict[str, str | bytes], clock: PhaseClock | None = None):
        self.cfg, self.rank, self.clock = cfg, rank, clock
        # Task.checkpoint_files and kept_files (texts, bytes): the same in every checkpoint of the run
        self.task_files = task_files
        # the job.yaml every checkpoint carries: the run's config does not change, and dumping it at each
        # checkpoint was most of the loop's hold for a small model (1.8 of 2.6 ms, the storm's LM)
        self.job_yaml = dump_yaml(cfg)
        # checkpoint.format sharded: every rank writes its own shards (checkpoints/sharded.py), nothing gathered
        self.writer = ShardedWriter(rank) if cfg.checkpoint.sharded(cfg.scaling.strategy) else None
        # How long the last checkpoint held the loop (None before the first): in all, and split into the
        # snapshot (the copy to host memory, with the wait before the next update) and the report's own wait.
        self.last_block_s = self.last_snapshot_s = self.last_report_s = None
        self.buffers = HostBuffers()  # where the snapshots are copied to, two sets reused in turn
        self.copying = None  # the last snapshot while its copy may still read the live state
        self.rescue = None  # the loop's rescue checkpoint (checkpoints/rescue.py Rescue), told of each update

    def before_update(self) -> None:
        """Called before every optimizer update: the snapshot's copy of the state must be complete."""
        if self.rescue is not None:
            self.rescue.updating()
        if self.copying is not None:
            t0 = time.perf_counter()
            self.copying.wait_sources_free()
            self.copying = None
            waited = time.perf_counter() - t0
            self.last_block_s += waited
            self.last_snapshot_s += waited
            if self.clock is not None:
                self.clock.add("checkpoint", waited)

    def write_s(self) -> float | None:
        """How long the latest finished background write took (None: none yet, or the writes are not in the
        background): checkpoint.every_n_steps auto spaces checkpoints at least that far apart, so that a
        snapshot never waits for both buffer sets."""
        return self.buffers.last_write_s()

    def block_metrics(self) -> dict:
        """The last checkpoint's hold on the loop, for the next report."""
        if self.last_block_s is None:
            return {}
        out = {"checkpoint_block_s": self.last_block_s, "checkpoint_snapshot_s": self.last_snapshot_s,
               "checkpoint_report_s": self.last_report_s,
               "checkpoint_write_cpu_s": self.buffers.totals.get("cpu_s", 0.0)}  # (this group's, in all)
        if self.write_s() is not None:  # the latest background write's wall time (what a notice's drain must hold)
            out["checkpoint_write_s"] = self.write_s()
        return out

    def write_cpu_s(self) -> float | None:
        """The CPU seconds the latest finished background write spent (None: none yet): on a worker that trains
        on its CPU they were taken from training (the write and the step share the cores)."""
        return self.buffers.last_write_cpu_s()

    def save_and_report(self, metrics: dict, state: TrainState, run: Trainables, sync: bool = False,
                        sender=None) -> None:
        """`sync`: written before this returns, whatever checkpoint.async_save says (a preemption's: the node
        may be gone soon). `sender` (the reporting thread's: submit, flush): an asynchronous full checkpoint's
        report is handed to it, in order after the reports before it, so the step waits for the snapshot alone,
        not for the ranks' report barrier or the previous checkpoint's upload that Ray Train's report waits for;
        any other is sent here once the reports before it have gone."""
        t0 = time.perf_counter()
        in_background = self.cfg.checkpoint.async_save and not sync
        hook_states = gather_to_rank0(run.hook_state.to_bytes()) if run.hook_state is not None else None
        if self.writer is not None:
            reported = self._save_sharded(metrics, state, run, hook_states, sender)
            self._held(t0, reported)
            return
        snap = pool = written = None
        if self.rank == 0 or is_sharded(run.model):
            # (FSDP's full state is gathered into buffers of its own; only a rank that writes takes a set: one
            # whose snapshot is None would never hand it back)
            if in_background and not is_sharded(run.model):
                pool, written = self.buffers.take()
            snap = live_state.snapshot(**run.parts(), state=state, task_files=self.task_files,
                                          job_yaml=self.job_yaml, hook_states=hook_states, buffers=pool,
                                          overlap=in_background, metrics=metrics)
        reported = time.perf_counter()
        if snap is None:
            call = functools.partial(send_report, metrics)
        elif not in_background:
            call = functools.partial(send_report, metrics, functools.partial(write_checkpoint, snap))
        else:
            call = functools.partial(send_report, metrics, functools.partial(write_checkpoint, snap, written=written),
                                     async_upload=True)
        if sender is not None and in_background:
            sender.submit(call)
        else:
            if sender is not None:
                sender.flush()
            call()
        self.copying = snap
        self._held(t0, reported)
        if not in_background and self.rescue is not None:  # (written once the report returned)
            self.rescue.saved_step = state.step

    def _held(self, started: float, reported: float) -> None:
        now = time.perf_counter()
        self.last_block_s, self.last_snapshot_s, self.last_report_s = now - started, reported - started, now - reported

    def _save_sharded(self, metrics: dict, state: TrainState, run: Trainables, hook_states, sender=None) -> float:
        """Every rank starts writing its shards (the step waits for their copy to host memory), straight into
        the run folder on local storage or into a local staging folder uploaded by each rank for a URI; the
        commit (hashes, manifest by rank 0) runs in the host's upload thread, or here without async_save."""
        self.writer.wait()  # the previous checkpoint is committed: its collectives are over
        ctx = hosts.current()
        name = self.writer.agree(ctx.new_checkpoint_name())
        target = run_store().writing(name)
        written, self.copying = self.writer.start(run.model, run.optimizer, target.folder,
                                                  overlap=self.cfg.checkpoint.async_save)
        small = None
        if self.rank == 0:
            dicts, texts = live_state.extras(scheduler=run.scheduler, scaler=run.scaler, state=state,
                                                task_files=self.task_files, job_yaml=self.job_yaml,
                                                hook_states=hook_states, metrics=metrics)
            small = checkpoint.Snapshot(dicts, texts, state.step)
        commit = functools.partial(_commit_sharded, self.writer, written, target, small, state.step,
                                   self.writer.last_bytes)
        reported = time.perf_counter()
        if sender is not None:  # (the reports before it go first)
            sender.flush()
        send_report(metrics, commit, async_upload=self.cfg.checkpoint.async_save, dir_name=name)
        return reported


class Written(threading.Event):
    """A set of host buffers' event: set by the write once it has read them; when it was taken and set, and
    the CPU seconds the write's thread spent until then (`cpu_s`, set by the write)."""

    def __init__(self, totals: dict | None = None):
        super().__init__()
        self.taken: float | None = None
        self.done: float | None = None
        self.cpu_s: float | None = None
        self.totals = totals if totals is not None else {}

    def set(self) -> None:
        self.done = time.perf_counter()
        if self.cpu_s is not None:
            self.totals["cpu_s"] = self.totals.get("cpu_s", 0.0) + self.cpu_s
        super().set()


class HostBuffers:
    """Two sets of host buffers (pinned for a GPU's tensors) that snapshots copy into, each reused once the
    write of the snapshot in it is done: allocating and page-faulting the whole state again costs as much as
    the copy itself (pinned memory more). A checkpoint takes the set used last where its write is done (so a
    run whose writes keep up holds one set), the other set where it is still being written; with both being
    written, it waits for the older write (bounded host memory: twice the state). A write the host dropped
    (its run failing) never hands its set back: after `wait_s` the checkpoint takes fresh buffers of its own
    instead of waiting for ever."""

    def __init__(self, wait_s: float = 120.0):
        self.totals: dict = {}  # the CPU seconds of every finished write ("cpu_s")
        self.sets = [({}, Written(self.totals)), ({}, Written(self.totals))]
        for _, free in self.sets:
            free.set()
        self.turn = 0  # the set taken longest ago: the one to wait for when both are in use
        self.wait_s = wait_s

    def last_write_s(self) -> float | None:
        """How long the latest finished write held its set (snapshot to the files read), or None: none yet."""
        done = [free for _, free in self.sets if free.taken is not None and free.is_set()]
        latest = max(done, key=lambda free: free.done, default=None)
        return None if latest is None else latest.done - latest.taken

    def last_write_cpu_s(self) -> float | None:
        """The CPU seconds the latest finished write spent (None: none yet)."""
        done = [free for _, free in self.sets if free.cpu_s is not None and free.is_set()]
        latest = max(done, key=lambda free: free.done, default=None)
        return None if latest is None else latest.cpu_s

    def take(self) -> tuple[dict, threading.Event]:
        """(a set of buffers, the event the write sets once it has read them)."""
        for i in (1 - self.turn, self.turn):  # the set used last first: its buffers exist
            buffers, free = self.sets[i]
            if free.is_set():
                break
        else:
            buffers, free = self.sets[self.turn]
            if not free.wait(self.wait_s):
                return {}, threading.Event()  # kept by no one: freed with the snapshot
            i = self.turn
        free.clear()
        free.taken, free.cpu_s = time.perf_counter(), None
        self.turn = 1 - i
        return buffers, free


def send_report(metrics: dict, upload_fn=None, *, async_upload: bool = False, dir_name: str | None = None) -> None:
    """The one report of the worker room (hosts.current().report): the metrics, and with `upload_fn` a
    checkpoint that it writes (the host hands it a new empty folder, which an object store's upload stages in,
    and the checkpoint's place), in the host's upload thread where `async_upload`. `dir_name`: the checkpoint's
    folder name, agreed by the ranks."""
    folder = upload = None
    if upload_fn is not None:
        # The folder exists only while its upload runs (the report names it, and nothing is made of it before
        # the upload): an asynchronous upload the host drops because the run failed first never runs, and a
        # folder made here would stay in the temp directory.
        folder = os.path.join(tempfile.gettempdir(), f"behemoth-report-{uuid.uuid4().hex}")

        def upload(ckpt, name):
            # It goes when its upload ends, failed or not: Ray Train would remove it only after a success
            os.makedirs(folder, mode=0o700, exist_ok=True)
            try:
                return upload_fn(ckpt, name)
            finally:
                shutil.rmtree(folder, ignore_errors=True)

    try:
        hosts.current().report(metrics, upload, folder=folder, dir_name=dir_name, async_upload=async_upload)
    finally:
        if folder and not async_upload:  # (an asynchronous upload may still be running: it removes the folder)
            shutil.rmtree(folder, ignore_errors=True)


def run_store() -> RunStore:
    """This run's checkpoints, where the host keeps them."""
    return RunStore(*hosts.current().storage())


def _commit_sharded(writer: ShardedWriter, written, target: CheckpointWrite, small, step: int, needed: int,
                    ckpt, dir_name: str):
    """The upload function of a sharded checkpoint (the host's upload thread with async_save): `commit_sharded`
    into this run's storage. (send_report removes `ckpt`, its empty checkpoint folder.)"""
    commit_sharded(writer, written, target, small, step, needed)
    return hosts.current().checkpoint_at(target.dest, target.store.fs)


def commit_sharded(writer: ShardedWriter, written, target: CheckpointWrite, small, step: int, needed: int) -> None:
    """Commit a sharded checkpoint (ShardedWriter.commit) written into `target.folder`: the checkpoint itself, or
    a local staging folder whose files each rank uploads (rank 0 the manifest last), as the run store decides. A
    full disk on any rank fails every rank's commit (DCP shares its write errors): each removes what it wrote and
    raises one StorageFullError (not retried) naming the folder; the checkpoints before it are untouched."""
    try:
        writer.commit(written, target.folder, small, target.upload)
    except Exception as e:
        if not checkpoint.is_disk_full(e):
            raise
        target.abandon()
        raise StorageFullError(_disk_full_message(step, needed, target.folder, target.store.path,
                                                  " for this rank's shards")) from None
    finally:
        target.clean()


def write_checkpoint(snap, ckpt, dir_name: str, written: threading.Event | None = None):
    """The upload function the host calls (in its upload thread when saving asynchronously): `store` into
    this run's storage."""
    return store(snap, ckpt, dir_name, run_store(), written)


def store(snap, ckpt, dir_name: str, run: RunStore, written: threading.Event | None = None):
    """Write the snapshot as checkpoint `dir_name` of the run store `run` and return it as the host's
    checkpoint; `written` is set once the snapshot's buffers have been read. `ckpt`: the host's empty local
    folder for it (or None), where the store stages files it uploads.

    The store decides where the files go (run_store.CheckpointWrite): straight into the run folder on a local
    disk or shared mount (the checkpoint needs its own size on disk once, not twice), or staged locally and
    uploaded to an object store, the manifest last either way. A full disk, at either place, removes what this
    checkpoint wrote and raises one StorageFullError (not retried) naming the folder and the space needed; the
    checkpoints before it are untouched."""
    target = run.writing(dir_name, staging=None if ckpt is None else ckpt.path,
                         before_manifest=functools.partial(faults.kill_in_upload, snap.step))
    cpu_began = time.thread_time()
    try:
        try:
            target.write(snap, after_file=functools.partial(faults.disk_full, snap.step))
        finally:
            if written is not None:
                written.cpu_s = time.thread_time() - cpu_began
                written.set()
        host = hosts.current()
        return target.finish(host.persist, host.checkpoint_at)
    except Exception as e:  # a full disk can arrive as torch's RuntimeError
        if not checkpoint.is_disk_full(e):
            raise
        target.abandon()
        if ckpt is not None:
            shutil.rmtree(ckpt.path, ignore_errors=True)  # (the host's empty folder, where the files went in place)
        raise StorageFullError(_disk_full_message(snap.step, checkpoint.snapshot_bytes(snap), target.folder,
                                                  run.path)) from None
    finally:
        target.clean()


def _disk_full_message(step: int, needed: int, where: str, run_path: str, needed_for: str = "") -> str:
    folder = os.path.dirname(where)
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free if folder else None
    staged = "" if where.startswith(run_path) else " (the local staging folder of an upload: TMPDIR)"
    return (f"the checkpoint of step {step} did not fit: no space left on the device of {folder}{staged}; "
            f"it needs about {_mb(needed)}{needed_for}, "
            f"{_mb(free) if free is not None else 'an unknown amount'} is free. What it had written is removed; "
            f"the run's earlier checkpoints in {run_path} are untouched. Free space there (or point "
            f"checkpoint.storage_path at a larger disk), then rerun the same command: it resumes from the "
            f"latest checkpoint")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
