"""Worker side: what a worker prints. behemoth's own lines, and Ray Train's per-report log kept out."""

from __future__ import annotations

import logging
import sys


def quiet_ray_train_reports() -> None:
    """Keep the console to behemoth's progress lines: Ray 2.60 logs every report at INFO from a logger named
    by its file path (not under `ray.train`), so RunConfig's LoggingConfig cannot filter it."""
    from ray.train.v2._internal.execution import context as train_context

    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)


def console(message: str) -> None:
    """A line for the user's console. Not print(): Ray Train's print patch would show it twice."""
    sys.stdout.write(f"[behemoth] {message}\n")
    sys.stdout.flush()
