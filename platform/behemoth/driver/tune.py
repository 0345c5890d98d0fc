"""Driver side: sweeps of a job config with Ray Tune, each trial a full behemoth training run.

A sweep is a job YAML plus a search space over any of its keys (`train.lr`, `train.global_batch_size`, ...).
Ray 2.60 (Train V2) has no `Tuner(trainer)`: each trial runs `run_trial`, a driver function that builds the
trial's job config and calls `behemoth.driver.trainer.train` — its own workers, run folder, checkpoints and
`failure.max_failures` — with a callback that forwards the run's evaluation reports to Tune, where the
scheduler (ASHA by default) stops weak trials early.

Everything is checked on the driver before a trial starts: every space key is a job key, every value in
the space makes a valid job, the metric is one the task reports, the data is readable. Concurrency is
bounded by the cluster's resources, so trials never wait on each other's workers.

Outputs, in STORAGE_PATH/NAME: results.csv (one row per trial, best first), best.yaml (the best trial's
full job config: `behemoth train best.yaml` reproduces it), the trials' run folders under runs/, and Tune's
own experiment state (which `sweep` uses to resume a killed sweep of the same name).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from ray.tune import Callback
from ray.tune.integration.ray_train import TuneReportCallback

from behemoth import paths
from behemoth.driver import warmup
from behemoth.config import ConfigError, JobConfig, apply_override, dump_yaml, from_dict, read_yaml_mapping
from behemoth.job import config_from_dict, load_config
from behemoth.errors import RunFailedError, did_you_mean
from behemoth.tasks import task_of

DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform")
TRIAL_DRIVER_MEMORY = 512 * 1024**2  # bytes: a trial driver process (Ray, torch imported) holds ~0.4 GiB


@dataclass
class SchedulerConfig:
    # asha: stop trials whose metric at a rung (grace_period x reduction_factor^k) is in the bottom part.
    kind: Literal["asha", "fifo"] = "asha"
    # What a rung counts: epochs, or optimizer steps (runs that evaluate every N steps).
    time_attr: Literal["epoch", "step"] = "epoch"
    grace_period: float = 1
    reduction_factor: float = 2
    # The run length ASHA plans for (default: the job's epochs, or its steps).
    max_t: float | None = None


@dataclass
class SweepConfig:
    # The job YAML every trial starts from (relative to the sweep file).
    job: str = ""
    # Overrides applied to every trial before the space, like `behemoth train --set`.
    set: list[str] = field(default_factory=list)
    # KEY: {grid: [...]} | {choice: [...]} | {uniform: [low, high]} | {loguniform: [low, high]}
    space: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    # Samples of the space (each grid combination num_samples times).
    num_samples: int = 1
    # What picks the best trial: one of the metrics the job's task reports (Task.reported).
    metric: str | None = None  # default: the task's `best` metric
    mode: Literal["min", "max"] | None = None  # default: from the metric
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # random: Tune's grid/random variant generator. optuna: TPE (pip install optuna).
    searcher: Literal["random", "optuna"] = "random"
    # Scale each trial's train.lr by its batch size against the job's: lr x (B / B_job) or x sqrt(B / B_job).
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    # Trials running at once (default: as many as the cluster's CPUs/GPUs hold, from the largest trial).
    max_concurrent_trials: int | None = None
    # Tune restarts of a trial whose training failed past its failure.max_failures (it resumes from its
    # own checkpoints).
    trial_max_failures: int = 0
    name: str = "sweep"
    # A sweep lives in STORAGE_PATH/NAME; rerunning the same name resumes it.
    storage_path: str = "runs/sweeps"

    def validate(self) -> None:
        if not self.job:
            raise ConfigError("job is empty: set it to the job YAML the trials start from")
        # its best trial becomes the job NAME_best, whose run name must pass too
        paths.check_name("name", self.name, paths.NAME_MAX - len("_best"))
        if not self.space:
            raise ConfigError("space is empty: give at least one key to search, e.g. "
                              "space: {train.lr: {loguniform: [0.01, 0.3]}}")
        for key, dist in self.space.items():
            _check_distribution(key, dist)
        if self.num_samples < 1 or self.trial_max_failures < -1:
            raise ConfigError("num_samples must be >= 1 and trial_max_failures >= -1")
        if self.max_concurrent_trials is not None and self.max_concurrent_trials < 1:
            raise ConfigError(f"max_concurrent_trials must be >= 1, got {self.max_concurrent_trials}")
        if not self.name or "/" in self.name:
            raise ConfigError(f"name {self.name!r} must be a non-empty name without '/'")
        s = self.scheduler
        if s.grace_period <= 0 or s.reduction_factor <= 1 or (s.max_t is not None and s.max_t < s.grace_period):
            raise ConfigError("scheduler: grace_period must be > 0, reduction_factor > 1, max_t >= grace_period")


def _check_distribution(key: str, dist: dict) -> None:
    if len(dist) != 1 or next(iter(dist)) not in DISTRIBUTIONS:
        raise ConfigError(f"space.{key}: expected one of {{{', '.join(f'{d}: [...]' for d in DISTRIBUTIONS)}}}, "
                          f"got {dist}")
    kind, values = next(iter(dist.items()))
    if not values:
        raise ConfigError(f"space.{key}.{kind} is empty")
    if kind in ("uniform", "loguniform"):
        ok = len(values) == 2 and all(isinstance(v, (int, float)) for v in values) and values[0] < values[1]
        if not ok or (kind == "loguniform" and values[0] <= 0):
            raise ConfigError(f"space.{key}.{kind} needs [low, high] with low < high"
                              f"{' and low > 0' if kind == 'loguniform' else ''}, got {values}")


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> SweepConfig:
    """Read a sweep YAML. `overrides` (`KEY=VALUE`): a sweep key (name=..., scheduler.grace_period=2), or a
    job key (data.root=..., train.epochs=2), which is added to the sweep's `set` list for every trial."""
    import dataclasses

    p = Path(path)
    raw = read_yaml_mapping(p, "sweep file", "sweep keys (name, job, space, ...)")
    job_sections = {f.name for f in dataclasses.fields(JobConfig)}
    for item in overrides or []:
        if item.split(".", 1)[0] in job_sections:
            raw["set"] = list(raw.get("set") or []) + [item]
        else:
            apply_override(raw, item)
    sweep_cfg = from_dict(SweepConfig, raw, where=str(p))
    if sweep_cfg.job and not Path(sweep_cfg.job).is_absolute():
        sweep_cfg.job = str(p.parent / sweep_cfg.job)
    try:
        sweep_cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    return sweep_cfg


# ---------------------------------------------------------------------------------------------------------
# Trial configs: job YAML + sweep overrides (resolved once, on the driver) -> the trial's sampled values ->
# LR scaling -> its own run folder


def base_job(sweep_cfg: SweepConfig) -> dict:
    """The job every trial starts from, as a dict, with relative local paths made absolute: trials run in
    Tune's actors, whose working directory is not the driver's."""
    cfg = load_config(sweep_cfg.job, sweep_cfg.set)
    for key in cfg.data.path_keys:  # the task's section says which of its keys are paths
        value = getattr(cfg.data, key)
        setattr(cfg.data, key, [_absolute(v) for v in value] if isinstance(value, list) else _absolute(value))
    cfg.checkpoint.storage_path = _absolute(cfg.checkpoint.storage_path)
    return cfg.to_dict()


def _absolute(path: str) -> str:
    """A relative path that exists here (or a cache folder) made absolute; URIs and hub names unchanged."""
    if not path or paths.is_uri(path) or os.path.isabs(path):
        return path
    return os.path.abspath(path) if os.path.exists(path) or path.endswith("cache") else path


def trial_job(base: dict, params: dict, lr_scaling: str = "none", run_dir: str | None = None) -> JobConfig:
    """The full job config of a trial with sampled values `params` ({"train.lr": 0.05, ...})."""
    raw = {section: dict(values) for section, values in base.items()}
    for key, value in params.items():
        section, name = key.split(".", 1)
        raw[section][name] = value
    if run_dir is not None:
        storage, name = paths.split_run_dir(run_dir)
        raw["checkpoint"].update(storage_path=storage, run_name=name)
        if raw["train"].get("sample_ledger"):
            raw["train"]["sample_ledger"] = paths.join(run_dir, "ledger")
    if lr_scaling != "none":
        ratio = raw["train"]["global_batch_size"] / base["train"]["global_batch_size"]
        raw["train"]["lr"] = float(raw["train"]["lr"]) * (ratio if lr_scaling == "linear" else math.sqrt(ratio))
    return config_from_dict(raw, where="trial config")


def metric_and_mode(sweep_cfg: SweepConfig, cfg: JobConfig) -> tuple[str, str]:
    task = task_of(cfg)
    default_metric, default_mode = task.best
    metric = sweep_cfg.metric or default_metric
    reported = task.reported
    if metric not in reported:
        raise ConfigError(f"metric {metric!r} is never reported by a {cfg.model.name} run; it reports "
                          f"{', '.join(reported)} at each evaluation")
    return metric, sweep_cfg.mode or reported.get(metric, default_mode)


def check_sweep(sweep_cfg: SweepConfig) -> list[JobConfig]:
    """Every job the space can produce must be valid: the grid's and choices' values all combined, and each
    range's two ends. Returns those jobs (for the resource bound). Raises ConfigError naming the key."""
    sweep_cfg.validate()
    if paths.is_uri(sweep_cfg.storage_path):  # its own files (trial starts, results, best.yaml) are local files
        raise ConfigError(f"sweep storage_path {sweep_cfg.storage_path}: a sweep keeps its folder on a local or "
                          f"shared filesystem (an object store is not supported for sweeps yet; single runs "
                          f"support it): give a path, e.g. a shared mount on a cluster")
    base = base_job(sweep_cfg)  # the job file itself first: its errors name it
    axes, valid = [], _job_keys(base)
    for key, dist in sweep_cfg.space.items():
        if key not in valid:
            raise ConfigError(f"space key '{key}' is not a key of the sweep's job (data.kind {base['data']['kind']})"
                              f"{did_you_mean(key, valid)}")
        axes.append([(key, v) for v in next(iter(dist.values()))])
    jobs = []
    for combination in itertools.product(*axes):
        try:
            jobs.append(trial_job(base, dict(combination), sweep_cfg.lr_scaling))
        except ConfigError as e:
            values = ", ".join(f"{k}={v!r}" for k, v in combination)
            raise ConfigError(f"space: the trial {values} is not a valid job: {e}") from None
    metric_and_mode(sweep_cfg, jobs[0])
    if sweep_cfg.scheduler.kind == "asha":
        asha_max_t(sweep_cfg, jobs[0])
    if sweep_cfg.searcher == "optuna":
        _optuna_searcher(sweep_cfg, "val_loss", "min")  # raises the install hint when optuna is missing
    return jobs


def _job_keys(base: dict) -> list[str]:
    """Every key (section.field) of the sweep's job; its data section's are those of its kind."""
    import dataclasses

    job = config_from_dict(base, where="the sweep's job")
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(job) for f in dataclasses.fields(getattr(job, s.name))]


# ---------------------------------------------------------------------------------------------------------
# Resources: trials run at most as many at once as the cluster holds, so none waits on another's workers


def trial_resources(cfg: JobConfig) -> dict[str, float]:
    """What one trial of `cfg` holds at its largest: its workers, plus what its task's data pipeline takes
    beside them while training (Task.data_cpus)."""
    s = cfg.scaling
    need = {"CPU": s.max_workers * s.cpus_per_worker + task_of(cfg).data_cpus(cfg)}
    if s.use_gpu:
        need["GPU"] = s.max_workers * s.gpus_per_worker
    return need


def concurrency_bound(jobs: list[JobConfig], cluster: dict[str, float]) -> int:
    need = {k: max(trial_resources(j).get(k, 0) for j in jobs) for k in ("CPU", "GPU")}
    fits = [int(cluster.get(k, 0) // v + 1e-9) for k, v in need.items() if v > 0]
    n = min(fits)
    if n < 1:
        raise ConfigError(f"one trial needs {need['CPU']:g} CPUs and {need['GPU']:g} GPUs, the cluster has "
                          f"{cluster.get('CPU', 0):g} and {cluster.get('GPU', 0):g}: lower scaling.num_workers / "
                          f"cpus_per_worker, or set max_concurrent_trials on a cluster that autoscales")
    return n


# ---------------------------------------------------------------------------------------------------------
# Running: the trial driver function, the Tuner, the results


def run_trial(params: dict, sweep: dict, base: dict, sweep_dir: str, mlflow_parent: str | None = None,
              fence=None) -> None:
    """One trial (runs in a Tune actor): the trial's job, trained by behemoth, evaluations sent to Tune.

    The run folder is SWEEP_DIR/runs/TRIAL_ID, so a trial that Tune restarts (a resumed sweep, a retried
    error) resumes from its own latest checkpoint. Every start is appended to SWEEP_DIR/trial_starts.jsonl.
    `mlflow_parent`: the sweep's MLflow run, under which the trial's run nests. A trial writes no report of its
    own (the sweep's report shows every trial; `behemoth report SWEEP/runs/TRIAL` draws one on demand).
    """
    from ray import tune

    from behemoth.driver.trainer import train

    sweep_cfg = from_dict(SweepConfig, sweep, where="sweep")
    trial_id = tune.get_context().get_trial_id()
    run_dir = paths.join(sweep_dir, "runs", trial_id)
    cfg = trial_job(base, params, sweep_cfg.lr_scaling, run_dir)
    cfg.tracking.report = False
    metric, _ = metric_and_mode(sweep_cfg, cfg)
    summary_file = Path(run_dir, "summary.json")
    # Tune saves its experiment state at most every ~10 s: a sweep killed just after a trial finished may
    # restart that trial. Its summary says it is done: hand Tune the final result again, train nothing.
    finished_before = summary_file.is_file()
    _append_jsonl(paths.join(sweep_dir, "trial_starts.jsonl"), {
        "trial_id": trial_id, "time": time.time(), "params": params, "lr": cfg.train.lr,
        "finished_before": finished_before})
    described = ", ".join(f"{k}={v}" for k, v in params.items())
    if finished_before:
        print(f"[behemoth] trial {trial_id} ({described}) had finished: its result is kept", flush=True)
        tune.report(json.loads(summary_file.read_text())["metrics"])
        return
    print(f"[behemoth] trial {trial_id} ({described}, lr {cfg.train.lr:g}): run folder {run_dir}", flush=True)
    summary = train(cfg, callbacks=[EvalReportCallback(metric)], lock=False,  # under the sweep's lease,
                    parent_mlflow_run=mlflow_parent, fence=fence)  # fenced by it (driver/runlock.py)
    # Written when the trial has trained to its end (a trial ASHA stops never gets here).
    tmp = summary_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "metrics": summary.metrics, "best_checkpoint": summary.best_checkpoint,
        "latest_checkpoint": summary.latest_checkpoint, "resumed_from_step": summary.resumed_from_step}))
    os.replace(tmp, summary_file)  # all or nothing: a half-written summary would pass for a finished trial


def _append_jsonl(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


class EvalReportCallback(TuneReportCallback):
    """Ray's TuneReportCallback, forwarding only the reports that carry the metric (the evaluations): the
    run's other reports (loss every log_every steps) would fail Tune's check that every result holds it."""

    def __init__(self, metric: str):
        super().__init__()
        self.metric = metric

    def after_report(self, run_context, metrics, checkpoint):
        if self.metric in metrics[0]:
            super().after_report(run_context, metrics, checkpoint)


@dataclass
class SweepResult:
    table: Any  # pandas.DataFrame: one row per trial, best first
    best_params: dict
    best_job: JobConfig  # the best trial's full job config (run name: NAME_best, in the job's storage path)
    best_value: float
    metric: str
    best_checkpoint: str | None
    best_yaml: str
    results_csv: str
    sweep_dir: str


def sweep_dir_of(sweep_cfg: SweepConfig) -> str:
    return paths.run_dir(sweep_cfg.storage_path, sweep_cfg.name)


def run_sweep(sweep_cfg: SweepConfig) -> SweepResult:
    """Check the sweep, start (or resume: same name) it, and return its results. Blocks until it ends. One
    driver per sweep folder (driver/runlock.py): its trials' run folders are inside it."""
    from behemoth.driver.runlock import RunLock

    jobs = check_sweep(sweep_cfg)
    sweep_dir = sweep_dir_of(sweep_cfg)
    with RunLock(sweep_dir, f"sweep '{sweep_cfg.name}'") as held:
        return _run_sweep(sweep_cfg, jobs, sweep_dir, held.fence())


def _run_sweep(sweep_cfg: SweepConfig, jobs: list, sweep_dir: str, fence) -> SweepResult:
    metric, mode = metric_and_mode(sweep_cfg, jobs[0])
    from behemoth.driver.trainer import prepare_data

    for job in _distinct_data(jobs):  # checks the data, starts Ray; text: tokenised once, here, into the cache
        prepare_data(job)
    _check_state_api()
    _check_same_sweep(sweep_cfg, sweep_dir)
    warmup.start_data_stats_actor()
    import ray
    from ray import tune

    concurrent = sweep_cfg.max_concurrent_trials or concurrency_bound(jobs, ray.cluster_resources())
    mlflow_parent = _sweep_mlflow_run(sweep_cfg, jobs[0], sweep_dir)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, sweep=_to_dict(sweep_cfg), base=base_job(sweep_cfg), sweep_dir=sweep_dir,
                             mlflow_parent=mlflow_parent, fence=fence),
        # The trial's driver only waits on its run: it holds no CPU (its workers hold the run's CPUs and GPUs,
        # see trial_resources), only the memory its process takes. (Ray refuses an empty request.)
        {"CPU": 0, "memory": TRIAL_DRIVER_MEMORY})
    print(f"[behemoth] sweep {sweep_cfg.name}: {metric} ({mode}), {_count(sweep_cfg)} trials, at most "
          f"{concurrent} at once, scheduler {sweep_cfg.scheduler.kind}; folder {sweep_dir}", flush=True)
    if tune.Tuner.can_restore(sweep_dir):
        print(f"[behemoth] resuming sweep {sweep_cfg.name}: finished trials are kept, unfinished ones continue "
              f"from their checkpoints, errored ones are retried", flush=True)
        tuner = tune.Tuner.restore(sweep_dir, trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space={key: _domain(dist) for key, dist in sweep_cfg.space.items()},
            tune_config=tune.TuneConfig(
                metric=metric, mode=mode, num_samples=sweep_cfg.num_samples, max_concurrent_trials=concurrent,
                scheduler=_scheduler(sweep_cfg, jobs[0]), search_alg=_searcher(sweep_cfg, metric, mode)),
            run_config=tune.RunConfig(
                name=sweep_cfg.name, storage_path=paths.split_run_dir(sweep_dir)[0], verbose=0,
                failure_config=tune.FailureConfig(max_failures=sweep_cfg.trial_max_failures),
                callbacks=[TrialOutcomeLines(metric)]),
        )
    with OrphanedPlacementGroupReaper():
        grid = tuner.fit()
    fence.check("writing the sweep's results.csv and best.yaml")
    result = _results(sweep_cfg, grid, metric, mode, sweep_dir)
    _finish_tracking(jobs[0], sweep_dir, mlflow_parent, result)
    return result


def _sweep_mlflow_run(sweep_cfg: SweepConfig, job: JobConfig, sweep_dir: str) -> str | None:
    """The sweep's parent MLflow run (its trials' runs nest under it), kept across resumes; None if off."""
    if not job.tracking.mlflow.uri:
        return None
    from behemoth.tracking import mlflow_run

    mlflow_run.client(job.tracking.mlflow.uri)  # MLflow not installed: a config error now
    try:
        return mlflow_run.open_run(job.tracking.mlflow.uri, job.tracking.mlflow.experiment, sweep_dir,
                                   f"sweep {sweep_cfg.name}", _to_dict(sweep_cfg))
    except Exception as e:  # noqa: BLE001 - tracking never stops a sweep
        print(f"[behemoth] WARNING: MLflow ({job.tracking.mlflow.uri}) is off for this sweep: {type(e).__name__}: "
              f"{e}", flush=True)
        return None


def _finish_tracking(job: JobConfig, sweep_dir: str, mlflow_parent: str | None, result: SweepResult) -> None:
    """The sweep's report (tracking.report) and its MLflow parent run's artifacts and end."""
    report = None
    if job.tracking.report:
        from behemoth.tracking.report import write_sweep_report

        try:
            report = write_sweep_report(sweep_dir)
            print(f"[behemoth] sweep report: {report}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"[behemoth] WARNING: the sweep report could not be written: {type(e).__name__}: {e}", flush=True)
    if mlflow_parent:
        from behemoth.tracking import mlflow_run

        files = [result.results_csv, result.best_yaml, *([os.path.dirname(report)] if report else [])]
        try:
            mlflow_run.finish(job.tracking.mlflow.uri, mlflow_parent, "FINISHED", {}, 0, artifacts=files)
        except Exception as e:  # noqa: BLE001
            print(f"[behemoth] WARNING: MLflow could not close the sweep's run: {type(e).__name__}: {e}", flush=True)


class TrialOutcomeLines(Callback):
    """One console line per trial as it ends: finished, or stopped early by the scheduler (ASHA), with its
    last evaluation. Tune calls on_trial_complete for both and marks both results `done`; a trial finished
    when its last report is at its last step (as the results table decides, _trial_row)."""

    def __init__(self, metric: str):
        self.metric = metric

    def on_trial_complete(self, iteration, trials, trial, **info):
        result = trial.last_result or {}
        value = result.get(self.metric)
        shown = f"{self.metric} {value:.4f}" if isinstance(value, (int, float)) else "not evaluated yet"
        if result.get("step", 0) >= result.get("total_steps", float("inf")):
            print(f"[behemoth] trial {trial.trial_id} finished: {shown}", flush=True)
        else:
            print(f"[behemoth] trial {trial.trial_id} stopped early by the scheduler at epoch "
                  f"{result.get('epoch', 0):.2f}: {shown}", flush=True)


class OrphanedPlacementGroupReaper:
    """Frees the placement groups of this job whose creating actor is dead, while a sweep runs and once more
    after it (waiting up to `settle_s` for trial controllers still shutting down).

    A Ray Train race (Ray 2.60): when Tune stops a trial while its Ray Train controller is starting a worker
    group, the controller gets SIGTERM, stops its placement-group cleaner on the way out, and, still draining
    its control loop (an async actor), creates the worker group's placement group ~0.15 s later. Nothing then
    owns that group: GCS removes a dead actor's group only once its job has ended too. Each one held a
    trial's CPUs for the rest of the sweep (seen in tests/integration/test_tune.py: 0.5 CPU still held after
    the sweep). A group whose creator actor is dead can never be used again, so removing it is safe; GCS
    says which (`creator_actor_dead`), no dashboard needed.
    """

    def __init__(self, every_s: float = 2.0, settle_s: float = 30.0, quiet_s: float = 3.0):
        import threading

        self.every_s, self.settle_s, self.quiet_s = every_s, settle_s, quiet_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="behemoth-pg-reaper", daemon=True)

    def __enter__(self):
        reap_orphaned_placement_groups()  # a killed driver's leftovers, before the first trial waits for CPUs
        self.thread.start()
        return self

    def __exit__(self, *exc):
        """Reap until no trial controller of this job is alive and none of their groups has turned up for
        `quiet_s`: a dying controller's last group request reaches GCS after the controller is already dead
        (a fresh-clone sweep test once found such a group 60 s after the sweep, the reaper having stopped as
        soon as the last controller was gone)."""
        self.done.set()
        self.thread.join()
        deadline, quiet_since = time.monotonic() + self.settle_s, None
        while time.monotonic() < deadline:
            if reap_orphaned_placement_groups() or _live_train_controllers():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= self.quiet_s:
                return
            time.sleep(0.2)
        reap_orphaned_placement_groups()

    def _run(self):
        while not self.done.wait(self.every_s):
            reap_orphaned_placement_groups()


def reap_orphaned_placement_groups() -> list[str]:
    """Remove the placement groups (not detached) whose creating actor is dead, of this job or of a job that
    has ended (a sweep driver killed before this one resumed it); their ids. Never another live job's."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    job = ray.get_runtime_context().get_job_id()
    ended = {j["JobID"] for j in state.job_table() if j.get("IsDead")}
    # The actor table, not the group's creator_actor_dead flag: GCS sets that flag when the creator dies, so a
    # group registered after its creator's death (the race above) never gets it. (Seen too: a dead job's group
    # whose creator and job were both dead, left CREATED.)
    dead = {actor_id for actor_id, actor in state.actor_table(None).items() if actor.get("State") == "DEAD"}
    reaped = []
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        pg = gcs_pb2.PlacementGroupTableData.FromString(raw)
        # A group the driver created (Tune's trial groups) has the nil creator actor, marked dead: never those.
        created_by_actor = pg.creator_actor_id and not ray.ActorID(pg.creator_actor_id).is_nil()
        ours_or_ended = pg.creator_job_id.hex() == job or pg.creator_job_id.hex() in ended
        if (pg.state != gcs_pb2.PlacementGroupTableData.REMOVED and not pg.is_detached and created_by_actor
                and (pg.creator_actor_dead or pg.creator_actor_id.hex() in dead) and ours_or_ended):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(pg.placement_group_id)))
            reaped.append(pg.placement_group_id.hex())
            print(f"[behemoth] freed placement group {reaped[-1]}: its creator (a stopped trial's Ray Train "
                  f"controller) is dead", flush=True)
    return reaped


def _live_train_controllers() -> int:
    """Ray Train controllers of this job still alive (by GCS's actor table)."""
    import ray
    from ray._private.state import state

    job = ray.get_runtime_context().get_job_id()
    return sum(1 for a in state.actor_table(None).values()
               if a.get("State") == "ALIVE" and a.get("JobID") == job and a.get("ActorClassName", "").endswith("TrainController"))


def _check_state_api() -> None:
    """When Tune stops a trial (ASHA), the trial's Ray Train controller dies with it, and Ray Train's
    PlacementGroupCleaner frees the trial's workers' resources once Ray's state API reports the controller
    dead. Without the state API (Ray started without its dashboard) those resources stay held and later
    trials wait for them forever, so a sweep refuses to start."""
    from ray.util.state import list_actors
    from ray.util.state.exception import RayStateApiException

    try:
        list_actors(limit=1, timeout=10, raise_on_missing_output=False)
    except (RayStateApiException, ConnectionError) as e:
        raise ConfigError(
            f"Ray's state API is not reachable ({type(e).__name__}): Ray was started without its dashboard. A "
            f"sweep needs it (Ray Train frees a stopped trial's workers through it): start Ray with the "
            f"dashboard (ray start --head without --include-dashboard=false; ray.init(include_dashboard=True))"
        ) from None


def _to_dict(sweep_cfg: SweepConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(sweep_cfg)


def _count(sweep_cfg: SweepConfig) -> int:
    grids = [len(v) for dist in sweep_cfg.space.values() for k, v in dist.items() if k == "grid"]
    return math.prod(grids) * sweep_cfg.num_samples


def _distinct_data(jobs: list[JobConfig]) -> list[JobConfig]:
    seen, out = set(), []
    for job in jobs:
        key = json.dumps(job.to_dict()["data"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(job)
    return out


def _check_same_sweep(sweep_cfg: SweepConfig, sweep_dir: str) -> None:
    """A rerun of a sweep name resumes it: with the same job and space only. The first run stores them."""
    path = Path(sweep_dir, "sweep.yaml")
    now = {"job": base_job(sweep_cfg), "space": sweep_cfg.space, "num_samples": sweep_cfg.num_samples,
           "lr_scaling": sweep_cfg.lr_scaling}
    if paths.is_uri(sweep_dir):
        return
    if path.is_file():
        before = yaml.safe_load(path.read_text())
        changed = [key for key in now if before.get(key) != now[key]]
        if changed:
            raise ConfigError(f"sweep '{sweep_cfg.name}' in {sweep_dir} was started with a different "
                              f"{' and '.join(changed)}: give this sweep another name (name=...), or delete the "
                              f"folder to start it over")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(now, sort_keys=False))


def _domain(dist: dict):
    from ray import tune

    kind, values = next(iter(dist.items()))
    return {"grid": tune.grid_search, "choice": tune.choice}[kind](values) if kind in ("grid", "choice") \
        else getattr(tune, kind)(*values)


def _scheduler(sweep_cfg: SweepConfig, job: JobConfig):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    s = sweep_cfg.scheduler
    if s.kind == "fifo":
        return FIFOScheduler()
    max_t = asha_max_t(sweep_cfg, job)
    # No decision at the run's end: ASHA puts a rung at max_t itself, where "stopping" a trial that has
    # trained to its end kills its Ray Train controller while it shuts down, after it has released Ray
    # Train's placement-group cleaner and before it has removed its placement group (seen: a leaked group
    # holding a CPU after the sweep). A max_t a hair below the run's length keeps the rungs below it.
    # stop_last_trials=False: a trial ends by itself (and writes its summary).
    return ASHAScheduler(time_attr=s.time_attr, max_t=max_t * (1 - 1e-6), grace_period=s.grace_period,
                         reduction_factor=s.reduction_factor, stop_last_trials=False)


def asha_max_t(sweep_cfg: SweepConfig, job: JobConfig) -> float:
    """The length of a trial in ASHA's time_attr; ConfigError where ASHA would have no rung before its end."""
    s = sweep_cfg.scheduler
    max_t = s.max_t or (job.train.epochs if s.time_attr == "epoch" else job.train.max_steps)
    if max_t is None:
        raise ConfigError("scheduler.time_attr is step and the job has no train.max_steps: set scheduler.max_t")
    if max_t <= s.grace_period:  # Ray's ASHAScheduler would fail on an assertion (its max_t is a hair below)
        raise ConfigError(f"scheduler asha: a trial lasts {max_t:g} {s.time_attr}(s), not more than "
                          f"scheduler.grace_period {s.grace_period:g}, so ASHA has no point to stop a trial before "
                          f"its end: lower scheduler.grace_period, train longer, or use scheduler.kind: fifo")
    return max_t


def _searcher(sweep_cfg: SweepConfig, metric: str, mode: str):
    return _optuna_searcher(sweep_cfg, metric, mode) if sweep_cfg.searcher == "optuna" else None


def _optuna_searcher(sweep_cfg: SweepConfig, metric: str, mode: str):
    grids = [key for key, dist in sweep_cfg.space.items() if "grid" in dist]
    if grids:  # a mistake in the sweep itself: said whether optuna is installed or not
        raise ConfigError(f"searcher optuna samples, it does not enumerate grids: use choice for {grids}")
    try:
        import optuna  # noqa: F401
        from ray.tune.search.optuna import OptunaSearch
    except ImportError:
        raise ConfigError("searcher optuna needs the optuna package: pip install optuna (or use searcher: "
                          "random)") from None
    return OptunaSearch(metric=metric, mode=mode)


def _results(sweep_cfg: SweepConfig, grid, metric: str, mode: str, sweep_dir: str) -> SweepResult:
    """One row per trial (best first) -> results.csv; the best trial's job -> best.yaml."""
    import pandas as pd

    base, keys = base_job(sweep_cfg), list(sweep_cfg.space)
    rows = [_trial_row(sweep_cfg, r, base, keys, metric, sweep_dir) for r in grid]
    table = pd.DataFrame(rows).sort_values(metric, ascending=mode == "min", na_position="last", kind="stable")
    table = table.reset_index(drop=True)
    results_csv = paths.join(sweep_dir, "results.csv")
    table.to_csv(results_csv, index=False)
    scored = table[table[metric].notna()]
    if scored.empty:
        raise RunFailedError(f"no trial of sweep {sweep_cfg.name} reported {metric}: see the trials' errors in "
                            f"{results_csv}")
    best = scored.iloc[0]
    best_params = {k: _plain(best[k]) for k in keys}
    best_job = trial_job(base, best_params, sweep_cfg.lr_scaling)
    best_job.checkpoint.storage_path = base["checkpoint"]["storage_path"]
    best_job.checkpoint.run_name = f"{sweep_cfg.name}_best"
    best_yaml = paths.join(sweep_dir, "best.yaml")
    Path(best_yaml).write_text(
        f"# The best trial of sweep {sweep_cfg.name}: {best['trial_id']}, {metric} {best[metric]:.6g} "
        f"({best['status']}).\n# {', '.join(f'{k}={v!r}' for k, v in best_params.items())}; train.lr after "
        f"lr_scaling {sweep_cfg.lr_scaling}: {best_job.train.lr:.6g}.\n# Reproduce it: behemoth train {best_yaml}\n"
        + dump_yaml(best_job))
    return SweepResult(table=table, best_params=best_params, best_job=best_job, best_value=float(best[metric]),
                       metric=metric, best_checkpoint=best["best_checkpoint"] or None, best_yaml=best_yaml,
                       results_csv=results_csv, sweep_dir=sweep_dir)


def _trial_row(sweep_cfg: SweepConfig, result, base: dict, keys: list[str], metric: str, sweep_dir: str) -> dict:
    from behemoth.checkpoint import complete_checkpoints

    params = {k: result.config.get(k) for k in keys}
    m = result.metrics or {}
    trial_id = m.get("trial_id") or _trial_id_from_starts(sweep_dir, params)
    run_dir = paths.join(sweep_dir, "runs", str(trial_id))
    summary_file = Path(run_dir, "summary.json")
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    m = {**m, **summary.get("metrics", {})}
    if m.get("step") is not None and m["step"] >= m.get("total_steps", float("inf")):
        status = "finished"  # (ASHA may still "stop" a trial at its last report, as it ends)
    elif result.error is not None:
        status = f"error: {str(result.error).strip().splitlines()[0][:200]}"
    else:
        status = "stopped early"
    kept = complete_checkpoints(run_dir)
    return {"trial_id": trial_id, "status": status, **params,
            "lr": trial_job(base, params, sweep_cfg.lr_scaling).train.lr,
            metric: m.get(metric, float("nan")), "epoch": m.get("epoch"), "step": m.get("step"),
            "best_checkpoint": summary.get("best_checkpoint") or (kept[0][1] if kept else None), "run_dir": run_dir}


def _trial_id_from_starts(sweep_dir: str, params: dict) -> str | None:
    """A trial that failed before its first report has no trial_id in its result: find it by its params."""
    path = Path(sweep_dir, "trial_starts.jsonl")
    starts = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return next((s["trial_id"] for s in reversed(starts) if s["params"] == params), None)


def _plain(value):
    """numpy scalars from the table -> plain Python (for YAML and the config's type checks)."""
    return value.item() if hasattr(value, "item") else value


def sweep(job: str | Path, space: dict, **options) -> SweepResult:
    """Sweep a job YAML from a Python script. `space`: {"train.lr": {"loguniform": [0.01, 0.3]}, ...};
    `options`: the other SweepConfig keys (name, storage_path, num_samples, metric, mode, scheduler (a dict),
    searcher, lr_scaling, max_concurrent_trials, trial_max_failures, set)."""
    raw = {"job": str(job), "space": space, **options}
    return run_sweep(from_dict(SweepConfig, raw, where="sweep()"))
