"""Driver side: a checked job config -> Ray Train TorchTrainer -> fit -> a summary. Never touches CUDA.

The data is checked by its task before Ray starts (Task.check), so a missing folder, an empty class or a
file without its column fails in a second with a message naming it, not after a cluster has been brought up;
once Ray is up the task prepares what the workers read (Task.prepare: e.g. text tokenised and packed by Ray
Data) before the workers start.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import yaml

from behemoth import paths
from behemoth.config import JobConfig
from behemoth.driver import ray_session
from behemoth.driver.stale_requests import withdraw_killed_drivers_requests
from behemoth.errors import CheckpointError, ConfigError, RunFailedError, user_facing_error
from behemoth.metrics import logged_reports
from behemoth.tasks import task_of


@dataclass
class RunSummary:
    run_dir: str
    metrics: dict  # the last reported metrics
    latest_checkpoint: str | None
    best_checkpoint: str | None  # best by the task's `best` metric among the kept ones
    best_value: float | None
    best_metric: str
    wall_s: float
    resumed_from_step: int = 0  # 0: this invocation started from scratch
    peak_source: str | None = None  # where the MFU's peak came from (or why there is no MFU)
    task_lines: list[str] = field(default_factory=list)  # the task's own lines (its final metrics)
    goodput: object = None  # tracking.goodput.Account over every invocation of the run, or None
    report: str | None = None  # report.html, if written
    tensorboard: bool = False

    def lines(self) -> list[str]:
        m = self.metrics
        out = [f"run folder:        {self.run_dir}", *self.task_lines]
        resumed = f", resumed from step {self.resumed_from_step}" if self.resumed_from_step else ""
        out.append(f"steps:             {m.get('step')} ({m.get('samples_seen')} samples{resumed})")
        if "tflops_per_worker" in m:
            mfu = f"MFU {m['mfu']:.1%}; " if "mfu" in m else ""
            out.append(f"model speed:       {m['tflops_per_worker']:.3g} TFLOP/s per worker ({mfu}"
                       f"peak: {self.peak_source})")
        out.append(f"latest checkpoint: {self.latest_checkpoint}")
        if self.best_checkpoint:
            out.append(f"best checkpoint:   {self.best_checkpoint} ({self.best_metric} {self.best_value:.4f})")
        out.append(f"wall time:         {self.wall_s:.1f} s")
        if self.goodput is not None:
            out.append(f"goodput:           {self.goodput.line()}")
            if self.goodput.startup_line():
                out.append(f"first step:        {self.goodput.startup_line()}")
        if self.tensorboard:
            out.append(f"tensorboard:       tensorboard --logdir {self.run_dir}")
        if self.report:
            out.append(f"report:            {self.report}")
        return out


def run_place(cfg: JobConfig) -> paths.RunPlace:
    """Where the job's run lives (its storage and checked name): every path of the run is joined through it."""
    return paths.RunPlace.of(cfg.checkpoint.storage_path, cfg.checkpoint.run_name)


def run_dir(cfg: JobConfig) -> str:
    """The job's run folder (local: absolute; or a URI)."""
    return run_place(cfg).folder


def worker_resources(cfg: JobConfig) -> dict:
    """What one training worker reserves (training and `behemoth eval` alike)."""
    resources = {"CPU": cfg.scaling.cpus_per_worker}
    if cfg.scaling.use_gpu:
        resources["GPU"] = cfg.scaling.gpus_per_worker
    return resources


def build_trainer(cfg: JobConfig, data, callbacks: list | None = None, fence=None):
    """`data`: what prepare_data returned (the task's prepared data: e.g. an image index). `callbacks`: Ray Train
    callbacks (the run's recorder, tracking/callbacks.py; a sweep's trial adds the one that reports to Tune).
    `fence` (runlock.Fence): the workers check the lease around each checkpoint upload (driver/lease_fence.py)
    and before a restore deletes an unfinished upload (worker/restore.py)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig

    from behemoth.driver import failure_policy
    from behemoth.worker.loop import train_loop_per_worker

    failure_policy.install()  # a data or config error ends the run at once, without using max_failures
    ray_session.set_ray_train_env()
    resources = worker_resources(cfg)
    if fence is not None:
        from behemoth.driver.lease_fence import LeaseFenceCallback

        callbacks = [*(callbacks or []), LeaseFenceCallback(fence)]
    return ray_session.torch_trainer(
        train_loop_per_worker,
        # The data travels once through the object store, not pickled into every worker's config.
        train_loop_config={"job": cfg.to_dict(), "data_ref": ray.put(data), "fence": fence},
        scaling_config=ScalingConfig(
            num_workers=tuple(cfg.scaling.num_workers) if cfg.scaling.elastic else cfg.scaling.num_workers,
            use_gpu=cfg.scaling.use_gpu, resources_per_worker=resources,
            elastic_resize_monitor_interval_s=cfg.scaling.elastic_resize_interval_s,
        ),
        run_config=RunConfig(
            name=run_place(cfg).name,
            storage_path=run_place(cfg).storage,
            failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
            callbacks=list(callbacks or []),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            # Ray Train's per-report INFO lines would bury behemoth's progress lines.
            logging_config=LoggingConfig(log_level="WARNING"),
            # merged with the job's runtime env (its py_modules stay)
            worker_runtime_env={"env_vars": ray_session.worker_env_vars()},
        ),
    )


# Keys that may change between a run and its resumption: they change speed or bookkeeping, not what is learnt.
_RESUMABLE_CHANGES = {"data.prefetch_batches", "data.cpus_per_task", "data.max_bad_samples"}


def _latest_checkpoint(cfg: JobConfig) -> tuple[str, str] | None:
    """(the run's latest complete checkpoint, its folder name), or None for a new run."""
    from behemoth.checkpoint import complete_checkpoints

    kept = complete_checkpoints(run_dir(cfg))
    return (kept[0][1], kept[0][1].rstrip("/").rpartition("/")[2]) if kept else None


def check_resume_compatible(cfg: JobConfig) -> None:
    """Refuse to resume a run whose latest checkpoint (local or under a URI) was trained on another data or
    model config. (A change of scaling.strategy is fine: either checkpoint layout loads under DDP and FSDP.)"""
    from behemoth.checkpoint import read_file

    latest = None if cfg.checkpoint.resume_changed_config else _latest_checkpoint(cfg)
    if latest is None:
        return
    latest, name = latest
    folder = run_dir(cfg)
    before = yaml.safe_load(read_file(f"{latest}/job.yaml")) or {}
    now = cfg.to_dict()
    changed = [f"{section}.{key}: {before.get(section, {}).get(key)!r} -> {value!r}"
               for section in ("data", "model") for key, value in now[section].items()
               if before.get(section, {}).get(key) != value and f"{section}.{key}" not in _RESUMABLE_CHANGES]
    if changed:
        raise ConfigError(
            f"run '{cfg.checkpoint.run_name}' in {folder} was trained with a different config "
            f"({name}): {'; '.join(changed)}. Start a new run with another "
            f"checkpoint.run_name, or resume anyway with --set checkpoint.resume_changed_config=true"
        )


def check_resume_data(cfg: JobConfig, prepared) -> None:
    """Refuse to resume a run whose data now says something else of what its weights mean: the task's files
    in the latest checkpoint (classes.json: class index -> name) differ from those this data gives. The data
    config can be unchanged while its content is not: a class folder renamed or replaced keeps the count and
    moves names to other indices, so the resumed run would train on with its labels silently renamed (a class
    added or removed changes the head's shape: its weights cannot load)."""
    from behemoth.checkpoint import complete_checkpoints

    kept = [] if cfg.checkpoint.resume_changed_config else complete_checkpoints(run_dir(cfg))
    for _, ckpt in kept:  # newest first; one whose task files fail their manifest is damaged: restore skips it
        try:
            differs = task_files_differ(cfg, prepared, ckpt)
            break
        except CheckpointError:
            continue
    else:
        return
    if differs:
        what, same_shape = differs
        force = (", or resume anyway with --set checkpoint.resume_changed_config=true" if same_shape else
                 " (its weights cannot resume with another number of classes)")
        name = ckpt.rstrip("/").rpartition("/")[2]
        raise ConfigError(
            f"run '{cfg.checkpoint.run_name}' in {run_dir(cfg)} was trained on other data ({name}): {what}. "
            f"Start a new run with another checkpoint.run_name (train.init_from the old run's folder to start "
            f"from its weights){force}")


def task_files_differ(cfg: JobConfig, prepared, ckpt: str) -> tuple[str, bool] | None:
    """How checkpoint `ckpt`'s task files (Task.checkpoint_files) differ from those `prepared` gives, and
    whether their lists keep their length; None where they agree or the checkpoint keeps none (written before
    the task kept them, or a Hugging Face folder). Each is checked against the manifest first: a damaged or
    edited one raises CheckpointError naming it (compared as it is, it would read as other data)."""
    from behemoth import weights
    from behemoth.checkpoint import read_manifest, read_manifest_bytes, read_verified

    ckpt = ckpt.rstrip("/")
    if not weights.is_checkpoint(ckpt):
        return None
    manifest = read_manifest(read_manifest_bytes(ckpt, None, ckpt), ckpt)
    for file, text in task_of(cfg).checkpoint_files(cfg, prepared).items():
        if file not in manifest["files"]:
            continue
        before = read_verified(ckpt, file, manifest=manifest).decode()
        if before == text:
            continue
        try:
            old, new = json.loads(before), json.loads(text)
        except ValueError:
            old = new = None
        if not (isinstance(old, list) and isinstance(new, list)):
            return f"its {file} differs from this data's", False
        if old == new:
            continue  # the same list, written another way
        moved = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        detail = [f"its {file} lists {len(old)}, this data {len(new)}"]
        if moved < min(len(old), len(new)):
            detail.append(f"index {moved} was {old[moved]!r}, is {new[moved]!r}")
        for label, names in (("new", [n for n in new if n not in old]), ("gone", [n for n in old if n not in new])):
            if names:
                detail.append(f"{label}: {', '.join(map(repr, names[:5]))}{' ...' if len(names) > 5 else ''}")
        return "; ".join(detail), len(old) == len(new)
    return None


def resolve_init_from(cfg: JobConfig) -> JobConfig:
    """train.init_from -> the one folder its weights come from (a run folder: its best or latest checkpoint),
    chosen once here so that every worker, and every restart, starts from the same weights; the run's
    checkpoints record the chosen folder in their job.yaml."""
    import dataclasses

    from behemoth import weights
    from behemoth.checkpoint import complete_checkpoints

    source = cfg.train.init_from
    if not source:
        return cfg
    chosen, how = weights.resolve(source, cfg.train.init_from_checkpoint, task_of(cfg).best)
    weights.check(chosen)  # damage it can see without the weights fails here, before Ray starts
    folder = run_dir(cfg)
    if complete_checkpoints(folder):
        print(f"[behemoth] train.init_from is set, but run '{cfg.checkpoint.run_name}' has checkpoints of its own: "
              f"it resumes from them (init_from decides only how a run starts)", flush=True)
    else:
        print(f"[behemoth] init_from {source}: {chosen} ({how})", flush=True)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=chosen))


def train(cfg: JobConfig, callbacks: list | None = None, lock: bool = True, process_start: float | None = None,
          parent_mlflow_run: str | None = None, end_ray: bool = False, fence=None) -> RunSummary:
    """Run (or resume, if the run name already has checkpoints) one training job. Blocks until it ends.
    `lock`: hold the run folder's lease (driver/runlock.py); a sweep's trial runs under its sweep's, whose
    `fence` (runlock.Fence) it checks before registering or deleting checkpoints, as a run checks its own.
    `process_start`: when this process started (the command line's), where the goodput account's start-up
    begins (default: this call). `parent_mlflow_run`: a sweep's MLflow run, under which this one nests.
    `end_ray`: shut Ray down as soon as the run ends (the command line, whose process ends with the run: Ray's
    shutdown, seconds of it, then runs beside the run's last records instead of after them)."""
    from behemoth.tracking.run import RunTracking

    tracking = RunTracking(cfg, run_dir(cfg), process_start, parent_mlflow_run)
    if not lock:
        return _train(cfg, callbacks, tracking, end_ray, fence)
    from behemoth.driver.runlock import RunLock

    with RunLock(run_dir(cfg), f"run '{cfg.checkpoint.run_name}'") as held:
        return _train(cfg, callbacks, tracking, end_ray, held.fence())


def _train(cfg: JobConfig, callbacks: list | None, tracking, end_ray: bool = False, fence=None) -> RunSummary:
    check_resume_compatible(cfg)
    cfg = resolve_init_from(cfg)
    started = time.time()
    data = prepare_data(cfg, tracking.mark)
    check_resume_data(cfg, data)
    from ray.train import TrainingFailedError

    withdraw_killed_drivers_requests(tracking.run_dir, tracking.invocation)
    trainer = build_trainer(cfg, data, [*tracking.callbacks(), *(callbacks or [])], fence)
    ray_session.warm_up_data_processes(cfg, data)
    try:
        result = trainer.fit()
    except TrainingFailedError as e:
        ray_session.end_ray(end_ray)
        tracking.finish("failed")
        if user_facing_error(e) is not None:  # behemoth's own message (bad data, ...) says it better
            raise
        raise RunFailedError(_failure_message(cfg, e)) from e
    retire_unregistered(cfg, result.best_checkpoints or [], fence)
    summary = _summarise(cfg, result, time.time() - started)
    returned = result.return_value or {}
    # Ray's local shutdown (mostly waiting for its processes to end) and the run's last records (the report's
    # plots: CPU-bound) need nothing of each other and each take seconds: side by side, not one after the other.
    ending = threading.Thread(target=ray_session.end_ray, args=(end_ray,), name="behemoth-end-ray")
    ending.start()
    try:
        tracking.finish("finished", returned.get("clock"), returned.get("final_step"), summary.best_checkpoint)
    finally:
        ending.join()
    summary.goodput, summary.report = tracking.account, tracking.report_path
    summary.tensorboard = cfg.tracking.tensorboard
    return summary


def _failure_message(cfg: JobConfig, e: Exception) -> str:
    """What failed, what is kept, what to do: for a run whose worker group kept failing."""
    from behemoth.checkpoint import complete_checkpoints

    failures = getattr(e, "worker_failures", None) or {"controller": getattr(e, "controller_failure", e)}
    reasons = "; ".join(f"rank {rank}: {str(exc).strip().splitlines()[0]}" for rank, exc in failures.items())
    folder = run_dir(cfg)
    kept = complete_checkpoints(folder)
    latest = f" (latest at step {kept[0][0]}: {kept[0][1].rstrip('/').rpartition('/')[2]})" if kept else ""
    return (f"run '{cfg.checkpoint.run_name}' failed and failure.max_failures={cfg.failure.max_failures} restarts "
            f"are used up: {reasons}. Its checkpoints are kept in {folder}{latest}: rerun the same command to "
            f"resume from the latest, or allow more restarts with failure.max_failures")


def prepare_data(cfg: JobConfig, mark=lambda milestone: None):
    """The task checks its data (before Ray starts), Ray starts, the task prepares what the workers read.
    `mark`: called with each milestone's name (the goodput account's start-up detail)."""
    task = task_of(cfg)
    checked = task.check(cfg)
    mark("data_checked")
    ray_session.ensure_ray()
    mark("ray_ready")
    data = task.prepare(cfg, checked)
    mark("data_ready")
    return data


def retire_unregistered(cfg: JobConfig, kept: list, fence=None) -> list[str]:
    """Apply checkpoint.keep to the checkpoints Ray Train does not know: complete ones in the run folder that it
    never registered (a driver or worker died between their upload and their registration; a rerun resumed
    from them) and that are older than every checkpoint it keeps (`kept`: the finished run's
    (checkpoint, metrics)). Retention would have deleted them had Ray Train known them; without this they
    stay forever. Returns the folders removed. `fence`: the run lock's (runlock.Fence), checked first: a driver
    whose folder another driver took over removes nothing there."""
    from behemoth.checkpoint import complete_checkpoints, filesystem

    if fence is not None:
        fence.check("removing the checkpoints Ray Train never registered")

    place = run_place(cfg)
    kept_paths = {place.as_uri(c.path).rstrip("/") for c, _ in kept}
    found = complete_checkpoints(place.folder)
    kept_steps = [step for step, path in found if path.rstrip("/") in kept_paths]
    if not kept_steps:
        return []
    oldest_kept, removed = min(kept_steps), []
    for step, path in found:
        if step < oldest_kept and path.rstrip("/") not in kept_paths:
            fs, where = filesystem(path)
            fs.delete_dir(where)
            removed.append(path)
            print(f"[behemoth] removed {path} (step {step}): a checkpoint Ray Train never registered, older than "
                  f"the {len(kept_steps)} it keeps (checkpoint.keep)", flush=True)
    return removed


def _summarise(cfg: JobConfig, result, wall_s: float) -> RunSummary:
    task = task_of(cfg)
    key, mode = task.best
    scored = [(m[key], c.path) for c, m in (result.best_checkpoints or []) if key in m]
    best_value, best_path = (max(scored) if mode == "max" else min(scored)) if scored else (None, None)
    place = run_place(cfg)  # Ray gives paths on the storage's filesystem
    final = logged_reports(dict(result.metrics or {}))[-1]  # (not the logged steps it carries)
    return RunSummary(
        run_dir=place.folder,
        metrics=final,
        latest_checkpoint=place.as_uri(result.checkpoint.path if result.checkpoint else None),
        best_checkpoint=place.as_uri(best_path),
        best_value=best_value,
        best_metric=key,
        wall_s=wall_s,
        resumed_from_step=(result.return_value or {}).get("resumed_from_step", 0),
        peak_source=(result.return_value or {}).get("peak_source"),
        task_lines=task.summary_lines(final),
    )
