"""What every behemoth Ray Data pipeline shares: the settings it runs with, and the input files a config's
patterns name."""

from __future__ import annotations

import glob
import logging
from pathlib import Path

from behemoth.errors import DataError
from behemoth.ray_internals.data import pace_scheduling_loop, quiet_progress_notice


def expand_files(patterns: list[str], key: str) -> list[str]:
    """Files named by `patterns` (paths or globs), in order; a pattern that matches nothing names config `key`."""
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True)) if any(c in pattern for c in "*?[") else [pattern]
        missing = [f for f in matched if not Path(f).is_file()]
        if not matched or missing:
            raise DataError(f"{key}: {missing[0] if missing else pattern} matches no file")
        files += matched
    return files


def ordered_data_context(ray_data_log_level: int = logging.WARNING):
    """The Ray Data settings every behemoth pipeline runs with (in the process that runs the dataset):
    outputs in input order (exact resume and exact packing depend on it); no progress bars or start/finish
    lines (one pipeline per rank and epoch would drown behemoth's progress lines); Ray Data's own log at
    `ray_data_log_level`; the scheduling loop paced while the consumer has batches (ray_internals/data.py)."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(ray_data_log_level)
    quiet_progress_notice()
    pace_scheduling_loop()
    return ctx
