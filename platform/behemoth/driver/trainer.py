"""Driver side: a checked job config -> Ray Train TorchTrainer -> fit -> a summary. Never touches CUDA.

The data is checked by its task before Ray starts (Task.check), so a missing folder, an empty class or a
file without its column fails in a second with a message naming it, not after a cluster has been brought up;
once Ray is up the task prepares what the workers read (Task.prepare: e.g. text tokenised and packed by Ray
Data) before the workers start.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from behemoth import paths
from behemoth.config import JobConfig
from behemoth.driver.stale_requests import withdraw_killed_drivers_requests
from behemoth.errors import ConfigError, RunFailedError, user_facing_error
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


def run_dir(cfg: JobConfig) -> str:
    """The job's run folder (local: absolute; or a URI)."""
    return paths.run_dir(cfg.checkpoint.storage_path, cfg.checkpoint.run_name)


def storage_path(cfg: JobConfig) -> str:
    """Ray needs an absolute local path or a URI."""
    path = cfg.checkpoint.storage_path
    return paths.storage_root(path)


_RAY_STARTED_HERE = False  # ensure_ray called ray.init in this process (not the caller)


def ensure_ray() -> None:
    """Connect to the cluster named by RAY_ADDRESS (as under `ray job submit`), or start a local one.

    On an existing cluster the nodes may not have behemoth installed: the package travels with the job as a
    runtime_env `py_modules` entry (uploaded once, cached per node). A local instance shares this process's
    environment and needs nothing.
    """
    import ray

    from behemoth.driver import ray_console

    if ray.is_initialized():
        ray_console.install()
        return
    if os.environ.get("RAY_ADDRESS"):
        package = str(Path(__file__).resolve().parents[1])  # platform/behemoth
        options = {"runtime_env": {"py_modules": [package]}}
    else:
        # behemoth's worker variables for the whole job, not only Ray Train's workers: see warm_up_data_processes
        options = {"_system_config": LOCAL_RAY_SYSTEM_CONFIG, "runtime_env": {"env_vars": worker_env_vars()}}
        ray_console.quiet_token_auth_notice()
    ray.init(logging_level="warning", log_to_driver=True, **options)
    global _RAY_STARTED_HERE
    _RAY_STARTED_HERE = True
    ray_console.install()
    tighten_token_file()


# Ray starts its worker processes at niceness 15, below its own daemons (raylet, GCS, dashboard agent) and the
# driver, so that the control plane stays responsive on nodes that tasks saturate. On a local instance the
# training workers (and their decode tasks) are the workload: at niceness 15 they yield the CPU to every
# daemon wake-up, and on 2 cores the image pipeline trained ~25% slower (P2 in BENCHMARKS.md: 138-163
# images/s at 15, 194-202 at 0). A cluster started with `ray start` keeps Ray's default.
#
# Ray also kills a task worker process after 1 s idle once the node has more worker processes than CPUs, which
# a node running training workers always has. Each epoch's decode tasks finish early in the epoch (training is
# the slow side), so their processes were killed mid-epoch and new ones started for the next epoch: two new
# processes per epoch in the demo (seen in `ps`), each importing Ray, Ray Data and the decode code again,
# seconds of CPU taken from training on every epoch. Kept idle for a minute, they serve the next epoch.
#
# Ray also starts one idle worker process per CPU when the driver connects, for tasks in the driver's runtime
# environment. behemoth's processes all run in another (Ray Train's controller and workers, and every task a
# worker submits, carry Ray Train's environment variables), so those processes were never used: each imported
# Ray at the moment Ray Train's own processes start, on the same cores (2 x ~1 s of CPU here; seen in `ps`:
# two `ray::IDLE` from the start to the end of the demo). The processes behemoth does use are started ahead
# on purpose (driver/warmup.py).
LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0, "idle_worker_killing_time_threshold_ms": 60_000,
                           "prestart_worker_first_driver": False}


# Exact resume needs the same float results for the same values, wherever they sit in memory. Intel MKL (torch's
# BLAS on x86 CPUs) does not promise that by default: it may take another code path for an operand at another
# alignment. Seen on AMD EPYC (AVX2): a [64 x 48] @ [48 x 1] matmul gave different bits at 12 of 16 float offsets
# (tests/unit/test_determinism.py). It matters where operands are views at arbitrary offsets, as PowerSGD's
# matrices are views into DDP's flat gradient buckets, whose layout differs between a restored run (DDP's initial
# buckets) and the run it continues (buckets rebuilt after step 1): the restored run differed by 1.5e-8.
# MKL's conditional numerical reproducibility in STRICT mode removes the dependence on alignment and keeps the
# best instruction set (no measurable cost on the demo models). A value the user sets wins.
REPRODUCIBLE_BLAS_ENV = {"MKL_CBWR": "AUTO,STRICT"}


# Ray Train replaces print() in its workers with a version that logs the line and, because Ray's worker wraps
# sys.stdout, prints it as well: a user's print() in their own model, loss or task showed twice on the console.
# Off, print() is Python's again (one line, forwarded by Ray like any worker output). A value the user sets wins.
PRINT_PATCH_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def worker_env_vars() -> dict:
    """Environment variables every training worker starts with (read by libraries when they initialise)."""
    return {key: os.environ.get(key, value) for key, value in {**REPRODUCIBLE_BLAS_ENV, **PRINT_PATCH_ENV}.items()}


def tighten_token_file() -> str | None:
    """Ray 2.60 writes the token it generates for a new local cluster as 0644; only its owner may read it."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.path.isfile(path) and os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o600)
        return path
    return None


# Ray Train's controller collects the workers' reports when it polls them, every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S
# (2 s by default), and a worker holds at most one uncollected report: a run that reports (or checkpoints) more
# often than every 2 s waits up to 2 s at each report. Polling every 0.2 s costs the controller a few small
# actor calls per second. The driver's value reaches the controller (Ray propagates RAY_TRAIN_* variables);
# a value the user sets wins.
REPORT_POLL_ENV, REPORT_POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2"

# Ray Train starts a preemption watcher per worker group (an actor process that polls Ray for nodes being
# drained: a cloud's spot instances; Ray Train then waits out the drain and restarts the group, charging a
# separate retry budget). The local instance behemoth starts is one machine whose loss ends the run anyway:
# there the watcher was only one more process importing Ray while the first epoch's pipeline starts, and it is
# off. Anywhere else (`ray job submit`, or a caller's own ray.init, which may reach a cluster that adds spot
# nodes later) it stays on. A value the user sets wins.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def set_ray_train_env() -> None:
    """The driver's RAY_TRAIN_* settings (Ray Train propagates them to its controller and workers)."""
    os.environ.setdefault(REPORT_POLL_ENV, REPORT_POLL_S)
    if _RAY_STARTED_HERE and not os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")


def training_worker_runtime_env() -> dict:
    """The runtime environment Ray Train gives the training workers, and so every task they submit (Ray Data's
    decode tasks): the RAY_TRAIN_* variables it propagates from the driver, the one its controller adds (a
    child inherits its parent's variables) and behemoth's (worker_env_vars). Mirrors Ray Train 2.60
    (DataParallelTrainer._initialize_and_run_controller, WorkerGroup._get_worker_runtime_env), called after
    build_trainer has set the driver's variables; a test compares it with a real worker's."""
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.constants import (DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
                                                  get_env_vars_to_propagate)

    env = {RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR: DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
           **get_env_vars_to_propagate()}
    return {"env_vars": {**env, **worker_env_vars()}}


def warm_up_data_processes(cfg: JobConfig, data) -> list:
    """On a local instance, start the processes the task's data pipeline will run in (driver/warmup.py) while
    Ray Train starts; nothing on a cluster (RAY_ADDRESS, or more than one node), where they may land on any
    node, or for a task whose `data_modules` for this data are none. Returns the warm-up tasks' refs.

    Ray gives a task an idle process whose runtime environment has the same serialized form, not only the same
    content. A child's environment is merged with its parent's and written out anew, except where the parent's
    is empty: a training worker's (merged through the controller's) and a task's from a driver with an empty
    job environment have the same variables and different texts, and no process was shared (measured: the
    warm processes stayed idle while the decode tasks started four new ones). behemoth's local instance
    therefore gives the job its worker variables (ensure_ray), so that both go through the merge; where the
    job's environment is empty (a caller's own ray.init) nothing is started."""
    import ray

    modules = task_of(cfg).data_modules(cfg, data)
    if (os.environ.get("RAY_ADDRESS") or not modules or not ray.get_runtime_context().runtime_env
            or sum(node["Alive"] for node in ray.nodes()) > 1):
        return []
    from behemoth.driver import warmup

    return warmup.start(tuple(modules), cfg.scaling.max_workers, training_worker_runtime_env())


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
    from ray.train.torch import TorchTrainer

    from behemoth.driver import failure_policy
    from behemoth.worker.loop import train_loop_per_worker

    failure_policy.install()  # a data or config error ends the run at once, without using max_failures
    set_ray_train_env()
    resources = worker_resources(cfg)
    if fence is not None:
        from behemoth.driver.lease_fence import LeaseFenceCallback

        callbacks = [*(callbacks or []), LeaseFenceCallback(fence)]
    return TorchTrainer(
        train_loop_per_worker,
        # The data travels once through the object store, not pickled into every worker's config.
        train_loop_config={"job": cfg.to_dict(), "data_ref": ray.put(data), "fence": fence},
        scaling_config=ScalingConfig(
            num_workers=tuple(cfg.scaling.num_workers) if cfg.scaling.elastic else cfg.scaling.num_workers,
            use_gpu=cfg.scaling.use_gpu, resources_per_worker=resources,
            elastic_resize_monitor_interval_s=cfg.scaling.elastic_resize_interval_s,
        ),
        run_config=RunConfig(
            name=cfg.checkpoint.run_name,
            storage_path=storage_path(cfg),
            failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
            callbacks=list(callbacks or []),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            # Ray Train's per-report INFO lines would bury behemoth's progress lines.
            logging_config=LoggingConfig(log_level="WARNING"),
            # merged with the job's runtime env (its py_modules stay)
            worker_runtime_env={"env_vars": worker_env_vars()},
        ),
    )


# Keys that may change between a run and its resumption: they change speed or bookkeeping, not what is learnt.
_RESUMABLE_CHANGES = {"data.prefetch_batches", "data.cpus_per_task", "data.max_bad_samples"}


def check_resume_compatible(cfg: JobConfig) -> None:
    """Refuse to resume a run whose latest checkpoint (local or under a URI) was trained on another data or
    model config. (A change of scaling.strategy is fine: either checkpoint layout loads under DDP and FSDP.)"""
    from behemoth.checkpoint import complete_checkpoints, read_file

    folder = run_dir(cfg)
    kept = complete_checkpoints(folder)
    if not kept:
        return
    latest = kept[0][1]
    name = latest.rstrip("/").rpartition("/")[2]
    before = yaml.safe_load(read_file(f"{latest}/job.yaml")) or {}
    now = cfg.to_dict()
    if cfg.checkpoint.resume_changed_config:
        return
    changed = [f"{section}.{key}: {before.get(section, {}).get(key)!r} -> {value!r}"
               for section in ("data", "model") for key, value in now[section].items()
               if before.get(section, {}).get(key) != value and f"{section}.{key}" not in _RESUMABLE_CHANGES]
    if changed:
        raise ConfigError(
            f"run '{cfg.checkpoint.run_name}' in {folder} was trained with a different config "
            f"({name}): {'; '.join(changed)}. Start a new run with another "
            f"checkpoint.run_name, or resume anyway with --set checkpoint.resume_changed_config=true"
        )


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
    from ray.train import TrainingFailedError

    withdraw_killed_drivers_requests(tracking.run_dir, tracking.invocation)
    trainer = build_trainer(cfg, data, [*tracking.callbacks(), *(callbacks or [])], fence)
    warm_up_data_processes(cfg, data)
    try:
        result = trainer.fit()
    except TrainingFailedError as e:
        _end_ray(end_ray)
        tracking.finish("failed")
        if user_facing_error(e) is not None:  # behemoth's own message (bad data, ...) says it better
            raise
        raise RunFailedError(_failure_message(cfg, e)) from e
    retire_unregistered(cfg, result.best_checkpoints or [], fence)
    summary = _summarise(cfg, result, time.time() - started)
    returned = result.return_value or {}
    # Ray's local shutdown (1.5-1.8 s on the demo, mostly waiting for its processes to end) and the run's last
    # records (the report's plots: 2-3 s of CPU) need nothing of each other: side by side, not one after the other.
    ending = threading.Thread(target=_end_ray, args=(end_ray,), name="behemoth-end-ray")
    ending.start()
    try:
        tracking.finish("finished", returned.get("clock"), returned.get("final_step"), summary.best_checkpoint)
    finally:
        ending.join()
    summary.goodput, summary.report = tracking.account, tracking.report_path
    summary.tensorboard = cfg.tracking.tensorboard
    return summary


def _end_ray(end: bool) -> None:
    """Shut Ray down, if asked and if behemoth started (or connected) it: never a caller's own instance."""
    global _RAY_STARTED_HERE
    if end and _RAY_STARTED_HERE:
        import ray

        ray.shutdown()
        _RAY_STARTED_HERE = False


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
    ensure_ray()
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

    root = paths.storage_root(cfg.checkpoint.storage_path)
    kept_paths = {paths.as_uri_of(root, c.path).rstrip("/") for c, _ in kept}
    found = complete_checkpoints(run_dir(cfg))
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
    root = paths.storage_root(cfg.checkpoint.storage_path)  # Ray gives paths on the storage's filesystem
    return RunSummary(
        run_dir=run_dir(cfg),
        metrics=dict(result.metrics or {}),
        latest_checkpoint=paths.as_uri_of(root, result.checkpoint.path if result.checkpoint else None),
        best_checkpoint=paths.as_uri_of(root, best_path),
        best_value=best_value,
        best_metric=key,
        wall_s=wall_s,
        resumed_from_step=(result.return_value or {}).get("resumed_from_step", 0),
        peak_source=(result.return_value or {}).get("peak_source"),
        task_lines=task.summary_lines(dict(result.metrics or {})),
    )
