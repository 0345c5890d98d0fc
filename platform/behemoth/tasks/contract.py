"""The task contract: `Task`, a workload, is the five parts of tasks/parts.py (its data on the driver, its
batches, model, step and evaluation on the workers), each documented there once with the optional members'
defaults; here also the checks that a class is a complete task, and the metric a run is judged by. A task
subclasses `Task` and is found by `data.kind` (tasks/registry.py).

The driver half is class attributes and classmethods: it runs before Ray starts (checks), with Ray up
(preparing data), and after a run (summary, export). The worker half is an instance per training worker, built
from what the driver prepared: `Task(cfg, prepared)`. Nothing outside a task names a workload: class names,
bad-sample wording, model checks, the model card's load snippet all come from its parts.
"""

from __future__ import annotations

import inspect
from typing import Any

from behemoth.config import DataConfig, JobConfig
from behemoth.errors import ConfigError
from behemoth.tasks.parts import (Batch, CheckedT, PreparedT, TaskBatches, TaskData, TaskEvaluation, TaskModel,
                                  TaskStep)

__all__ = ["Batch", "CheckedT", "PreparedT", "Task", "check_task_class", "local_model", "run_metric"]


def run_metric(task, cfg: JobConfig) -> tuple[str, str]:
    """The metric a run is judged by, and "max" or "min": train.early_stopping's where it names one, else the
    task's `best`. Early stopping counts it, retention keeps its best checkpoint, the summary names that one.
    `task`: a Task class or instance."""
    rule = cfg.train.early_stopping
    metric = (rule.metric if rule is not None else None) or task.best[0]
    return metric, task.best[1] if metric == task.best[0] else task.reported[metric]


class Task(TaskData[CheckedT, PreparedT], TaskBatches[PreparedT], TaskModel, TaskStep, TaskEvaluation):
    """A workload: the five parts of tasks/parts.py in one class, generic over what its `check` returns (CheckedT)
    and what its `prepare` returns and its workers are built from (PreparedT): `class MyTask(Task[MyIndex,
    MyIndex])`. A task written against the untyped contract (`class MyTask(Task)`) is the same task: the
    parameters are for type checkers only. A part taken ready-made comes first among the bases
    (`class MyTask(Classification, Task)`: tasks/classification.py).

    The driver holds the class (`TaskData`'s classmethods, the model's checks, export, the metrics' names); the
    instance, `Task(cfg, prepared)`, one per training worker, is the worker's half."""


def check_task_class(cls: Any, kind: str) -> type[Task]:
    """`cls` as a complete task, or one ConfigError that names what it lacks."""
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"data.kind '{kind}': {cls!r} is not a task: subclass behemoth.tasks.Task")
    missing = sorted(cls.__abstractmethods__) + [
        name for name in ("best", "reported", "eval_sum_names") if not hasattr(cls, name)]
    if missing:
        raise ConfigError(f"data.kind '{kind}': task {cls.__name__} does not define {', '.join(missing)} "
                          f"(behemoth.tasks.Task documents each)")
    if hasattr(cls, "bad_sample_ids"):
        raise ConfigError(f"data.kind '{kind}': task {cls.__name__} defines bad_sample_ids, which is now "
                          f"bad_samples(batch): a device tensor of the sample ids, -1 for readable samples "
                          f"(a list would make every step wait for the device)")
    if not isinstance(inspect.getattr_static(cls, "checkpoint_files"), classmethod):
        raise ConfigError(f"data.kind '{kind}': task {cls.__name__}'s checkpoint_files must be a classmethod "
                          f"(cls, cfg, prepared) -> {{file name: text}} (it was a method of the worker half before)")
    if not (isinstance(cls.data_config, type) and issubclass(cls.data_config, DataConfig)):
        raise ConfigError(f"data.kind '{kind}': the task's data_config must be a dataclass subclassing "
                          f"behemoth.config.DataConfig, got {cls.data_config!r}")
    return cls


def local_model(cfg: JobConfig, weights: bool = True):
    """cfg.model with model.pretrained as this node reads it: an object store's folder copied here once
    (storage/model_copy.py), anything else as it is. The job keeps the URI: each node makes its own copy.
    `weights` False: the copy leaves the weights out (a check reads the model's config, not its weights)."""
    import dataclasses

    from behemoth.storage.model_copy import local_source

    model = cfg.model
    source = local_source(model.pretrained, "model.pretrained", weights) if model.pretrained else model.pretrained
    return model if source == model.pretrained else dataclasses.replace(model, pretrained=source)
