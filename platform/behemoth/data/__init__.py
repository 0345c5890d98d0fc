"""Ray Data pipelines. images.py: image classification; text.py: tokenised, packed text for causal LMs;
tokenizer.py: a local BPE tokenizer; order.py: the global sample order; synth.py: demo data."""

import logging


from behemoth.errors import DataError


def expand_files(patterns: list[str], key: str) -> list[str]:
    """Files named by `patterns` (paths or globs), in order; a pattern that matches nothing names config `key`."""
    import glob
    from pathlib import Path

    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        missing = [f for f in matched if not Path(f).is_file()]
        if not matched or missing:
            raise DataError(f"{key}: {missing[0] if missing else pattern} matches no file")
        files += matched
    return files


def ordered_data_context(ray_data_log_level: int = logging.WARNING):
    """The Ray Data settings every behemoth pipeline runs with (in the process that runs the dataset):
    outputs in input order (exact resume and exact packing depend on it); no progress bars or start/finish
    lines (one pipeline per rank and epoch would drown behemoth's progress lines); Ray Data's own log at
    `ray_data_log_level`."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(ray_data_log_level)
    # With the bars off, Ray Data says once per process how to turn them back on: not news in a behemoth run.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    return ctx
