"""behemoth: fault-tolerant distributed training on Ray.

Driver side: `behemoth.trainer.train(cfg)`; worker side: `behemoth.loop.train_loop_per_worker`.
"""

from behemoth.config import ConfigError, JobConfig, load_config

__all__ = ["ConfigError", "JobConfig", "load_config"]
__version__ = "0.1.0"
