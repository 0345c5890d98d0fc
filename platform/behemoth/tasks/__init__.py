"""Tasks: what differs between workloads, each in one file that owns both sides, behind one registry keyed by
`data.kind`.

- `parts.py`: the five parts a task is built from, each a small typed interface documented once with its
  defaults: `TaskData` (the driver's half: check, prepare, describe), `TaskBatches`, `TaskModel` (export
  included), `TaskStep` (the loss, the task's training metrics, its callbacks), `TaskEvaluation`; a `Batch`;
- `contract.py`: `Task`, the five parts in one class, generic over its checked and prepared data, and the check
  that a class is a complete task;
- `classification.py`: a part ready-made, a classifier's step and evaluation over the task's logits;
- `registry.py`: data.kind -> task (`TASKS`, `register()`, `task_class()`);
- one file per workload: `image.py` (image classification), `causal_lm.py` (causal language modelling),
  `chat.py` (chat fine-tuning, on causal_lm's), `preference.py` (DPO preference tuning, on chat's: its objective in `dpo.py`, the reference
  computed before training in `preference_reference.py`),
  `text_classification.py` (sequence classification, with classification.py's step and evaluation);
- `kept_tokenizer.py`: a language model's tokenizer (and chat template) kept in every checkpoint, and the job
  export and generate build from with it in place of the paths the checkpoint's job.yaml names.

The loop (behemoth.worker.loop) owns everything that is the same for every workload: the global sample order,
DDP/FSDP, optimizer and schedule, checkpoints, reports. Adding a workload is one file here plus one line in
registry.TASKS; a task outside behemoth needs no line at all: `data.kind: my_package.my_module:MyTask`.
"""

from __future__ import annotations

from behemoth.config import JobConfig
from behemoth.errors import ConfigError
from behemoth.tasks.contract import PreparedT, Task, run_metric
from behemoth.tasks.registry import register, task_class

__all__ = ["Task", "make_task", "register", "run_metric", "task_of"]


def task_of(cfg: JobConfig) -> type[Task]:
    """Driver side: the task class of a job, whose `data:` must be read into that task's section (a JobConfig
    built by hand holds a plain DataConfig: one error here, not an AttributeError inside the task)."""
    task = task_class(cfg.data.kind)
    if type(cfg.data) is not task.data_config:
        raise ConfigError(f"data.kind {cfg.data.kind} reads its data: section into {task.data_config.__name__}, "
                          f"and this job holds a {type(cfg.data).__name__}: build the job with "
                          f"behemoth.load_config (or behemoth.job.config_from_dict)")
    return task


def make_task(cfg: JobConfig, prepared: PreparedT) -> Task:
    """Worker side: the task for this job over the data the driver prepared."""
    return task_class(cfg.data.kind)(cfg, prepared)
