"""Start the data pipeline's worker processes while Ray Train starts its own (a local Ray instance only).

On a fresh local instance, the first training batch would wait for processes that only start once the training
workers open their first epoch: Ray Data's stats actor, then one decode process per rank's pipeline, each
importing Ray Data and the task's decode code. Those imports would sit on the path to the first step, after
Ray Train's own chain (controller, then the workers). Started from the driver just before `fit`, the
same processes come up while the controller starts and are idle, imports done, when the first decode tasks
arrive: Ray hands a task an idle process of the same job and runtime environment, and a task submitted by a
training worker carries the worker's runtime environment, which `start` is given
(driver/ray_cluster/session.training_worker_runtime_env; tests/integration/test_train_images.py checks both against
a real run). Idle processes are kept for a minute on a local instance (ray_session.LOCAL_RAY_SYSTEM_CONFIG).

This module imports nothing heavy: a warm-up process imports it to run `_import`.
"""

from __future__ import annotations

import importlib
import os


def _import(modules: tuple[str, ...]) -> int:
    for name in modules:
        importlib.import_module(name)
    return os.getpid()


def start(modules: tuple[str, ...], processes: int, runtime_env: dict) -> list:
    """Start `processes` idle worker processes with `runtime_env` that have imported `modules`, and Ray
    Data's stats actor; returns at once (the object refs of the warm-up tasks: their pids, for tests)."""
    import ray

    task = ray.remote(_import).options(num_cpus=0, runtime_env=runtime_env, name="behemoth.warm_up")
    refs = [task.remote(modules) for _ in range(processes)]
    # after the tasks: Ray starts as many processes at once as the node has CPUs, and a task that finds none
    # started for it runs after the first, in its process
    start_data_stats_actor()
    return refs


def start_data_stats_actor() -> None:
    """Create Ray Data's stats actor from this driver (a run's, before `fit`; a sweep's, before any trial).

    Ray Data keeps one named, detached `_StatsActor` per cluster, created by the first process that runs a
    dataset. In a sweep that is a trial: its processes run inside the trial's placement group, which captures
    the actors they create, so the stats actor would be placed in that group and killed when the trial ends. A
    dataset another trial is iterating then sends its metrics to a new stats actor that never registered it:
    `KeyError: 'dataset_...'` tracebacks on the console of runs that are fine. Created from a driver, it is in
    no placement group and lives as long as the cluster, and a run's first batch does not wait for it.
    Returns at once (the actor starts in the background); one that exists is kept.
    """
    from behemoth.ray_internals.data import start_stats_actor

    start_stats_actor()
