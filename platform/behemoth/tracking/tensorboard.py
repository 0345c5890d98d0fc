"""TensorBoard event files in RUN_FOLDER/tensorboard, written with torch.utils.tensorboard.

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


class TensorBoardLog:
    def __init__(self, run_dir: str, mirror_every_s: float = 30.0):
        self.target = paths.join(run_dir, FOLDER)
        self.local = Store(self.target).working_folder("behemoth-tb-")
        self.writer, self.group, self.mirror_every_s, self.mirrored = None, None, mirror_every_s, 0.0

    def log(self, metrics: dict, checkpoint: bool = False) -> None:
        from torch.utils.tensorboard import SummaryWriter

        step = metrics["step"]
        if metrics.get("group_id") != self.group:  # a worker group starts (or restarts from a checkpoint)
            self.close()
            self.group = metrics.get("group_id")
            self.writer = SummaryWriter(self.local, purge_step=metrics.get("resumed_from_step", 0) + 1)
        for tag, value in scalar_tags(metrics).items():
            self.writer.add_scalar(tag, value, step, walltime=metrics.get("wall_time"))
        if checkpoint or time.time() - self.mirrored > self.mirror_every_s:
            self.writer.flush()
            self.mirror()

    def log_final(self, step: int, values: dict[str, float]) -> None:
        """Scalars of the whole run (the goodput account), at its last step."""
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(self.local) as writer:
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
