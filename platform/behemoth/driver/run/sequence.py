"""Driver side: one run's sequence, the same whichever way the run starts. The driver's mirror of hosts/ on the
worker side: there a host per way a worker runs (Ray Train's, a lane's), here a launcher per way a run starts
(Ray Train's TorchTrainer: driver/run/trainer.py; a sweep's warm lane: driver/sweep/lane.py). `behemoth eval`
(driver/run/evaluation.py) is not a launcher: it takes `prepare_data` alone (the task resolved once, its data
checked and prepared as a run's), then a TorchTrainer of evaluation workers; the other steps are about a run
folder (its checkpoints, a rerun's changed keys, retention, the summary), which an evaluation does not have.

    resolve    the task (once), the run's place, its complete checkpoints (listed once), the one a rerun
               resumes from and its job.yaml (read verified once)
    check      a rerun: its data and model unchanged, what its changed train.* / scaling.* keys do (said before
               anything starts; the unsafe ones refused), train.init_from resolved once
    prepare    the task checks its data before Ray (check_data: the one check path, `behemoth check`'s too),
               Ray starts, the task prepares what the workers read (the launcher's: a lane keeps it per process)
    launch     the launcher's: a TorchTrainer's fit, the lane's loop with its restarts
    retire     checkpoint.keep applied to complete checkpoints nobody registered
    summarise  the run's summary; the invocation's records finished (ended: "finished" or "failed"); a rerun
               that trained nothing while ignoring changed keys refused
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol

from behemoth.config import JobConfig
from behemoth.driver.run import preflight, resume
from behemoth.driver.run.summary import RunSummary, summarise
from behemoth.storage import paths
from behemoth.tasks import Task, task_of


@dataclass
class PlannedRun:
    """A run as the sequence resolved it, before anything starts: what every later step reads instead of asking
    the config (and the run folder) again."""

    cfg: JobConfig
    task: type[Task]
    place: paths.RunPlace
    checkpoints: list[tuple[int, str]]  # the run folder's complete checkpoints, newest first, before the launch
    latest: tuple[str, dict] | None  # the checkpoint a rerun resumes from and its job.yaml's sections
    rerun: resume.Rerun | None = None

    @classmethod
    def resolve(cls, cfg: JobConfig) -> PlannedRun:
        from behemoth.storage.checkpoint import complete_checkpoints

        place = resume.run_place(cfg)
        found = complete_checkpoints(place.folder)
        return cls(cfg, task_of(cfg), place, found, resume.resumed_job(cfg, found))


@dataclass
class Launched:
    """What a launch hands back to the sequence: the checkpoints it registered (and kept) with their metrics, what
    the summary reads (Ray Train's Result, or the lane's equivalent), and rank 0's return value."""

    kept: list
    result: Any
    returned: dict = field(default_factory=dict)


class Launcher(Protocol):
    """One way a run starts. `prepare` returns the task's prepared data (usually `prepare_data`); `launch` trains
    and returns what it registered, raising RunFailedError (or behemoth's own one-line error) when the run fails;
    `records_failure` says whether an error out of `launch` ends the invocation's records as "failed";
    `ending` wraps the invocation's last records (Ray Train's launcher shuts Ray down beside them)."""

    def prepare(self, run: PlannedRun, mark: Callable[[str], None]) -> Any: ...

    def launch(self, run: PlannedRun, data: Any) -> Launched: ...

    def records_failure(self, error: BaseException) -> bool: ...

    def ending(self) -> ContextManager: ...


def run_sequence(cfg: JobConfig, launcher: Launcher, tracking, fence=None) -> RunSummary:
    """Run (or resume) the run of `cfg` through `launcher`, recording it in `tracking` (tracking.invocation's
    RunTracking). `fence`: the run lock's (or a sweep's), checked before the run deletes what it did not register."""
    from behemoth.checkpoints.retention import retire_unregistered  # (here: the checkpoints room imports torch)

    run = PlannedRun.resolve(cfg)
    resume.check_resume_compatible(cfg, run.latest)
    run.rerun = resume.describe_rerun(cfg, run.latest)  # what changed keys do from the resume step, said first
    if run.rerun is not None:
        print(f"[behemoth] {run.rerun.line(cfg)}", flush=True)
    run.cfg = cfg = resume.resolve_init_from(cfg, run.checkpoints)
    started = time.time()
    data = launcher.prepare(run, tracking.mark)
    resume.check_resume_data(cfg, data, run.checkpoints)
    try:
        launched = launcher.launch(run, data)
    except BaseException as e:
        if launcher.records_failure(e):  # else the invocation has no end record (a stopped trial, a killed driver)
            tracking.finish("failed")
        else:
            tracking.abandon()
        raise
    retire_unregistered(run.place, launched.kept, fence)  # older complete checkpoints nobody registered
    summary = summarise(cfg, launched.result, time.time() - started)
    returned = launched.returned
    with launcher.ending():
        tracking.finish("finished", returned.get("clock"), returned.get("final_step"), summary.best_checkpoint)
    summary.goodput, summary.report = tracking.account, tracking.report_path
    summary.tensorboard = cfg.tracking.tensorboard
    resume.check_something_trained(cfg, run.rerun, summary)
    return summary


def check_data(cfg: JobConfig, task: type[Task] | None = None, epoch: bool = True):
    """The task's data checked before Ray starts (every run, `behemoth check`, a sweep's every trial): the model
    and tokenizer sources, train.callbacks' classes, the task's own check, and that an epoch has a step
    (`epoch`). Returns what the task's check returned (its `checked` value)."""
    from behemoth.worker.step_callbacks import callback_classes

    task = task or task_of(cfg)
    preflight.check_sources(cfg)
    callback_classes(cfg.train.callbacks)
    checked = task.check(cfg)
    if epoch:
        preflight.check_epoch(cfg, task.train_samples(cfg, checked))
    return checked


def prepare_data(cfg: JobConfig, mark: Callable[[str], None] = lambda milestone: None, epoch: bool = True,
                 task: type[Task] | None = None):
    """The task checks its data (before Ray starts), Ray starts, the task prepares what the workers read.
    `mark`: called with each milestone's name (the goodput account's start-up detail); `task`: the job's, where
    the caller resolved it."""
    from behemoth.driver.ray_cluster import session as ray_session

    task = task or task_of(cfg)
    checked = check_data(cfg, task, epoch)
    mark("data_checked")
    ray_session.ensure_ray()
    mark("ray_ready")
    data = task.prepare(cfg, checked)
    if epoch:
        preflight.check_epoch(cfg, task.train_samples(cfg, data))  # (text: the blocks are known once packed)
    mark("data_ready")
    return data


def used_up(cfg: JobConfig, reasons: str, to_resume: str) -> str:
    """What failed, what is kept, what to do: for a run whose restarts (failure.max_failures) are used up.
    `to_resume`: how this way of starting a run resumes it (rerun the command; rerun the sweep)."""
    from behemoth.storage.checkpoint import complete_checkpoints

    folder = resume.run_dir(cfg)
    kept = complete_checkpoints(folder)  # (listed anew: the failed launch may have written some)
    latest = f" (latest at step {kept[0][0]}: {kept[0][1].rstrip('/').rpartition('/')[2]})" if kept else ""
    return (f"run '{cfg.checkpoint.run_name}' failed and failure.max_failures={cfg.failure.max_failures} restarts "
            f"are used up: {reasons}. Its checkpoints are kept in {folder}{latest}: {to_resume}")

