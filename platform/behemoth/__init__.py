"""behemoth: fault-tolerant distributed training on Ray.

The house (each a folder): `driver/` (cli, trainer, tune, cluster check: one process, no CUDA), `worker/` (the
loop Ray Train runs on every worker and what it uses), `tasks/` (one file per workload, both sides), `data/`
(Ray Data pipelines), `models/`; on the shared floor `config`, `errors`, `paths`, `checkpoint`, `metrics`.

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
