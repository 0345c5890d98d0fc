"""data.kind -> the task that trains it. Adding a workload to behemoth: its file in tasks/ and its line in
TASKS. A task outside behemoth needs no line: `data.kind: my_package.my_module:MyTask`, or `register()` it.

Tasks are named by import path ("module:Class") and imported when a job of their kind is loaded, so loading
one kind never imports another's libraries.
"""

from __future__ import annotations

import importlib

from behemoth.config import DataConfig
from behemoth.errors import ConfigError, did_you_mean
from behemoth.tasks.contract import Task, check_task_class

TASKS: dict[str, str] = {
    "image_folder": "behemoth.tasks.image:ImageClassification",
    "image_parquet": "behemoth.tasks.image:ImageClassification",
    "image_webdataset": "behemoth.tasks.image:ImageClassification",
    "text": "behemoth.tasks.causal_lm:CausalLM",
    "chat": "behemoth.tasks.chat:ChatLM",
    "preference": "behemoth.tasks.preference:PreferenceLM",
    "text_classification": "behemoth.tasks.text_classification:TextClassification",
}


def register(kind: str, task: str) -> None:
    """Make `kind` a name for the task at import path `task` ("module:Class"), in this process (a worker
    process finds it only where the same call ran there too: prefer the import path as data.kind)."""
    if ":" in kind or not kind:
        raise ConfigError(f"task name {kind!r}: a registered kind is a plain name (an import path is a kind by "
                          f"itself)")
    if ":" not in task:
        raise ConfigError(f"register({kind!r}, {task!r}): the task is named by import path, module:Class")
    TASKS[kind] = task


def is_custom_kind(kind: str) -> bool:
    """A task given by import path (module:Class) rather than one of TASKS."""
    return kind not in TASKS and ":" in kind


def task_class(kind: str) -> type[Task]:
    """The task class of a data.kind (one of TASKS, or itself a "module:Class"), its module imported and the
    class checked against the contract."""
    if kind not in TASKS and not is_custom_kind(kind):
        raise ConfigError(f"data.kind '{kind}' is not a known task{did_you_mean(kind, list(TASKS))} (known: "
                          f"{', '.join(TASKS)}; or your own task class as module:Class)")
    module, _, name = TASKS.get(kind, kind).partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"data.kind '{kind}': cannot import task {module}:{name} ({e})") from None
    return check_task_class(cls, kind)


def data_section(kind: str) -> type[DataConfig]:
    """The `data:` section class of a data.kind."""
    return task_class(kind).data_config
