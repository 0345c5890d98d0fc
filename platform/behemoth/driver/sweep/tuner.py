"""Driver side: sweeps of a job config with Ray Tune, each trial a full behemoth training run.

A sweep is a job YAML plus a search space over any of its keys (`train.lr`, `train.global_batch_size`, ...).
Ray 2.60 (Train V2) has no `Tuner(trainer)`: each trial runs `run_trial` (driver/sweep/trial.py) in a Tune
actor, which Tune reuses from trial to trial. A trial of one worker trains right there, in a warm lane
(driver/sweep/lane.py: no Ray Train processes, what the last trial loaded still loaded); a trial of several
workers calls `behemoth.driver.run.trainer.train` — its own TorchTrainer. Either way the trial has its own run
folder, checkpoints and `failure.max_failures`, and its evaluations go to Tune, where the scheduler (ASHA by
default) stops weak trials early.

Everything is checked on the driver before a trial starts: every space key is a job key, every value in
the space makes a valid job, the metric is one the task reports, the data is readable. Concurrency is
bounded by the cluster's resources, so trials never wait on each other's workers.

Outputs, in STORAGE_PATH/NAME: results.csv (one row per trial, best first), best.yaml (the best trial's
full job config: `behemoth train best.yaml` reproduces it), the trials' run folders under runs/, and Tune's
own experiment state (which `sweep` uses to resume a killed sweep of the same name).

The parts: driver/sweep/config.py (the schema and the trials' jobs), driver/sweep/trial.py (a trial),
driver/sweep/reaper.py (placement groups a stopped trial leaves), driver/sweep/results.py (results.csv, best.yaml).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path

import yaml

from behemoth.storage import paths
from behemoth.config import JobConfig, from_dict
from behemoth.errors import ConfigError
from behemoth.job import config_from_dict
from behemoth.driver.ray_cluster import session as ray_session
from behemoth.driver.ray_cluster import warmup
from behemoth.driver.sweep.config import (INTEGER_RANGES, SweepConfig, asha_max_t, base_job, check_sweep,
                                          concurrency_bound, lane_reason, load_sweep, metric_and_mode,
                                          optuna_searcher)
from behemoth.driver.sweep.reaper import OrphanedPlacementGroupReaper
from behemoth.driver.sweep.results import SweepResult, write_results
from behemoth.driver.sweep.trial import TrialOutcomeLines, run_trial, trial_process_resources

__all__ = ["SweepConfig", "SweepResult", "load_sweep", "run_sweep", "sweep"]


def sweep(job: str | os.PathLike, space: dict, **options) -> SweepResult:
    """Sweep a job YAML from a Python script. `space`: {"train.lr": {"loguniform": [0.01, 0.3]}, ...};
    `options`: the other SweepConfig keys (name, storage_path (str or a path), num_samples, metric, mode,
    scheduler (a dict), searcher, lr_scaling, max_concurrent_trials, trial_max_failures, set)."""
    if not isinstance(job, (str, os.PathLike)):  # str() of a JobConfig made a 2 KB "config file ... does not exist"
        raise ConfigError(f"sweep(): job takes the path of a job YAML (str or os.PathLike), got {type(job).__name__}: "
                          f"write a JobConfig to a file first (behemoth.config.dump_yaml(cfg))")
    if isinstance(options.get("storage_path"), os.PathLike):  # a path, as load_config takes the job's
        options["storage_path"] = os.fspath(options["storage_path"])
    raw = {"job": os.fspath(job), "space": space, **options}
    return run_sweep(from_dict(SweepConfig, raw, where="sweep()"))


def run_sweep(sweep_cfg: SweepConfig) -> SweepResult:
    """Check the sweep, start (or resume: same name) it, and return its results. Blocks until it ends. One
    driver per sweep folder (storage/runlock.py): its trials' run folders are inside it."""
    from behemoth.storage.runlock import RunLock

    jobs = check_sweep(sweep_cfg)
    place = sweep_place(sweep_cfg)
    with RunLock(place.folder, f"sweep '{sweep_cfg.name}'") as held:
        return _run_sweep(sweep_cfg, jobs, place, held.fence())


def _run_sweep(sweep_cfg: SweepConfig, jobs: list, place: paths.RunPlace, fence) -> SweepResult:
    sweep_dir = place.folder
    metric, mode = metric_and_mode(sweep_cfg, jobs[0])
    from behemoth.driver.run.sequence import prepare_data

    for job in _distinct_data(jobs):  # checks the data, starts Ray; text: tokenised once, here, into the cache
        prepare_data(job)
    through_ray_train = sorted({why for why in map(lane_reason, jobs) if why is not None})
    record = _check_same_sweep(sweep_cfg, sweep_dir, jobs)
    warmup.start_data_stats_actor()
    import ray
    from ray import tune

    concurrent = sweep_cfg.max_concurrent_trials or concurrency_bound(jobs, ray.cluster_resources())
    record.update(max_concurrent_trials=concurrent, trial_max_failures=sweep_cfg.trial_max_failures)
    if tune.Tuner.can_restore(sweep_dir):  # Tune restores the first start's: what applies is said as it is
        concurrent = _restored_limits(sweep_dir, record)
    mlflow_parent = _sweep_mlflow_run(sweep_cfg, jobs[0], sweep_dir)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, sweep=_to_dict(sweep_cfg), base=base_job(sweep_cfg), place=place,
                             mlflow_parent=mlflow_parent, fence=fence, worker_env=ray_session.worker_env_vars()),
        trial_process_resources(base_job(sweep_cfg), sweep_cfg.lr_scaling))
    print(f"[behemoth] sweep {sweep_cfg.name}: {metric} ({mode}), {_count(sweep_cfg)} trials, at most "
          f"{concurrent} at once, scheduler {sweep_cfg.scheduler.kind}; folder {sweep_dir}", flush=True)
    print(f"[behemoth] {_lanes_line(jobs)}", flush=True)
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
                scheduler=_scheduler(sweep_cfg, jobs), search_alg=_searcher(sweep_cfg, metric, mode),
                # A trial's actor serves the next trial of the same resources: a lane stays warm. Not where trials
                # go through Ray Train: there a reused actor whose trial ASHA had stopped was seen to leave the next
                # trial's reports unread (its Ray Train controller blocked in TuneReportCallback's queue, Tune
                # never asking the actor for a result: the sweep hung; 2-worker trials, 2 at once, Ray 2.60).
                reuse_actors=not through_ray_train),
            run_config=tune.RunConfig(
                name=place.name, storage_path=place.storage, verbose=0,
                failure_config=tune.FailureConfig(max_failures=sweep_cfg.trial_max_failures),
                callbacks=[TrialOutcomeLines(metric)]),
        )
    # Tune's state (tuner.pkl) now exists, and a rerun restores it: from here the sweep is what it was started as
    _record_sweep(sweep_dir, record)
    with OrphanedPlacementGroupReaper() if through_ray_train else contextlib.nullcontext(), \
            ray_session.signal_handlers_kept():
        grid = tuner.fit()
    fence.check("writing the sweep's results.csv and best.yaml")
    result = write_results(sweep_cfg, grid, metric, mode, place)
    _finish_tracking(jobs[0], sweep_dir, mlflow_parent, result)
    return result


def _lanes_line(jobs: list[JobConfig]) -> str:
    """Which of the sweep's trials train in warm lanes, and why the others go through Ray Train."""
    why = [lane_reason(job) for job in jobs]
    lanes = sum(w is None for w in why)
    line = (f"{lanes} of {len(jobs)} trial configs in warm lanes (one worker: trained in the trial's Tune actor, "
            f"which the next trial reuses)" if lanes else "no trial in a warm lane")
    others = sorted({w for w in why if w is not None})
    return line + (f"; through Ray Train: {'; '.join(others)}" if others else "")


def sweep_place(sweep_cfg: SweepConfig) -> paths.RunPlace:
    """Where the sweep lives: STORAGE_PATH/NAME (its trials' runs in runs/ inside it)."""
    return paths.RunPlace.of(sweep_cfg.storage_path, sweep_cfg.name, key="name")


def _sweep_mlflow_run(sweep_cfg: SweepConfig, job: JobConfig, sweep_dir: str) -> str | None:
    """The sweep's parent MLflow run (its trials' runs nest under it), kept across resumes; None if off."""
    if not job.tracking.mlflow.uri:
        return None
    from behemoth.tracking import mlflow_run

    mlflow_run.client(job.tracking.mlflow.uri)  # MLflow not installed: a config error now
    try:
        return mlflow_run.open_run(job.tracking.mlflow.uri, job.tracking.mlflow.experiment, sweep_dir,
                                   f"sweep {sweep_cfg.name}", paths.redacted(_to_dict(sweep_cfg)))
    except Exception as e:  # noqa: BLE001 - tracking never stops a sweep
        print(f"[behemoth] WARNING: MLflow ({paths.redacted(job.tracking.mlflow.uri)}) is off for this sweep: "
              f"{type(e).__name__}: {e}", flush=True)
        return None


def _finish_tracking(job: JobConfig, sweep_dir: str, mlflow_parent: str | None, result: SweepResult) -> None:
    """The sweep's report (tracking.report) and its MLflow parent run's artifacts and end."""
    report = None
    if job.tracking.report:
        from behemoth.tracking.run_report import write_sweep_report

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


def _to_dict(sweep_cfg: SweepConfig) -> dict:
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


def _check_same_sweep(sweep_cfg: SweepConfig, sweep_dir: str, jobs: list[JobConfig] | None = None) -> dict:
    """A rerun of a sweep name resumes it (where Tune has state to restore: Tuner.can_restore, as _run_sweep
    decides): with the same job, space, metric, mode, scheduler and searcher only (Tuner.restore keeps the first
    start's scheduler and searcher, while results.csv would rank by the new metric). Returns what the first
    start records (_record_sweep); a start that failed before Tune's state existed records nothing, so its
    corrected rerun is a new sweep, not a refused one. `jobs`: check_sweep's trial jobs (default: the job alone)."""
    from ray import tune

    job = base_job(sweep_cfg)
    cfg = config_from_dict(job, where="the sweep's job")
    jobs = jobs or [cfg]
    metric, mode = metric_and_mode(sweep_cfg, cfg)
    scheduler = dataclasses.asdict(sweep_cfg.scheduler)
    if sweep_cfg.scheduler.kind == "asha":  # its default max_t resolved: the same run length either way
        scheduler["max_t"] = asha_max_t(sweep_cfg, jobs)
    now = {"job": job, "space": sweep_cfg.space, "num_samples": sweep_cfg.num_samples,
           "lr_scaling": sweep_cfg.lr_scaling, "metric": metric, "mode": mode, "scheduler": scheduler,
           "searcher": sweep_cfg.searcher}
    path = Path(sweep_dir, "sweep.yaml")
    if path.is_file() and tune.Tuner.can_restore(sweep_dir):
        before = yaml.safe_load(path.read_text()) or {}
        # (a record of an earlier version lacks the later keys: those are not compared; nor, in its job, a key
        # added to behemoth since, whose value is None: read as a run's resume reads its job.yaml)
        changed = [key if key != "job" else f"job ({', '.join(_job_changes(before[key], now[key]))})"
                   for key in now if key in before and (_job_changes(before[key], now[key]) if key == "job"
                                                        else before[key] != now[key])]
        if changed:
            raise ConfigError(f"sweep '{sweep_cfg.name}' in {sweep_dir} was started with a different "
                              f"{' and '.join(changed)}: give this sweep another name (name=...), or delete the "
                              f"folder to start it over")
    return now


def _restored_limits(sweep_dir: str, record: dict) -> int:
    """A resumed sweep's max_concurrent_trials and trial_max_failures are the first start's (Tuner.restore takes
    no TuneConfig): kept in `record` as they apply, a rerun's other values said in one line, not silently dropped.
    Returns the concurrency that applies. (A record of an earlier version without them: the rerun's, as before.)"""
    path = Path(sweep_dir, "sweep.yaml")
    before = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    differ = [f"{key} {before[key]} (this rerun's: {record[key]})" for key in ("max_concurrent_trials",
              "trial_max_failures") if before.get(key) is not None and before[key] != record[key]]
    if differ:
        print(f"[behemoth] resuming: Tune restores the first start's {' and '.join(differ)}; to run with other "
              f"limits, give the sweep another name", flush=True)
    record.update({key: before[key] for key in ("max_concurrent_trials", "trial_max_failures")
                   if before.get(key) is not None})
    return record["max_concurrent_trials"]


def _job_changes(before: dict, now: dict) -> list[str]:
    """The keys of a sweep's job whose values differ, `before` read as a run's resume reads its job.yaml: a key
    added to behemoth since is no change (its value then, or None: storage/checkpoint.as_written_then)."""
    from behemoth.storage.checkpoint import as_written_then

    before = as_written_then(before or {})
    return [f"{section}.{key}" for section, values in now.items() for key, value in values.items()
            if (before.get(section) or {}).get(key) != value]


def _record_sweep(sweep_dir: str, record: dict) -> None:
    """sweep.yaml: what a rerun must repeat, written once Tune's state exists (a rerun restores it)."""
    path = Path(sweep_dir, "sweep.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(record, sort_keys=False))


def _domain(dist: dict):
    from ray import tune

    kind, values = next(iter(dist.items()))
    if kind in ("grid", "choice"):
        return {"grid": tune.grid_search, "choice": tune.choice}[kind](values)
    if kind in INTEGER_RANGES:  # the sweep's high is drawn too; Tune's upper bound is not
        return getattr(tune, kind)(values[0], values[1] + 1)
    return getattr(tune, kind)(*values)


def _scheduler(sweep_cfg: SweepConfig, jobs: list[JobConfig]):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    s = sweep_cfg.scheduler
    if s.kind == "fifo":
        return FIFOScheduler()
    max_t = asha_max_t(sweep_cfg, jobs)
    # No decision at the run's end: ASHA puts a rung at max_t itself, where "stopping" a trial that has
    # trained to its end kills its Ray Train controller while it shuts down, after it has released Ray
    # Train's placement-group cleaner and before it has removed its placement group, which then holds its CPUs
    # after the sweep. A max_t a hair below the run's length keeps the rungs below it.
    # stop_last_trials=False: a trial ends by itself (and writes its summary).
    return ASHAScheduler(time_attr=s.time_attr, max_t=max_t * (1 - 1e-6), grace_period=s.grace_period,
                         reduction_factor=s.reduction_factor, stop_last_trials=False)


def _searcher(sweep_cfg: SweepConfig, metric: str, mode: str):
    return optuna_searcher(sweep_cfg, metric, mode) if sweep_cfg.searcher == "optuna" else None
