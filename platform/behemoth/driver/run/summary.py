"""Driver side: a finished run's summary (what the command line prints and the Python API returns)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from behemoth.config import JobConfig
from behemoth.driver.run.resume import run_place
from behemoth.metrics import logged_reports
from behemoth.tasks import run_metric, task_of


@dataclass
class RunSummary:
    run_dir: str
    metrics: dict  # the last reported metrics
    latest_checkpoint: str | None
    best_checkpoint: str | None  # best by the run's metric (tasks.run_metric): retention keeps it
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
        if "checkpoint_interval_steps" in m:  # (checkpoint.every_n_steps auto: the interval it came to)
            out.append(f"checkpoints:       every {m['checkpoint_interval_steps']} steps at the end "
                       f"(checkpoint.every_n_steps auto: the log says why)")
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


def summarise(cfg: JobConfig, result, wall_s: float) -> RunSummary:
    """The run's summary from what its host returned: a Ray Train Result, or a lane's of the same shape
    (metrics, checkpoint, best_checkpoints as (checkpoint, metrics), return_value)."""
    task = task_of(cfg)
    key, mode = run_metric(task, cfg)  # (retention keeps its best checkpoint: driver/run/resume.py retention)
    # finite scores only (a diverged evaluation, or one Ray's snapshot kept as null, is no score), a tie to the
    # newer checkpoint (its name sorts later: a time or a step), as retention and weights.resolve rank them
    scored = [(m[key], c.path) for c, m in (result.best_checkpoints or [])
              if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
    best = max(scored, key=lambda s: (s[0] if mode == "max" else -s[0], s[1])) if scored else None
    best_value, best_path = best if best else (None, None)
    place = run_place(cfg)  # Ray gives paths on the storage's filesystem
    final = logged_reports(dict(result.metrics or {}))[-1]  # (not the logged steps it carries)
    return RunSummary(
        run_dir=place.folder,
        metrics=final,
        latest_checkpoint=place.as_uri(result.checkpoint.path if result.checkpoint else None),
        best_checkpoint=place.as_uri(best_path),
        best_value=best_value,
        best_metric=key,
        wall_s=wall_s,
        resumed_from_step=(result.return_value or {}).get("resumed_from_step", 0),
        peak_source=(result.return_value or {}).get("peak_source"),
        task_lines=task.summary_lines(final),
    )
