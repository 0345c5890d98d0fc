"""Driver side: a checked job config -> Ray Train TorchTrainer -> fit -> a summary. The driver's process never
touches CUDA (the workers do; a sweep's lane is a worker host: hosts/lane.py).

The data is checked by its task before Ray starts (Task.check), so a missing folder, an empty class or a
file without its column fails in a second with a message naming it, not after a cluster has been brought up;
once Ray is up the task prepares what the workers read (Task.prepare: e.g. text tokenised and packed by Ray
Data) before the workers start.
"""

from __future__ import annotations

import threading
import time

from behemoth.config import JobConfig
from behemoth.driver.run import preflight
from behemoth.driver.ray_cluster import session as ray_session
from behemoth.driver.run.resume import (check_resume_compatible, check_resume_data, check_something_trained,
                                    describe_rerun, resolve_init_from, retention, retire_unregistered, run_dir,
                                    run_place)
from behemoth.driver.ray_cluster.stale_requests import withdraw_killed_drivers_requests
from behemoth.driver.run.summary import RunSummary, summarise
from behemoth.errors import RunFailedError, user_facing_error
from behemoth.tasks import task_of


def worker_resources(cfg: JobConfig) -> dict:
    """What one training worker reserves (training and `behemoth eval` alike)."""
    resources = {"CPU": cfg.scaling.cpus_per_worker}
    if cfg.scaling.use_gpu:
        resources["GPU"] = cfg.scaling.gpus_per_worker
    return resources


def build_trainer(cfg: JobConfig, data, callbacks: list | None = None, fence=None):
    """`data`: what prepare_data returned (the task's prepared data: e.g. an image index). `callbacks`: Ray Train
    callbacks (the run's recorder, tracking/callbacks.py; a sweep's trial adds the one that reports to Tune).
    `fence` (runlock.Fence): the workers check the lease around each checkpoint upload (hosts/lease_fence.py)
    and before a restore deletes an unfinished upload (checkpoints/restore.py)."""
    import ray
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig

    from behemoth.driver.ray_cluster import failure_policy
    from behemoth.worker.loop import train_loop_per_worker

    # a data or config error ends the run at once, without using max_failures; failure.replacement_wait_s bounds
    # the wait for nodes
    failure_policy.install(cfg.failure.replacement_wait_s)
    ray_session.set_ray_train_env()
    resources = worker_resources(cfg)
    if fence is not None:
        from behemoth.hosts.lease_fence import LeaseFenceCallback

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
            failure_config=FailureConfig(max_failures=cfg.failure.max_failures,
                                         max_preemption_failures=cfg.failure.max_preemptions),
            callbacks=list(callbacks or []),
            checkpoint_config=retention(cfg),
            # Ray Train's per-report INFO lines would bury behemoth's progress lines.
            logging_config=LoggingConfig(log_level="WARNING"),
            # merged with the job's runtime env (its py_modules stay)
            worker_runtime_env={"env_vars": ray_session.worker_env_vars()},
        ),
    )


def train(cfg: JobConfig, callbacks: list | None = None, lock: bool = True, process_start: float | None = None,
          parent_mlflow_run: str | None = None, end_ray: bool = False, fence=None) -> RunSummary:
    """Run (or resume, if the run name already has checkpoints) one training job. Blocks until it ends.
    `lock`: hold the run folder's lease (storage/runlock.py); a sweep's trial runs under its sweep's, whose
    `fence` (runlock.Fence) it checks before registering or deleting checkpoints, as a run checks its own.
    `process_start`: when this process started (the command line's), where the goodput account's start-up
    begins (default: this call). `parent_mlflow_run`: a sweep's MLflow run, under which this one nests.
    `end_ray`: shut Ray down as soon as the run ends (the command line, whose process ends with the run: Ray's
    shutdown, seconds of it, then runs beside the run's last records instead of after them)."""
    from behemoth.tracking.invocation import RunTracking

    tracking = RunTracking(cfg, run_dir(cfg), process_start, parent_mlflow_run)
    if not lock:
        return _train(cfg, callbacks, tracking, end_ray, fence)
    from behemoth.storage.runlock import RunLock

    with RunLock(run_dir(cfg), f"run '{cfg.checkpoint.run_name}'") as held:
        return _train(cfg, callbacks, tracking, end_ray, held.fence())


def _train(cfg: JobConfig, callbacks: list | None, tracking, end_ray: bool = False, fence=None) -> RunSummary:
    check_resume_compatible(cfg)
    rerun = describe_rerun(cfg)  # what changed keys do from the resume step, said before anything starts
    if rerun is not None:
        print(f"[behemoth] {rerun.line(cfg)}", flush=True)
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
    summary = summarise(cfg, result, time.time() - started)
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
    check_something_trained(cfg, rerun, summary)
    return summary


def _failure_message(cfg: JobConfig, e: Exception) -> str:
    """What failed, what is kept, what to do: for a run whose worker group kept failing."""
    from behemoth.storage.checkpoint import complete_checkpoints

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
    preflight.check_sources(cfg)
    checked = task.check(cfg)
    preflight.check_epoch(cfg, task.train_samples(cfg, checked))
    mark("data_checked")
    ray_session.ensure_ray()
    mark("ray_ready")
    data = task.prepare(cfg, checked)
    preflight.check_epoch(cfg, task.train_samples(cfg, data))  # (text: the blocks are known once packed)
    mark("data_ready")
    return data


