"""The job config: a room of three modules, re-exported here (what the rest of the package imports).

- `schema`: the typed sections and their checks (DataConfig, ModelConfig, ScalingConfig, ..., JobConfig).
- `train_section`: the `train:` section (TrainConfig) and the small sections it holds (early stopping, profile).
- `load`: YAML and `--set` overrides into those types, with errors that name the key; YAML back out.

Which data section a job reads (its task's) is behemoth/job.py's: config knows no task.
"""

from behemoth.config.load import apply_override, dump_yaml, from_dict, read_yaml_mapping, warn_remote_code
from behemoth.config.schema import (CheckpointConfig, DataConfig, EvalConfig, FailureConfig, JobConfig, LoraConfig,
                                    MlflowConfig, ModelConfig, ScalingConfig, TrackingConfig, WandbConfig)
from behemoth.config.train_section import EarlyStoppingConfig, ProfileConfig, TrainConfig
from behemoth.errors import ConfigError

__all__ = ["CheckpointConfig", "ConfigError", "DataConfig", "EarlyStoppingConfig", "EvalConfig", "FailureConfig",
           "JobConfig", "LoraConfig", "MlflowConfig", "ModelConfig", "ProfileConfig", "ScalingConfig",
           "TrackingConfig", "TrainConfig", "WandbConfig", "apply_override", "dump_yaml", "from_dict",
           "read_yaml_mapping", "warn_remote_code"]
