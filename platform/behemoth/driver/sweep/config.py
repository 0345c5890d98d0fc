"""A sweep's schema and the jobs it makes: the sweep YAML (SweepConfig), the job every trial starts from, a
trial's full job config (sampled values, LR scaling, its run folder), the checks made on the driver before
Ray starts (every space key a job key, every value a valid job, the metric one the task reports), and the
resources one trial holds, which bound how many run at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from behemoth.storage import paths
from behemoth.config import JobConfig, apply_override, from_dict, read_yaml_mapping
from behemoth.config.train_section import check_finite
from behemoth.errors import ConfigError, closest_key, did_you_mean
from behemoth.driver.run.preflight import check_outlives_the_job
from behemoth.job import config_from_dict, left_to_the_model, load_config
from behemoth.tasks import task_of
from behemoth.storage.store import Store

DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform", "randint", "lograndint")
# integer draws, both ends included (Tune's randint leaves its upper bound out: tuner._domain adds one)
INTEGER_RANGES = ("randint", "lograndint")


@dataclass
class SchedulerConfig:
    # asha: stop trials whose metric at a rung (grace_period x reduction_factor^k) is in the bottom part.
    kind: Literal["asha", "fifo"] = "asha"
    # What a rung counts: epochs, or optimizer steps (runs that evaluate every N steps).
    time_attr: Literal["epoch", "step"] = "epoch"
    grace_period: float = 1
    reduction_factor: float = 2
    # The run length ASHA plans for (default: the shortest trial's epochs, or its steps).
    max_t: float | None = None


@dataclass
class SweepConfig:
    # The job YAML every trial starts from (relative to the sweep file).
    job: str = ""
    # Overrides applied to every trial before the space, like `behemoth train --set`.
    set: list[str] = field(default_factory=list)
    # KEY: {grid: [...]} | {choice: [...]} | {uniform: [low, high]} | {loguniform: [low, high]}
    #      | {randint: [low, high]} | {lograndint: [low, high]} (integers, both ends included)
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
        check_finite(self, "")  # a NaN passes the range checks below (every comparison with it is false)
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
    if kind in INTEGER_RANGES:
        ok = len(values) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in values) \
            and values[0] < values[1]
        if not ok or (kind == "lograndint" and values[0] <= 0):
            raise ConfigError(f"space.{key}.{kind} needs [low, high], two integers with low < high"
                              f"{' and low > 0' if kind == 'lograndint' else ''} (both drawn), got {values}")


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> SweepConfig:
    """Read a sweep YAML. `overrides` (`KEY=VALUE`): a sweep key (name=..., scheduler.grace_period=2), or a
    job key (data.root=..., train.epochs=2), which is added to the sweep's `set` list for every trial."""
    p = Path(path)
    raw = read_yaml_mapping(p, "sweep file", "sweep keys (name, job, space, ...)")
    job_sections = {f.name for f in dataclasses.fields(JobConfig)}
    for item in overrides or []:
        if item.split("=", 1)[0].strip().startswith("space."):
            raise ConfigError(_space_override_error(item))
        if item.split(".", 1)[0] in job_sections:
            raw["set"] = list(raw.get("set") or []) + [item]
        else:
            apply_override(raw, item)
    sweep_cfg = from_dict(SweepConfig, raw, where=str(p))
    if sweep_cfg.job and not Path(sweep_cfg.job).is_absolute():
        given, sweep_cfg.job = sweep_cfg.job, str(p.parent / sweep_cfg.job)
        # read from the sweep file's folder, not the working directory: say so, with the path that would work
        if not Path(sweep_cfg.job).is_file():
            fix = f": write job: {os.path.relpath(given, p.parent)}" if Path(given).is_file() else ""
            raise ConfigError(f"{p}: job: {given} is not found relative to the sweep file's folder "
                              f"({sweep_cfg.job} does not exist){fix}")
    try:
        sweep_cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    return sweep_cfg


def _space_override_error(item: str) -> str:
    """`--set space.train.lr.grid=[0.1]`: a space key holds dots of its own (train.lr), so a dotted --set cannot
    name one; the whole space can be given, which this message spells out from the item."""
    dotted, _, value = item.partition("=")
    parts = dotted.strip().split(".")[1:]
    if len(parts) > 2 and parts[-1] in DISTRIBUTIONS:
        example = f"{{{'.'.join(parts[:-1])}: {{{parts[-1]}: {value or '[...]'}}}}}"
    else:
        example = f"{{{'.'.join(parts) or 'train.lr'}: {value or '{grid: [...]}'}}}"
    return (f"--set {item}: a space key has dots of its own, so --set cannot reach into the space: give the whole "
            f"space (it replaces the file's), --set 'space={example}'")


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
    job = cfg.to_dict()
    if any(key.startswith("model.") for key in sweep_cfg.space):  # each trial's model fills them, not the job's
        job["data"].update(left_to_the_model(sweep_cfg.job, sweep_cfg.set, cfg))
    return job


def _absolute(path: str) -> str:
    """A relative path that exists here (or a cache folder) made absolute; URIs and hub names unchanged."""
    if not path or os.path.isabs(path) or not (os.path.exists(path) or path.endswith("cache")):
        return path
    return Store(path).absolute()


def trial_job(base: dict, params: dict, lr_scaling: str = "none", place: paths.RunPlace | None = None) -> JobConfig:
    """The full job config of a trial with sampled values `params` ({"train.lr": 0.05, ...}); `place`: where
    the trial runs (its run folder, in the sweep's)."""
    raw = {section: dict(values) for section, values in base.items()}
    for key, value in params.items():
        section, name = key.split(".", 1)
        raw[section][name] = value
    if place is not None:
        raw["checkpoint"].update(storage_path=place.storage, run_name=place.name)
        if raw["train"].get("sample_ledger"):
            raw["train"]["sample_ledger"] = place.join("ledger")
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
    direction = default_mode if metric == default_metric else reported[metric]  # (as tasks.contract.run_metric)
    if sweep_cfg.mode is not None and sweep_cfg.mode != direction:  # the "best" trial would be the worst
        raise ConfigError(f"mode {sweep_cfg.mode} contradicts metric {metric}, which the task reports as "
                          f"{'higher' if direction == 'max' else 'lower'}-is-better: set mode: {direction} or "
                          f"leave mode out (it follows the metric)")
    return metric, direction


def check_sweep(sweep_cfg: SweepConfig) -> list[JobConfig]:
    """Every job the space can produce must be valid: the grid's and choices' values all combined, and each
    range's two ends. Returns those jobs (for the resource bound). Raises ConfigError naming the key."""
    sweep_cfg.validate()
    if not Store(sweep_cfg.storage_path).is_local:  # its own files (trial starts, results, best.yaml) are local files
        raise ConfigError(f"sweep storage_path {sweep_cfg.storage_path}: a sweep keeps its folder on a local or "
                          f"shared filesystem (an object store is not supported for sweeps yet; single runs "
                          f"support it): give a path, e.g. a shared mount on a cluster")
    check_outlives_the_job("storage_path", sweep_cfg.storage_path)  # (trials' runs are in the sweep's folder)
    base = base_job(sweep_cfg)  # the job file itself first: its errors name it
    check_outlives_the_job("tracking.mlflow.uri", base["tracking"]["mlflow"]["uri"])
    axes, valid = [], _job_keys(base)
    for key, dist in sweep_cfg.space.items():
        if key not in valid:
            raise ConfigError(f"space key '{key}' is not a key of the sweep's job (data.kind {base['data']['kind']})"
                              f"{_suggest_key(key, list(valid))}")
        kind, values = next(iter(dist.items()))
        # Only a range's two ends become jobs below, and integer ends pass: the floats Tune draws between them
        # would fail in every trial, after Ray started
        if kind in ("uniform", "loguniform") and _takes(valid[key], int) and not _takes(valid[key], float):
            raise ConfigError(f"space.{key}: {kind} draws floats and the key is an integer: use randint, choice "
                              f"or grid (e.g. {{choice: [{values[0]}, {values[1]}]}})")
        axes.append([(key, v) for v in values])
    jobs = []
    for combination in itertools.product(*axes):
        try:
            jobs.append(trial_job(base, dict(combination), sweep_cfg.lr_scaling))
        except ConfigError as e:
            values = ", ".join(f"{k}={v!r}" for k, v in combination)
            raise ConfigError(f"space: the trial {values} is not a valid job: {e}") from None
    metric_and_mode(sweep_cfg, jobs[0])
    if sweep_cfg.scheduler.kind == "asha":  # its max_t against every trial's length
        asha_max_t(sweep_cfg, jobs)
    if sweep_cfg.searcher == "optuna":
        optuna_searcher(sweep_cfg, "val_loss", "min")  # raises the install hint when optuna is missing
    return jobs


def _job_keys(base: dict) -> dict[str, Any]:
    """Every key (section.field) of the sweep's job, with its type; its data section's are those of its kind."""
    job = config_from_dict(base, where="the sweep's job")
    keys = {}
    for s in dataclasses.fields(job):
        hints = typing.get_type_hints(type(getattr(job, s.name)))
        keys.update({f"{s.name}.{f.name}": hints[f.name] for f in dataclasses.fields(getattr(job, s.name))})
    return keys


def _takes(tp: Any, kind: type) -> bool:
    """Whether a config key of type `tp` takes a value of type `kind` (int or float)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_takes(a, kind) for a in typing.get_args(tp))
    return tp is Any or tp is kind


def _suggest_key(key: str, valid: list[str]) -> str:
    """The did-you-mean of a space key: matched on its field name within its section, where other trainers'
    names (errors.KEY_SYNONYMS) count (the whole dotted names matched `train.learning_rate` with
    `train.min_lr_ratio`); a bare field name is looked for in every section."""
    fields: dict[str, list[str]] = {}  # field name -> the sections that have it
    for name in valid:
        section, field_name = name.split(".", 1)
        fields.setdefault(field_name, []).append(section)
    section, _, name = key.rpartition(".")
    if section and section not in {s for ss in fields.values() for s in ss}:
        return did_you_mean(key, valid)  # an unknown section: the whole name is all there is to match
    close = closest_key(name, [f for f, sections in fields.items() if not section or section in sections])
    if close is None:
        return ""
    return "; did you mean " + " or ".join(f"'{s}.{close}'" for s in ([section] if section else fields[close])) + "?"


def asha_max_t(sweep_cfg: SweepConfig, jobs: list[JobConfig]) -> float:
    """The run length ASHA plans for, in its time_attr: scheduler.max_t, by default the shortest trial's (`jobs`:
    every trial job check_sweep makes). ConfigError where a rung would fall at a trial's last report, or ASHA
    would have no rung before a trial's end."""
    s = sweep_cfg.scheduler
    key = "train.epochs" if s.time_attr == "epoch" else "train.max_steps"
    lengths = [length for job in jobs
               if (length := job.train.epochs if s.time_attr == "epoch" else job.train.max_steps) is not None]
    shortest = min(lengths, default=None)
    # The shortest, not the first trial's: with train.epochs in the space, the first trial's length put ASHA's
    # rungs at a shorter trial's last report
    max_t = s.max_t or shortest
    if max_t is None:
        raise ConfigError("scheduler.time_attr is step and the job has no train.max_steps: set scheduler.max_t")
    # Past a run's end, ASHA's rungs reach that trial's last report: the decision _scheduler's max_t a hair
    # below the run's length avoids (stopping a trial that is shutting down can leak its placement group)
    if shortest is not None and max_t > shortest:
        raise ConfigError(f"scheduler.max_t {max_t:g} is longer than a trial ({key} {shortest}), so ASHA would "
                          f"decide at a trial's last report: set scheduler.max_t to at most {shortest}, or leave "
                          f"it out (it follows the shortest trial)")
    if max_t <= s.grace_period:  # Ray's ASHAScheduler would fail on an assertion (its max_t is a hair below)
        raise ConfigError(f"scheduler asha: a trial lasts {max_t:g} {s.time_attr}(s), not more than "
                          f"scheduler.grace_period {s.grace_period:g}, so ASHA has no point to stop a trial before "
                          f"its end: lower scheduler.grace_period, train longer, or use scheduler.kind: fifo")
    return max_t


def optuna_searcher(sweep_cfg: SweepConfig, metric: str, mode: str):
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


def check_sweep_file(path: str, overrides: list[str]) -> int:
    """`behemoth check SWEEP.yaml`: the sweep's keys and space, every trial's job (each grid combination and
    each range's ends) and each distinct data, as `behemoth tune` checks them before Ray starts; then one line
    per data and a summary. Nothing is started."""
    import json

    from behemoth.driver.run import preflight
    from behemoth.driver.run.sequence import check_data
    from behemoth.tasks import task_of

    sweep_cfg = load_sweep(path, overrides)
    jobs = check_sweep(sweep_cfg)
    described = {}
    for job in jobs:
        key = json.dumps(job.to_dict()["data"], sort_keys=True)
        task = task_of(job)
        if key not in described:
            described[key] = (check_data(job, task, epoch=False), task)  # the data once per distinct data
        checked, _ = described[key]
        preflight.check_epoch(job, task.train_samples(job, checked))  # every trial's batch size
    metric, mode = metric_and_mode(sweep_cfg, jobs[0])
    for checked, task in described.values():
        print(f"# data: {task.describe(jobs[0], checked)}")
    print(f"# sweep {sweep_cfg.name}: {len(jobs)} trial jobs checked ({', '.join(sweep_cfg.space)}); metric "
          f"{metric} ({mode}); scheduler {sweep_cfg.scheduler.kind}; folder {sweep_cfg.storage_path}")
    return 0


# Which trials train in a warm lane (lane.py), decided from the job alone: here, not in lane.py, whose imports
# (torch) the sweep's driver and a trial's Ray Train controller (it unpickles trial.EvalReportCallback) need not pay.
def lane_reason(cfg: JobConfig) -> str | None:
    """None where a trial of `cfg` trains in a warm lane; else why it goes through Ray Train."""
    s = cfg.scaling
    if s.elastic or s.num_workers != 1:
        return f"{s.num_workers} workers (a lane trains one)"
    if s.strategy != "ddp":
        return f"scaling.strategy {s.strategy} (FSDP shards over a process group)"
    if cfg.checkpoint.sharded(s.strategy):
        return "sharded checkpoints (written through a process group)"
    if cfg.train.compile:
        return "train.compile (a compiled graph would stay in the lane's process)"
    return None


def lane_resources(cfg: JobConfig) -> dict:
    """What a lane holds while its trial trains: the one worker's CPUs and GPU (the trial's process is it)."""
    from behemoth.driver.run.trainer import worker_resources

    return worker_resources(cfg)
