"""The driver's side of a run's records: one object per invocation of `train`.

It marks the invocation's start-up milestones, hands Ray Train the recorder (tracking/callbacks.py), and
when the run ends (finished or failed) writes the end of the invocation, then from one goodput account made
after it: goodput.json, the goodput scalars to TensorBoard and MLflow, the report; and closes the MLflow run.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import uuid

from behemoth.metrics import proc_start_time
from behemoth.storage import paths
from behemoth.config import JobConfig
from behemoth.tracking import goodput
from behemoth.tracking.records import METRICS, TIMELINE, JsonlLog, read_jsonl, write_text
from behemoth.storage.store import Store

GOODPUT = "goodput.json"


# Set by run.sh as it execs Python (after installing it): when this Python started (see process_start).
EXEC_TIME_ENV = "BEHEMOTH_EXEC_TIME"


def process_start() -> float | None:
    """When this Python started (the goodput account's start-up and the `first step` line count from it, imports
    included): Linux's /proc start time, or, where a shell `exec`ed Python after its own work (run.sh, after
    installing: the process, and so its /proc start, is the shell's), the exec's time the shell recorded in
    EXEC_TIME_ENV. The later of the two: a process this Python starts inherits the variable but started after
    it. None without /proc (the account then starts at `train`)."""
    started = proc_start_time()
    if started is None:
        return None
    try:
        return max(started, float(os.environ.get(EXEC_TIME_ENV, "")))
    except ValueError:  # not set (or not a number: a shell whose `date` has no %N)
        return started


class RunTracking:
    def __init__(self, cfg: JobConfig, run_dir: str, process_start: float | None = None,
                 parent_mlflow_run: str | None = None):
        self.cfg, self.run_dir = cfg, run_dir
        self.invocation = uuid.uuid4().hex[:12]
        now = time.time()
        self.marks = {"process_start": process_start or now, "invoked": now}
        self.parent_mlflow_run = parent_mlflow_run
        self.mlflow_run_id: str | None = None
        self.account: goodput.Account | None = None
        self.report_path: str | None = None

    def mark(self, name: str) -> None:
        self.marks[name] = time.time()

    def callbacks(self) -> list:
        """Called just before fit: the recorder for Ray Train, after the invocation's start is written."""
        from behemoth.tracking.callbacks import RunRecorder

        mlflow = self.cfg.tracking.mlflow
        if mlflow.uri and self.mlflow_run_id is None:
            from behemoth.tracking import mlflow_run

            mlflow_run.client(mlflow.uri)  # MLflow not installed: a config error, before the run starts
            self.mlflow_run_id = _quietly(
                f"MLflow ({paths.redacted(mlflow.uri)}: tracking is off for this run)", lambda: mlflow_run.open_run(
                    mlflow.uri, mlflow.experiment, self.run_dir, self.cfg.checkpoint.run_name,
                    paths.redacted(self.cfg.to_dict()), self.parent_mlflow_run))
        self.mark("fit_called")
        self._timeline().append({"time": time.time(), "event": "invocation_start", "invocation": self.invocation,
                                 "marks": self.marks})
        return [RunRecorder(self.run_dir, self.invocation, self.cfg.tracking.tensorboard,
                            (mlflow.uri, self.mlflow_run_id) if self.mlflow_run_id else None, self._wandb_target())]

    def _wandb_target(self) -> dict | None:
        """What the recorder opens the run's W&B run with (tracking/wandb_run.py), or None (W&B off)."""
        w = self.cfg.tracking.wandb
        if not w.project:
            return None
        from behemoth.tracking import wandb_run

        wandb_run.check_installed()  # not installed: a config error, before the run starts
        return {"project": w.project, "entity": w.entity, "mode": w.mode, "id": wandb_run.run_id(self.run_dir),
                "name": self.cfg.checkpoint.run_name, "dir": wandb_run.local_dir(self.run_dir),
                "config": paths.redacted(self.cfg.to_dict())}  # (no URI's password leaves for W&B)

    def finish(self, status: str, clock: dict | None = None, final_step: int | None = None,
               best_checkpoint: str | None = None) -> None:
        """`status`: finished or failed. `clock`: rank 0's final PhaseClock snapshot (a finished run).

        The invocation ends here (Ray Train has shut down): its end is written first, then the account is made
        once from the records, and goodput.json, TensorBoard's and MLflow's goodput scalars, the report and the
        summary all show that one account. Writing them comes after the end, outside the account (an account
        made before them and another after would disagree by the seconds they take)."""
        if "fit_called" not in self.marks:
            return  # never reached Ray Train: nothing recorded
        self._timeline().append({"time": time.time(), "event": "invocation_end", "invocation": self.invocation,
                                 "status": status, "clock": clock})
        account = goodput.account(read_jsonl(paths.join(self.run_dir, TIMELINE)),
                                  read_jsonl(paths.join(self.run_dir, METRICS)))
        self.account = account
        write_text(paths.join(self.run_dir, GOODPUT), json.dumps(account.as_dict(), indent=1))
        step = final_step or max((g.last_step for g in account.groups), default=0)
        if self.cfg.tracking.tensorboard:
            _quietly("TensorBoard", lambda: _tensorboard_final(self.run_dir, step, _scalars(account)))
        if self.cfg.tracking.report:
            from behemoth.tracking.run_report import write_run_report

            self.report_path = _quietly("the report", lambda: write_run_report(self.run_dir, account))
        if self.mlflow_run_id:
            from behemoth.tracking import mlflow_run

            def log() -> None:
                with _local_copies(self._artifacts(best_checkpoint)) as artifacts:
                    mlflow_run.finish(self.cfg.tracking.mlflow.uri, self.mlflow_run_id,
                                      "FINISHED" if status == "finished" else "FAILED", _scalars(account), step,
                                      artifacts=artifacts)

            _quietly("MLflow", log)

    def abandon(self) -> None:
        """The invocation ended without an end of its own (Ctrl-C, a stopped driver, a sweep's trial the scheduler
        stopped): no record of it is written, but its MLflow run is KILLED, not left RUNNING for good."""
        if self.mlflow_run_id:
            from behemoth.tracking import mlflow_run

            _quietly("MLflow", lambda: mlflow_run.client(self.cfg.tracking.mlflow.uri).set_terminated(
                self.mlflow_run_id, status="KILLED"))

    def _artifacts(self, best_checkpoint: str | None) -> list[str]:
        """The report's folder and the best (else the latest) checkpoint's manifest, local or under a URI."""
        from behemoth.storage.checkpoint import MANIFEST, complete_checkpoints
        from behemoth.storage.weights import is_checkpoint

        out = []
        if self.report_path:
            out.append(os.path.dirname(self.report_path))  # a URI's too: '/' separates its parts
        kept = complete_checkpoints(self.run_dir)
        chosen = best_checkpoint or (kept[0][1] if kept else None)
        if chosen and is_checkpoint(chosen):
            out.append(paths.join(chosen, MANIFEST))
        return out

    def _timeline(self) -> JsonlLog:
        return JsonlLog(paths.join(self.run_dir, TIMELINE))


@contextlib.contextmanager
def _local_copies(sources: list[str]):
    """Local paths of `sources` while the block runs: MLflow's client logs local files, so a URI's file or
    folder is downloaded into a temporary folder (same base name) first."""
    with tempfile.TemporaryDirectory(prefix="behemoth-artifacts-") as tmp:
        local = [Store(source).local_copy(tmp) for source in sources]
        yield local


def _scalars(account: goodput.Account) -> dict[str, float]:
    return {"goodput/fraction": account.goodput, **{f"goodput/{t}_s": v for t, v in account.terms.items()}}


def _tensorboard_final(run_dir: str, step: int, scalars: dict) -> None:
    from behemoth.tracking.tensorboard import TensorBoardLog

    TensorBoardLog(run_dir).log_final(step, scalars)


def _quietly(what: str, fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - tracking never turns a run's result into a failure
        print(f"[behemoth] WARNING: {what} could not be written: {type(e).__name__}: {e}", flush=True)
        return None
