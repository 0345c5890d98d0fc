"""A finished sweep's results: one row per trial, best first (results.csv), and the best trial's job
(best.yaml, which `behemoth train` reproduces)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from behemoth.storage import paths
from behemoth.config import JobConfig, dump_yaml
from behemoth.driver.sweep.config import SweepConfig, base_job, trial_job
from behemoth.errors import CheckpointError, RunFailedError

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


def write_results(sweep_cfg: SweepConfig, grid, metric: str, mode: str, place: paths.RunPlace) -> SweepResult:
    """One row per trial (best first) -> results.csv; the best trial's job -> best.yaml. The best is the best
    finite value among the trials that did not fail (one that evaluated well and then diverged is listed, never
    chosen)."""
    import numpy as np
    import pandas as pd

    base, keys = base_job(sweep_cfg), list(sweep_cfg.space)
    rows = [_trial_row(sweep_cfg, r, base, keys, metric, mode, place) for r in grid]
    # each trial's values as Tune gave them (a column of None and 300 reads as floats in a DataFrame: nan, 300.0)
    params = [{k: r.config.get(k) for k in keys} for r in grid]
    table = pd.DataFrame([{**row, "_row": i} for i, row in enumerate(rows)])
    table = table.sort_values(metric, ascending=mode == "min", na_position="last", kind="stable").reset_index(drop=True)
    results_csv = place.join("results.csv")
    table.drop(columns="_row").to_csv(results_csv, index=False)
    values = pd.to_numeric(table[metric], errors="coerce")
    scored = table[np.isfinite(values) & ~table["status"].str.startswith("error")]
    if scored.empty:
        raise RunFailedError(f"no trial of sweep {sweep_cfg.name} that did not fail reported {metric} as a finite "
                             f"number: see the trials' statuses in {results_csv}")
    best = scored.iloc[0]
    best_params = params[int(best["_row"])]
    best_job = trial_job(base, best_params, sweep_cfg.lr_scaling)
    best_job.checkpoint.storage_path = base["checkpoint"]["storage_path"]
    best_job.checkpoint.run_name = f"{sweep_cfg.name}_best"
    best_yaml = place.join("best.yaml")
    Path(best_yaml).write_text(
        f"# The best trial of sweep {sweep_cfg.name}: {best['trial_id']}, {metric} {best[metric]:.6g} "
        f"({best['status']}).\n# {', '.join(f'{k}={v!r}' for k, v in best_params.items())}; train.lr after "
        f"lr_scaling {sweep_cfg.lr_scaling}: {best_job.train.lr:.6g}.\n# Reproduce it: behemoth train {best_yaml}\n"
        + dump_yaml(best_job))
    checkpoint = rows[int(best["_row"])]["best_checkpoint"]
    return SweepResult(table=table.drop(columns="_row"), best_params=best_params, best_job=best_job,
                       best_value=float(best[metric]), metric=metric, best_checkpoint=checkpoint or None,
                       best_yaml=best_yaml, results_csv=results_csv, sweep_dir=place.folder)


def _trial_row(sweep_cfg: SweepConfig, result, base: dict, keys: list[str], metric: str, mode: str,
               place: paths.RunPlace) -> dict:
    from behemoth.storage import weights

    params = {k: result.config.get(k) for k in keys}
    m = result.metrics or {}
    trial_id = m.get("trial_id") or _trial_id_from_starts(place, params)
    run_dir = place.child("runs", str(trial_id)).folder
    summary_file = Path(run_dir, "summary.json")
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    m = {**m, **summary.get("metrics", {})}
    if m.get("step") is not None and m["step"] >= m.get("total_steps", float("inf")):
        status = "finished"  # (ASHA may still "stop" a trial at its last report, as it ends)
    elif result.error is not None:
        status = f"error: {str(result.error).strip().splitlines()[0][:200]}"
    elif summary:  # it ended by itself before its last step: its own train.early_stopping
        status = "stopped by train.early_stopping"
    else:
        status = "stopped early"
    # its best checkpoint by the sweep's metric (the run's summary names its best by the run's own, and a
    # trial the scheduler stopped has no summary: the newest was named), among those its retention kept
    try:
        best_checkpoint, _ = weights.resolve(run_dir, "best", (metric, mode))
    except CheckpointError:  # (no checkpoint at all)
        best_checkpoint = None
    return {"trial_id": trial_id, "status": status, **params,
            "lr": trial_job(base, params, sweep_cfg.lr_scaling).train.lr,
            metric: m.get(metric, float("nan")), "epoch": m.get("epoch"), "step": m.get("step"),
            "best_checkpoint": best_checkpoint, "run_dir": run_dir}


def _trial_id_from_starts(place: paths.RunPlace, params: dict) -> str | None:
    """A trial that failed before its first report has no trial_id in its result: find it by its params."""
    path = Path(place.join("trial_starts.jsonl"))
    starts = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return next((s["trial_id"] for s in reversed(starts) if s["params"] == params), None)
