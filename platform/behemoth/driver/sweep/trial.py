"""One trial of a sweep, in the Tune actor that runs it: the trial's job trained by behemoth (in a warm lane where
it has one worker, through Ray Train otherwise), its evaluations forwarded to Tune; and the driver's console
line for each trial as it ends."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from ray.tune import Callback
from ray.tune.integration.ray_train import TuneReportCallback

from behemoth.storage import paths
from behemoth.config import from_dict
from behemoth.metrics import logged_reports
from behemoth.driver.sweep.config import SweepConfig, lane_reason, lane_resources, metric_and_mode, trial_job

TRIAL_DRIVER_MEMORY = 512 * 1024**2  # bytes: a trial's process (Ray, torch imported) holds ~0.4 GiB


def run_trial(params: dict, sweep: dict, base: dict, place: paths.RunPlace, mlflow_parent: str | None = None,
              fence=None, worker_env: dict | None = None) -> None:
    """One trial (runs in a Tune actor): the trial's job, trained by behemoth, evaluations sent to Tune.

    A trial of one worker trains here, in this actor, which Tune reuses for the next trial (a warm lane,
    driver/sweep/lane.py); one of several workers runs a TorchTrainer of its own from here. The run folder is
    SWEEP_DIR/runs/TRIAL_ID, so a trial that Tune restarts (a resumed sweep, a retried error) resumes from its
    own latest checkpoint. Every start is appended to SWEEP_DIR/trial_starts.jsonl, with the state of the
    process it starts in (a reused lane's: what the trials before it left). `mlflow_parent`: the sweep's MLflow
    run, under which the trial's run nests. `worker_env`: what Ray Train's workers get (a lane sets it). A trial writes no report of its own (the sweep's
    report shows every trial; `behemoth report SWEEP/runs/TRIAL` draws one on demand).
    """
    from ray import tune

    from behemoth.driver.run.trainer import train
    # (the lane, which imports torch, where it is used: a trial through Ray Train hands EvalReportCallback, of this
    # module, to its controller, which imports no torch: ray_internals/torch_backend.py)
    from behemoth.driver.sweep.lane import train_in_lane

    sweep_cfg = from_dict(SweepConfig, sweep, where="sweep")
    trial_id = tune.get_context().get_trial_id()
    trial = place.child("runs", trial_id)
    run_dir = trial.folder
    cfg = trial_job(base, params, sweep_cfg.lr_scaling, trial)
    cfg.tracking.report = False
    metric, _ = metric_and_mode(sweep_cfg, cfg)
    summary_file = Path(run_dir, "summary.json")
    # Tune saves its experiment state at most every ~10 s: a sweep killed just after a trial finished may
    # restart that trial. Its summary says it is done: hand Tune the final result again, train nothing.
    finished_before = summary_file.is_file()
    why_not = lane_reason(cfg)
    _append_jsonl(place.join("trial_starts.jsonl"), {
        "trial_id": trial_id, "time": time.time(), "params": params, "lr": cfg.train.lr,
        "finished_before": finished_before, "lane": why_not is None, **process_state()})
    described = ", ".join(f"{k}={v}" for k, v in params.items())
    if finished_before:
        print(f"[behemoth] trial {trial_id} ({described}) had finished: its result is kept", flush=True)
        tune.report(json.loads(summary_file.read_text())["metrics"])
        return
    how = f"in a warm lane (pid {os.getpid()})" if why_not is None else f"through Ray Train: {why_not}"
    print(f"[behemoth] trial {trial_id} ({described}, lr {cfg.train.lr:g}) {how}; run folder {run_dir}",
          flush=True)
    if why_not is None:
        summary = train_in_lane(cfg, forward=_evaluations_to_tune(metric), parent_mlflow_run=mlflow_parent,
                                fence=fence, worker_env=worker_env)
    else:
        summary = train(cfg, callbacks=[EvalReportCallback(metric)], lock=False,  # under the sweep's lease,
                        parent_mlflow_run=mlflow_parent, fence=fence)  # fenced by it (storage/runlock.py)
    # Written when the trial has trained to its end (a trial ASHA stops never gets here).
    tmp = summary_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "metrics": summary.metrics, "best_checkpoint": summary.best_checkpoint,
        "latest_checkpoint": summary.latest_checkpoint, "resumed_from_step": summary.resumed_from_step}))
    os.replace(tmp, summary_file)  # all or nothing: a half-written summary would pass for a finished trial


def _open_fds() -> list[str]:
    """What this process's file descriptors point at: a path, a kind ("pipe", "anon_inode:[eventfd]"), or for a
    socket its family and, where connected over TCP, the port it connects to ("tcp -> 10003": Ray's daemons and
    worker processes listen on such ports; raylet.out and the workers' logs name them)."""
    try:  # (psutil comes with the lora extra (peft), not with behemoth itself: without it, "socket")
        import psutil

        sockets = {c.fd: c for c in psutil.Process().net_connections(kind="all")}
    except ImportError:
        sockets = {}
    seen = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (closed since the listing: the listing's own descriptor among them)
            continue
        if target.startswith("socket:"):
            target = _socket_kind(sockets.get(int(fd)))
        seen.append(re.sub(r"^pipe:\[\d+\]$", "pipe", target))
    return sorted(seen)


def _socket_kind(connection) -> str:
    """A socket as psutil's connection tuple describes it (None: one psutil does not list)."""
    if connection is None:
        return "socket"
    if connection.raddr and connection.family.name != "AF_UNIX":
        return f"tcp -> {connection.raddr.port}"
    return connection.family.name.lower() + (" listening" if connection.status == "LISTEN" else "")


def process_state() -> dict:
    """The trial's process as the trial finds it: its pid, threads, open files (and what each points at), torch's
    threads, resident memory, how many earlier trials' models are still reachable and, once CUDA is in use, the GPU
    memory torch holds. In a reused lane, what the trials before left: the same from one trial to the next, or they
    leak."""
    import threading

    import torch

    # (a thread's default name counts the threads the process ever made: "Thread-8 (run)" is one of a kind)
    state = {"pid": os.getpid(),
             "threads": sorted(re.sub(r"^Thread-\d+", "Thread", t.name) for t in threading.enumerate()),
             "torch_threads": torch.get_num_threads()}
    try:  # (Linux's /proc; elsewhere the two are left out)
        with open("/proc/self/statm") as f:
            state["rss_mb"] = round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
        state["fds"] = _open_fds()
        state["open_files"] = len(state["fds"])
    except OSError:
        pass
    from behemoth.hosts.lane import models_alive

    state["models_alive"] = models_alive()  # earlier trials' models still reachable in this process: none
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # what CUDA's caching allocator holds
        state["cuda_allocated_mb"] = round(torch.cuda.memory_allocated() / 2**20, 1)
        state["cuda_reserved_mb"] = round(torch.cuda.memory_reserved() / 2**20, 1)
    return state


def trial_process_resources(base: dict, lr_scaling: str):
    """Tune's resources for a trial, from its sampled values: a lane holds its worker's CPUs and GPU (it is the
    worker); a trial through Ray Train holds none (its workers hold theirs), only its process's memory."""
    def resources(params: dict) -> dict:
        cfg = trial_job(base, params, lr_scaling)
        held = lane_resources(cfg) if lane_reason(cfg) is None else {"CPU": 0}
        return {**held, "memory": TRIAL_DRIVER_MEMORY}  # (Ray refuses an empty request)

    return resources


def _evaluations_to_tune(metric: str):
    """A lane's reports that carry the metric (the evaluations), to Tune, from the training thread: Tune's
    scheduler decides there (ASHA stops a trial by raising SystemExit in that thread)."""
    from ray import tune

    def forward(metrics: dict) -> None:
        if metric in metrics:
            tune.report({k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))})

    return forward


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
        if self.metric in metrics[0]:  # (without the logged steps it carries: the run's records have them)
            super().after_report(run_context, [logged_reports(m)[-1] for m in metrics], checkpoint)


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
