"""Driver side: Ray Train's launcher (a TorchTrainer's fit) behind the run sequence (driver/run/sequence.py),
and `train`, the Python API's and the command line's way into it. The driver's process never touches CUDA
(the workers do; a sweep's lane is a worker host: hosts/lane.py).

The data is checked by its task before Ray starts (Task.check), so a missing folder, an empty class or a
file without its column fails in a second with a message naming it, not after a cluster has been brought up;
once Ray is up the task prepares what the workers read (Task.prepare: e.g. text tokenised and packed by Ray
Data) before the workers start.
"""

from __future__ import annotations

import contextlib
import os
import threading

from behemoth.config import JobConfig
from behemoth.driver.ray_cluster import session as ray_session
from behemoth.driver.ray_cluster.stale_requests import withdraw_killed_drivers_requests
from behemoth.driver.run.resume import retention, run_dir, run_place
from behemoth.driver.run.sequence import Launched, PlannedRun, prepare_data, run_sequence, used_up
from behemoth.driver.run.summary import RunSummary
from behemoth.errors import ConfigError, RunFailedError, user_facing_error
from behemoth.hosts.state_keeper import start_keeper, stop_keeper


def worker_resources(cfg: JobConfig) -> dict:
    """What one training worker reserves (training and `behemoth eval` alike)."""
    resources = {"CPU": cfg.scaling.cpus_per_worker}
    if cfg.scaling.use_gpu:
        resources["GPU"] = cfg.scaling.gpus_per_worker
    return resources


def torch_trainer(cfg: JobConfig, loop, loop_config: dict, run_config: dict, num_workers=None):
    """A TorchTrainer running `loop` on the job's workers (training and `behemoth eval` alike): the job's
    resources per worker, Ray Train's quiet logging and the workers' environment; `run_config`: RunConfig's
    other settings (name, storage_path, ...); `num_workers`: default the job's (a (min, max) pair if elastic)."""
    from ray.train import LoggingConfig, RunConfig, ScalingConfig

    s = cfg.scaling
    if num_workers is None:
        num_workers = tuple(s.num_workers) if s.elastic else s.num_workers
    return ray_session.torch_trainer(
        loop, train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=s.use_gpu,
                                     resources_per_worker=worker_resources(cfg),
                                     elastic_resize_monitor_interval_s=s.elastic_resize_interval_s),
        run_config=RunConfig(
            # Ray Train's per-report INFO lines would bury behemoth's progress lines.
            logging_config=LoggingConfig(log_level="WARNING"),
            # merged with the job's runtime env (its py_modules stay)
            worker_runtime_env={"env_vars": ray_session.worker_env_vars()}, **run_config),
    )


def build_trainer(cfg: JobConfig, data, callbacks: list | None = None, fence=None, keeper=None):
    """`data`: what prepare_data returned (the task's prepared data: e.g. an image index). `callbacks`: Ray Train
    callbacks (the run's recorder, tracking/callbacks.py; a sweep's trial adds the one that reports to Tune).
    `fence` (runlock.Fence): the workers check the lease around each checkpoint upload (hosts/lease_fence.py)
    and before a restore deletes an unfinished upload (checkpoints/restore.py). `keeper`: the run's
    hosts.state_keeper.StateKeeper (checkpoint.memory_copy), None without one."""
    import ray
    from ray.train import FailureConfig

    from behemoth.driver.ray_cluster import failure_policy
    from behemoth.worker.loop import train_loop_per_worker

    # a data or config error ends the run at once, without using max_failures; failure.replacement_wait_s bounds
    # the wait for nodes
    failure_policy.install(cfg.failure.replacement_wait_s, elastic=cfg.scaling.elastic)
    ray_session.set_ray_train_env(elastic=cfg.scaling.elastic)
    if fence is not None:
        from behemoth.hosts.lease_fence import LeaseFenceCallback

        callbacks = [*(callbacks or []), LeaseFenceCallback(fence)]
    if cfg.checkpoint.rescue:  # a group stopped while it trains leaves its state (checkpoints/rescue.py)
        from behemoth.hosts.rescue_callback import RescueCallback

        callbacks = [*(callbacks or []), RescueCallback()]
    place = run_place(cfg)
    # The data travels once through the object store, not pickled into every worker's config; the config
    # travels typed (each worker unpickles it: parsed once, on the driver).
    return torch_trainer(cfg, train_loop_per_worker, {"job": cfg, "data_ref": ray.put(data), "fence": fence, "keeper": keeper}, dict(
        name=place.name, storage_path=place.storage, callbacks=list(callbacks or []),
        failure_config=FailureConfig(max_failures=cfg.failure.max_failures,
                                     max_preemption_failures=cfg.failure.max_preemptions,
                                     preemption_grace_s=cfg.failure.preemption_grace_s),
        checkpoint_config=retention(cfg)))


def _job(cfg) -> JobConfig:
    """train()'s job: a JobConfig, or the path of a job YAML (read as `behemoth train PATH` reads it); anything
    else one line (a path string failed with "'str' object has no attribute 'checkpoint'")."""
    if isinstance(cfg, JobConfig):
        return cfg
    if isinstance(cfg, (str, os.PathLike)):
        from behemoth.job import load_config

        return load_config(cfg)
    raise ConfigError(f"train() takes a JobConfig or a job YAML's path, got {type(cfg).__name__}: "
                      f"behemoth.train(behemoth.load_config(PATH, ['KEY=VALUE', ...]))")


def train(cfg: JobConfig | str | os.PathLike, callbacks: list | None = None, lock: bool = True, process_start: float | None = None,
          parent_mlflow_run: str | None = None, end_ray: bool = False, fence=None) -> RunSummary:
    """Run (or resume, if the run name already has checkpoints) one training job. Blocks until it ends.
    `lock`: hold the run folder's lease (storage/runlock.py); a sweep's trial runs under its sweep's, whose
    `fence` (runlock.Fence) it checks before registering or deleting checkpoints, as a run checks its own.
    `process_start`: when this process started (the command line's), where the goodput account's start-up
    begins (default: this call). `parent_mlflow_run`: a sweep's MLflow run, under which this one nests.
    `end_ray`: shut Ray down as soon as the run ends (the command line, whose process ends with the run: Ray's
    shutdown, seconds of it, then runs beside the run's last records instead of after them)."""
    from behemoth.tracking.invocation import RunTracking

    cfg = _job(cfg)
    tracking = RunTracking(cfg, run_dir(cfg), process_start, parent_mlflow_run)
    if not lock:
        return run_sequence(cfg, RayTrainLauncher(tracking, callbacks, end_ray, fence), tracking, fence)
    from behemoth.storage.runlock import RunLock

    with RunLock(run_dir(cfg), f"run '{cfg.checkpoint.run_name}'") as held:
        fence = held.fence()
        return run_sequence(cfg, RayTrainLauncher(tracking, callbacks, end_ray, fence), tracking, fence)


def keeps_copies(cfg: JobConfig) -> bool:
    """Whether the run starts a keeper for a lone worker's copies (checkpoint.memory_copy): an auto interval and a
    run that may train on one worker."""
    return cfg.checkpoint.memory_copy and cfg.checkpoint.every_n_steps == "auto" and cfg.scaling.min_workers == 1


class RayTrainLauncher:
    """A run through Ray Train: a TorchTrainer of the job's workers, fit once (Ray Train restarts the worker
    group after failures, failure.max_failures times). See sequence.Launcher."""

    def __init__(self, tracking, callbacks: list | None, end_ray: bool, fence):
        self.tracking, self.callbacks, self.end_ray, self.fence = tracking, list(callbacks or []), end_ray, fence

    def prepare(self, run: PlannedRun, mark):
        return prepare_data(run.cfg, mark, task=run.task)

    def launch(self, run: PlannedRun, data) -> Launched:
        from ray.train import TrainingFailedError

        withdraw_killed_drivers_requests(self.tracking.run_dir, self.tracking.invocation)
        keeper = start_keeper() if keeps_copies(run.cfg) else None
        trainer = build_trainer(run.cfg, data, [*self.tracking.callbacks(), *self.callbacks], self.fence, keeper)
        ray_session.warm_up_data_processes(run.cfg, data)
        try:
            with ray_session.elastic_view_refreshed(run.cfg.scaling.elastic):
                result = trainer.fit()
        except TrainingFailedError as e:
            stop_keeper(keeper)  # (before Ray may be shut down)
            ray_session.end_ray(self.end_ray)
            if user_facing_error(e) is not None:  # behemoth's own message (bad data, ...) says it better
                raise
            failures = getattr(e, "worker_failures", None) or {"controller": getattr(e, "controller_failure", e)}
            reasons = "; ".join(f"rank {rank}: {str(exc).strip().splitlines()[0]}" for rank, exc in failures.items())
            raise RunFailedError(used_up(run.cfg, reasons, "rerun the same command to resume from the latest, or "
                                                           "allow more restarts with failure.max_failures")) from e
        stop_keeper(keeper)
        return Launched(result.best_checkpoints or [], result, result.return_value or {})

    def records_failure(self, error: BaseException) -> bool:
        """The run failed (its restarts used up, or behemoth's own error): not the driver interrupted."""
        from ray.train import TrainingFailedError

        return isinstance(error, (TrainingFailedError, RunFailedError))

    @contextlib.contextmanager
    def ending(self):
        """Ray's local shutdown (mostly waiting for its processes to end) and the run's last records (the report's
        plots: CPU-bound) need nothing of each other and each take seconds: side by side, not one after the other."""
        ending = threading.Thread(target=ray_session.end_ray, args=(self.end_ray,), name="behemoth-end-ray")
        ending.start()
        try:
            yield
        finally:
            ending.join()
