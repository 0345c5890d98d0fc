"""behemoth: fault-tolerant distributed training on Ray.

The house (each room a folder; docs/architecture.md names every module): `driver/` (cli, trainer, sweep/, cluster
check: the driver's process never touches CUDA), `worker/` (the loop every worker runs and what it uses),
`hosts/` (the worker contract, and who hosts it: Ray Train, or a sweep's warm lane), `tasks/` (one file per
workload, both sides), `data/` (Ray Data pipelines), `models/`, `storage/` (where a run's bytes live, and
their format), `config/`, `tracking/`, `ray_internals/` (every private Ray API, for the next Ray); on the
floor `errors`, `job`, `metrics`, `progress`, `version`.

Python API: `behemoth.train(cfg)`, `behemoth.sweep(job, space, ...)` (also `behemoth.tune.sweep`),
`behemoth.load_config(path, overrides)`. `import behemoth` imports neither Ray nor torch; loading a job
imports its task's module (with torch), and `train` or `sweep` imports Ray.
"""

from behemoth.config import JobConfig
from behemoth.errors import CheckpointError, ConfigError, DataError, RunFailedError
from behemoth.job import load_config
from behemoth.version import __version__

__all__ = ["CheckpointError", "ConfigError", "DataError", "JobConfig", "RunFailedError", "load_config", "sweep",
           "train", "__version__"]


def __getattr__(name: str):
    """`train`, `sweep` and the `tune` module, imported on first use (they import Ray)."""
    if name == "train":
        from behemoth.driver.trainer import train

        return train
    if name == "sweep":
        from behemoth.driver.sweep import sweep

        return sweep
    if name == "tune":
        from behemoth.driver import sweep as tune

        return tune
    raise AttributeError(f"module 'behemoth' has no attribute {name!r}")
