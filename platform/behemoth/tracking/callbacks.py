"""The run's recorder inside Ray Train's controller (an actor on the driver's node): every report goes to
metrics.jsonl, TensorBoard and MLflow; the controller's start, worker group starts, failures and resizes go
to timeline.jsonl.

Ray Train's developer callback interfaces are used (a report callback and a controller callback in one
object, so the trackers can be closed when the controller finishes): ray_internals/train_v2.py.
"""

from __future__ import annotations

import time

from behemoth.storage import paths
from behemoth.metrics import logged_reports
from behemoth.ray_internals.train_v2 import ControllerCallback, ReportCallback
from behemoth.tracking.records import METRICS, TIMELINE, JsonlLog

# Under a URI, reports wait in memory at most this long before a part object is PUT (and at every checkpoint,
# and at the end): a killed controller loses at most these seconds of metrics.jsonl. Timeline events are rare
# and are PUT at once.
METRICS_FLUSH_S = 10.0


class RunRecorder(ControllerCallback, ReportCallback):
    def __init__(self, run_dir: str, invocation: str, tensorboard: bool = True,
                 mlflow: tuple[str, str] | None = None, wandb: dict | None = None):
        """`mlflow`: (tracking URI, run id) of the run's MLflow run, or None; `wandb`: what opens its W&B run
        (tracking/wandb_run.py), or None."""
        self.run_dir, self.invocation = run_dir, invocation
        self.use_tensorboard, self.mlflow_target, self.wandb_target = tensorboard, mlflow, wandb
        self._metrics = self._timeline = self._tb = self._mlflow = self._wandb = None
        self._warned: set[str] = set()

    # Ray Train's hooks -----------------------------------------------------------------------------------
    def after_report(self, training_report, metrics):
        # rank 0's report, after the logged steps it carries (the worker holds those between two reports it
        # sends: worker/report_sender.py), each recorded as its own report
        *logged, report = logged_reports(metrics[0])
        for earlier in logged:
            self._record(earlier, checkpoint=False)
        self._record(report, checkpoint=training_report.checkpoint is not None)

    def _record(self, report: dict, checkpoint: bool) -> None:
        self.metrics_log.append({"time": time.time(), "invocation": self.invocation, **report})
        if checkpoint:
            self.metrics_log.flush()  # the records up to a checkpoint are stored with it
        if report.get("step", 0) <= report.get("resumed_from_step", 0):
            return  # nothing trained (a rerun of a finished run re-evaluates it): its curves have these steps
        if self.use_tensorboard:
            self._guarded("TensorBoard", lambda: self.tensorboard.log(report, checkpoint))
        if self.mlflow_target or self.wandb_target:
            from behemoth.tracking.tensorboard import scalar_tags

            curves = scalar_tags(report)
            if self.mlflow_target:
                self._guarded("MLflow", lambda: self.mlflow.log(curves, report["step"],
                                                                report.get("wall_time", time.time())))
            if self.wandb_target:
                self._guarded("W&B", lambda: self.wandb.log(curves, report["step"]))

    def after_controller_start(self, train_run_context):
        # Ray's autoscaling coordinator knows this controller's resource request by this id: a rerun after
        # a killed driver withdraws it (driver/ray_cluster/stale_requests.py)
        self.event("controller_start", ray_train_run_id=train_run_context.run_id)

    def before_controller_execute_resize_decision(self, resize_decision):
        self.event("group_start", workers=resize_decision.num_workers)

    def before_controller_execute_failure_decision(self, failure_decision):
        self.event("failure", decision=failure_decision.value)

    def after_controller_finish(self, result):
        self.close(failed=getattr(result, "error", None) is not None)

    def before_controller_abort(self):
        self.close(failed=True)

    # ------------------------------------------------------------------------------------------------------
    @property
    def metrics_log(self) -> JsonlLog:
        if self._metrics is None:
            self._metrics = JsonlLog(paths.join(self.run_dir, METRICS), flush_s=METRICS_FLUSH_S)
        return self._metrics

    @property
    def tensorboard(self):
        if self._tb is None:
            from behemoth.tracking.tensorboard import TensorBoardLog

            self._tb = TensorBoardLog(self.run_dir)
        return self._tb

    @property
    def mlflow(self):
        if self._mlflow is None:
            from behemoth.tracking.mlflow_run import MlflowMetrics

            self._mlflow = MlflowMetrics(*self.mlflow_target)
        return self._mlflow

    @property
    def wandb(self):
        if self._wandb is None:
            from behemoth.tracking.wandb_run import WandbMetrics

            self._wandb = WandbMetrics(self.wandb_target)
        return self._wandb

    def event(self, name: str, **fields) -> None:
        if self._timeline is None:
            self._timeline = JsonlLog(paths.join(self.run_dir, TIMELINE))
        self._timeline.append({"time": time.time(), "event": name, "invocation": self.invocation, **fields})

    def close(self, failed: bool = False) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self._tb is not None:
            self._guarded("TensorBoard", self._tb.finish)
            self._tb = None  # a later report (none is expected) opens a new one
        if self._mlflow is not None:
            self._mlflow.close()
        if self._wandb is not None:
            self._guarded("W&B", lambda: self._wandb.close(failed))
            self._wandb = None

    def _guarded(self, what: str, fn) -> None:
        """A tracker's failure is reported once and never reaches the training."""
        if what in self._warned:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            self._warned.add(what)
            print(f"[behemoth] WARNING: {what} tracking failed and is off for the rest of this run (training goes "
                  f"on): {type(e).__name__}: {e}", flush=True)

