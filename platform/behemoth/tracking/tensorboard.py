"""TensorBoard event files in RUN_FOLDER/tensorboard: scalars, the events torch.utils.tensorboard's
SummaryWriter writes, written with TensorBoard's own event writer (ScalarWriter).

A worker group that starts from a checkpoint opens a new event file with `purge_step` = the first step it
trains: TensorBoard hides what the failed group logged for the steps trained again, so each step shows once.
Under a URI (s3://...) the files are written to a local folder and copied to the run folder through
pyarrow's filesystem at every checkpoint and when the run ends; `finish` removes that local folder.
"""

from __future__ import annotations

import os
import shutil
import time

from behemoth.storage import paths
from behemoth.storage.store import Store

FOLDER = "tensorboard"
# Report keys that are bookkeeping, not curves.
_NOT_SCALARS = {"step", "total_steps", "wall_time", "time", "invocation", "eta_s", "samples_seen", "group_id",
                "resumed_from_step", "micro_batch_size", "grad_accum_steps", "model_tflops_per_sample"}
_SECTIONS = {"loss": "train", "lr": "train", "epoch": "train", "grad_norm": "train", "skipped_steps": "train",
             "samples_per_s": "speed", "tokens_per_s": "speed",
             "data_wait_frac": "speed", "mfu": "speed", "tflops_per_worker": "speed", "peak_mem_gb": "memory",
             "checkpoint_block_s": "checkpoint", "checkpoint_snapshot_s": "checkpoint",
             "checkpoint_report_s": "checkpoint", "checkpoint_write_cpu_s": "checkpoint", "checkpoint_write_s": "checkpoint",
             "checkpoint_interval_steps": "checkpoint", "eval_s": "evaluation", "world_size": "cluster",
             "bad_samples": "data"}


def scalar_tags(metrics: dict) -> dict[str, float]:
    """A report's curves, named by section (train/loss, val/accuracy, speed/samples_per_s, ...)."""
    out = {}
    for key, value in metrics.items():
        if (key in _NOT_SCALARS or key.startswith(("mark_", "time_")) or isinstance(value, bool)
                or not isinstance(value, (int, float))):
            continue
        if key.startswith("val_"):
            out[f"val/{key[4:]}"] = float(value)
        else:
            out[f"{_SECTIONS.get(key, 'other')}/{key}"] = float(value)
    return out


class ScalarWriter:
    """torch.utils.tensorboard.SummaryWriter's events for scalars (add_scalar's old-style simple_value, and
    purge_step's file-version and session-start events), written with the tensorboard package's EventFileWriter,
    which SummaryWriter itself writes with. This runs in Ray Train's controller, which imports no torch otherwise:
    torch.utils.tensorboard would import it (1.5-2 s of a CPU during the run; tensorboard's writer: 0.4 s)."""

    def __init__(self, log_dir: str, purge_step: int | None = None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary  # (add_scalar's, ~20 a report)
        self._events = EventFileWriter(str(log_dir), 10, 120, "")  # SummaryWriter's defaults
        if purge_step is not None:
            self._add(Event(step=purge_step, file_version="brain.Event:2"))
            self._add(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _add(self, event, walltime: float | None = None) -> None:
        event.wall_time = time.time() if walltime is None else walltime
        self._events.add_event(event)

    def add_scalar(self, tag: str, value: float, step: int, walltime: float | None = None) -> None:
        value = self._summary.Value(tag=tag, simple_value=float(value))
        self._add(self._event(step=int(step), summary=self._summary(value=[value])), walltime)

    def flush(self) -> None:
        self._events.flush()

    def close(self) -> None:
        self._events.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorBoardLog:
    def __init__(self, run_dir: str, mirror_every_s: float = 30.0):
        self.target = paths.join(run_dir, FOLDER)
        self.local = Store(self.target).working_folder("behemoth-tb-")
        self.writer, self.group, self.mirror_every_s, self.mirrored = None, None, mirror_every_s, 0.0

    def log(self, metrics: dict, checkpoint: bool = False) -> None:
        step = metrics["step"]
        if metrics.get("group_id") != self.group:  # a worker group starts (or restarts from a checkpoint)
            self.close()
            self.group = metrics.get("group_id")
            self.writer = ScalarWriter(self.local, purge_step=metrics.get("resumed_from_step", 0) + 1)
        for tag, value in scalar_tags(metrics).items():
            self.writer.add_scalar(tag, value, step, walltime=metrics.get("wall_time"))
        if checkpoint or time.time() - self.mirrored > self.mirror_every_s:
            self.writer.flush()
            self.mirror()

    def log_final(self, step: int, values: dict[str, float]) -> None:
        """Scalars of the whole run (the goodput account), at its last step."""
        with ScalarWriter(self.local) as writer:
            for tag, value in values.items():
                writer.add_scalar(tag, value, step)
        self.finish()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self.mirror()

    def finish(self) -> None:
        """Close, copy the event files to the run folder (under a URI) and remove the local copies, which would
        otherwise stay in the temp directory after every run on a URI."""
        try:
            if self.writer is not None:
                self.close()  # copies the files
            else:
                self.mirror()
        finally:
            if self.local != self.target:
                shutil.rmtree(self.local, ignore_errors=True)

    def mirror(self) -> None:
        self.mirrored = time.time()
        if self.local == self.target or not os.path.isdir(self.local):
            return
        Store(self.target).put_folder(self.local)
