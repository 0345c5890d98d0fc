"""Worker side: choosing and loading the checkpoint a (re)started worker group continues from."""

from __future__ import annotations

import ray
import ray.train

from behemoth import checkpoint, weights
from behemoth.worker import checkpointing
from behemoth.checkpoint import TrainState
from behemoth.errors import CheckpointError
from behemoth.worker.console import console
from behemoth.worker.run import Run


def restore_latest(run: Run) -> TrainState | None:
    """Restore the newest checkpoint that passes verification into `run`; None for a fresh run.

    Candidates, newest first: complete checkpoints in the run folder newer than Ray Train's latest (written
    and uploaded, but the worker or driver died before Ray Train registered them), Ray Train's latest, then
    its earlier ones. A candidate that fails verification is skipped with a warning naming it.
    """
    latest = ray.train.get_checkpoint()
    candidates = [latest] if latest else []
    candidates += [r.checkpoint for r in reversed(ray.train.get_all_reported_checkpoints())
                   if latest is None or r.checkpoint.path != latest.path]
    registered = _step_of(latest)
    rank0 = ray.train.get_context().get_world_rank() == 0
    if rank0:
        _remove_partial_uploads({c.path for c in candidates})
    unregistered = [p for step, p in _run_folder_checkpoints() if step > registered]
    if unregistered and rank0:
        console(f"restoring from {unregistered[0]}: complete on disk, but not registered with Ray Train when "
                f"the run stopped")
    for ckpt in unregistered + candidates:
        try:
            if isinstance(ckpt, str):
                return checkpointing.load(ckpt, **run.parts(), hook_state=run.hook_state)
            with ckpt.as_directory() as d:
                return checkpointing.load(d, **run.parts(), hook_state=run.hook_state)
        except CheckpointError as e:
            console(f"WARNING: skipping checkpoint {getattr(ckpt, 'path', ckpt)}: {e}")
    if candidates:  # Ray Train had registered checkpoints and none passes: never silently start over
        tried = [getattr(c, "path", c) for c in unregistered + candidates]
        raise CheckpointError(f"no checkpoint of this run passes verification (tried {tried})")
    # Nothing registered: what failed were unregistered folders (an upload cut short by the failure, whose
    # manifest was copied before the rest). Nothing was committed yet, so the run starts from step 0.
    return None


def _step_of(latest) -> int:
    """The step of Ray's latest checkpoint, read even if the checkpoint is damaged (-1: none, unreadable)."""
    import os

    if latest and os.path.isdir(latest.path):
        try:
            return checkpoint.read_state(latest.path).step
        except (OSError, ValueError, TypeError):
            pass
    return -1


def _remove_partial_uploads(registered: set[str]) -> None:
    """Delete checkpoint folders of this run that have no manifest and that Ray Train never registered:
    uploads cut short by a failure (saver.upload_manifest_last puts the manifest last). No upload of this run
    is in flight while a worker group starts (the previous group is gone), so each one is dead."""
    storage = ray.train.get_context().get_storage()
    fs = storage.storage_filesystem
    for path, complete in checkpoint.checkpoint_folders(storage.experiment_fs_path, fs):
        if not complete and path not in registered:
            console(f"removing {path}: a checkpoint upload that did not finish (no manifest); it is never "
                    f"restored")
            fs.delete_dir(path)


def _run_folder_checkpoints() -> list[tuple[int, str]]:
    """Complete checkpoints in this run's folder, newest first. Local storage only: on a URI the registered
    checkpoints are all behemoth restores from."""
    import pyarrow.fs

    storage = ray.train.get_context().get_storage()
    if not isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem):
        return []
    return checkpoint.complete_checkpoints(storage.experiment_fs_path)


def load_init_from(model, cfg, task) -> str | None:
    """Fine-tuning: the weights of train.init_from (the driver resolved it to one folder) into a fresh run's
    model, before DDP/FSDP wraps it; only the weights (the optimizer, schedule and step start fresh). Skipped
    when the run has checkpoints of its own: it resumes from them. Returns the line to print, or None."""
    source = cfg.train.init_from
    if not source or ray.train.get_checkpoint() is not None or _run_folder_checkpoints():
        return None
    reinit = weights.load_weights(model, weights.read_state_dict(source), source, getattr(task, "reinit_ok", None))
    line = f"init_from {source}: weights loaded; optimizer, LR schedule and step start fresh"
    if reinit:
        shapes = model.state_dict()
        line += (f"; re-initialised for this data's classes: "
                 f"{', '.join(f'{k} {list(shapes[k].shape)}' for k in reinit)}")
    return line
