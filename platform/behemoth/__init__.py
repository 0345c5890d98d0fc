"""behemoth: fault-tolerant distributed training on Ray.

The house (each room a folder; docs/architecture.md names every module): `driver/` (commands/, the run
sequence and its launchers in run/, ray_cluster/, sweep/: the driver's process never touches CUDA),
`worker/` (the loop every worker runs and what it uses), `checkpoints/` (the worker's side of a checkpoint:
save, restore, the rescue), `hosts/` (the worker contract, and who hosts it: Ray Train, or a sweep's warm lane), `tasks/` (one file per
workload, both sides), `data/` (Ray Data pipelines), `models/`, `storage/` (where a run's bytes live, and
their format), `config/`, `tracking/`, `ray_internals/` (every private Ray API, for the next Ray); on the
floor `errors`, `job`, `metrics`, `progress`, `version`.

Python API (the face: docs and examples import only these): `behemoth.train(cfg or a job YAML's path) -> RunSummary`,
`behemoth.sweep(job, space, ...) -> SweepResult` (also `behemoth.tune.sweep`), `behemoth.load_config(path,
overrides) -> JobConfig`, `behemoth.cli(argv)` (the `behemoth` command in this process: jobs/*.py), `Task` (a
workload of one's own, `data.kind: module:Class`; its parts in tasks/parts.py, a batch a `Batch`),
`Classification` (a classifier's loss and evaluation, ready-made for a task) and the built-in tasks to subclass
(`ImageClassification`, `CausalLM`, `ChatLM`, `TextClassification`), `Callback` (what runs around each step: `train.callbacks`,
`Task.callbacks`). `import behemoth` imports neither Ray nor torch: `train`, `sweep`,
`cli` and the tasks are imported on first use (a task imports torch; `train` and `sweep` import Ray). Typed
(`py.typed`): a type checker sees every name through the imports below.
"""

from typing import TYPE_CHECKING

from behemoth.config import JobConfig
from behemoth.errors import CheckpointError, ConfigError, DataError, RunFailedError
from behemoth.job import load_config
from behemoth.version import __version__

if TYPE_CHECKING:  # (what the lazy names below are, for editors and type checkers)
    from behemoth.driver import sweep as tune
    from behemoth.driver.commands.cli import run_command as cli
    from behemoth.driver.run.summary import RunSummary
    from behemoth.driver.sweep import sweep
    from behemoth.driver.sweep.results import SweepResult
    from behemoth.driver.run.trainer import train
    from behemoth.tasks.causal_lm import CausalLM
    from behemoth.tasks.chat import ChatLM
    from behemoth.tasks.classification import Classification
    from behemoth.tasks.contract import Task
    from behemoth.tasks.parts import Batch
    from behemoth.tasks.image import ImageClassification
    from behemoth.tasks.text_classification import TextClassification
    from behemoth.worker.step_callbacks import Callback

__all__ = [
    "Callback",
    "Batch",
    "CausalLM",
    "ChatLM",
    "Classification",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "ImageClassification",
    "JobConfig",
    "RunFailedError",
    "RunSummary",
    "SweepResult",
    "Task",
    "TextClassification",
    "__version__",
    "cli",
    "load_config",
    "sweep",
    "train",
    "tune",
]

_LAZY = {  # name -> (module, attribute): imported on first use
    "train": ("behemoth.driver.run.trainer", "train"), "sweep": ("behemoth.driver.sweep", "sweep"),
    "tune": ("behemoth.driver.sweep", None), "cli": ("behemoth.driver.commands.cli", "run_command"),
    "RunSummary": ("behemoth.driver.run.summary", "RunSummary"),
    "SweepResult": ("behemoth.driver.sweep.results", "SweepResult"),
    "Callback": ("behemoth.worker.step_callbacks", "Callback"),
    "Task": ("behemoth.tasks.contract", "Task"), "Batch": ("behemoth.tasks.parts", "Batch"),
    "Classification": ("behemoth.tasks.classification", "Classification"), "ImageClassification": ("behemoth.tasks.image", "ImageClassification"),
    "CausalLM": ("behemoth.tasks.causal_lm", "CausalLM"), "ChatLM": ("behemoth.tasks.chat", "ChatLM"),
    "TextClassification": ("behemoth.tasks.text_classification", "TextClassification"),
}


def __getattr__(name: str):
    """The face's names that import Ray or torch, imported on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module 'behemoth' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    found = importlib.import_module(module)
    return found if attribute is None else getattr(found, attribute)
