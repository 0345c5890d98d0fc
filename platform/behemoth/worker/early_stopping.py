"""train.early_stopping on the worker: at each evaluation, whether the run's metric improved and whether the run
stops here (`early_stop`), and what a resumed run's counts are under this config (`resume_early_stopping`). The
counts live in the train state, so a checkpoint carries them; every rank decides alike (the evaluation is
all-reduced)."""

from __future__ import annotations

import math

from behemoth.config import JobConfig
from behemoth.storage.checkpoint import TrainState
from behemoth.tasks import Task, run_metric


def early_stop(cfg: JobConfig, task: Task, state: TrainState, report: dict, total_steps: int) -> bool:
    """train.early_stopping at an evaluation: count the evaluations since its metric last improved by more than
    min_delta (in the task's direction), in the train state (so a resumed run counts on); at `patience` the run
    stops at this step (state.stopped_early_at). Every rank decides alike: the evaluation is all-reduced."""
    rule = cfg.train.early_stopping
    metric, mode = run_metric(task, cfg)
    value = report.get(metric)
    if value is None or state.step >= total_steps:
        return False
    best, state.early_stopping_metric = state.best_metric, metric
    if not math.isfinite(value):  # an evaluation that diverged (NaN, an overflow's inf): never the best, no better
        value = -math.inf if mode == "max" else math.inf
    improved = (best is None and math.isfinite(value)) or (
        best is not None and (value > best + rule.min_delta if mode == "max" else value < best - rule.min_delta))
    if improved:
        state.best_metric, state.evals_without_improvement = value, 0
        return False
    state.evals_without_improvement += 1
    if state.evals_without_improvement < rule.patience:
        return False
    state.stopped_early_at = state.step
    return True


def resume_early_stopping(cfg: JobConfig, task: Task, state: TrainState) -> str | None:
    """A resumed run's early-stopping counts against this config (every rank alike; returns the line to say, or
    None). Another metric than the checkpoint's counted starts the counts again: its best value is not one of
    this metric's, nor in its direction. A run that stopped early trains on where the rule that stopped it is
    off now, or its patience is above the evaluations it has counted (a new metric's counts included)."""
    rule, stopped = cfg.train.early_stopping, state.stopped_early_at
    said = []
    metric = run_metric(task, cfg)[0]
    counted = state.early_stopping_metric
    if rule is not None and counted is not None and counted != metric:
        said.append(f"train.early_stopping.metric {counted} -> {metric}: its counts start again (the best {counted} "
                    f"so far, {state.best_metric}, is no {metric})")
        state.best_metric, state.evals_without_improvement, state.early_stopping_metric = None, 0, metric
    if stopped is not None and (rule is None or state.evals_without_improvement < rule.patience):
        why = ("early stopping is off now" if rule is None else
               f"patience {rule.patience}, {state.evals_without_improvement} evaluation(s) without improvement")
        said.append(f"the run stopped early at step {stopped} (train.early_stopping); {why}: it trains on from "
                    f"step {state.step}")
        state.stopped_early_at = None
    return "; ".join(said) or None
