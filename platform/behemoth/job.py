"""A job: a YAML file (plus `--set a.b=c` overrides) or a mapping read into a JobConfig whose `data:` is its
kind's section, checked by each section and by its task. The one place that joins the config floor with the
task registry: config knows no task, a task knows config.
"""

from __future__ import annotations

import os
from pathlib import Path

from behemoth.config import (
    DataConfig,
    JobConfig,
    apply_override,
    from_dict,
    read_yaml_mapping,
    warn_remote_code,
)
from behemoth.errors import ConfigError
from behemoth.tasks.contract import Task
from behemoth.tasks.registry import is_custom_kind, task_class


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a job YAML (or start from defaults), apply `a.b=c` overrides, check types and values; every error
    names the file."""
    if path is not None and not isinstance(path, (str, os.PathLike)):  # (pathlib's TypeError named nothing)
        raise ConfigError(f"load_config takes the path of a job YAML, got {type(path).__name__}: for a mapping of "
                          f"sections use behemoth.job.config_from_dict")
    if isinstance(overrides, (str, bytes)) or not all(isinstance(o, str) for o in overrides or []):
        # (a string was read character by character: "--set 't': expected KEY=VALUE")
        raise ConfigError(f"overrides: a list of 'KEY=VALUE' strings (e.g. ['train.lr=0.05']), got "
                          f"{type(overrides).__name__} {overrides!r}"[:300])
    where = str(path) if path else "<defaults>"
    raw = read_yaml_mapping(path) if path is not None else {}
    for item in overrides or []:
        apply_override(raw, item)
    try:
        cfg = config_from_dict(raw, where)
    except ConfigError as e:
        raise ConfigError(e if str(e).startswith(f"{where}: ") else f"{where}: {e}") from None
    warn_remote_code(cfg.model)
    return cfg


def config_from_dict(raw: dict, where: str = "<dict>") -> JobConfig:
    """A job from its mapping of sections (a job.yaml as read, or what a worker is handed). A key or type
    error names `where`; a value check's error is the check's own message."""
    task, cfg = _read(raw, where)
    task.complete(cfg)
    custom = is_custom_kind(cfg.data.kind)  # a task of one's own builds its own model: model.name is its own
    cfg.validate(model=not custom)
    if not custom:
        task.check_model(cfg)
    stopping = cfg.train.early_stopping
    if stopping is not None and stopping.metric is not None and stopping.metric not in task.reported:
        raise ConfigError(f"train.early_stopping.metric {stopping.metric} is not a metric this task reports: one of "
                          f"{', '.join(task.reported)} (or leave it out: the task's best, {task.best[0]})")
    return cfg


def _read(raw: dict, where: str) -> tuple[type[Task], JobConfig]:
    """The job's task and its config, `data:` read into the task's section (not yet checked)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the file must be a mapping of sections, got {type(raw).__name__}")
    if "job" in raw or "space" in raw:  # (else: "unknown key 'job'; valid keys: data, model, ...")
        raise ConfigError(f"{where}: a sweep file (it has {' and '.join(k for k in ('job', 'space') if k in raw)}"
                          f"): run it with `behemoth tune`, or behemoth.tune.sweep from Python")
    data = raw.get("data") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: data must be a mapping, got {type(data).__name__}")
    kind = data.get("kind", DataConfig.kind)
    if not isinstance(kind, str):
        raise ConfigError(f"{where}: data.kind expects str, got {type(kind).__name__} {kind!r}")
    try:
        task = task_class(kind)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    cfg = from_dict(JobConfig, {k: v for k, v in raw.items() if k != "data"}, where)
    cfg.data = from_dict(task.data_config, data, where, prefix="data.", scope=f" for data.kind {kind}")
    return task, cfg


def left_to_the_model(path: str | Path, overrides: list[str], cfg: JobConfig) -> dict:
    """The data keys whose default is the job's model's (its tokenizer, its image statistics: Task.complete) that
    the job file and `overrides` leave out, at their blank defaults (load_config filled them from the job's own
    model): a sweep over model.* leaves them to each trial's model."""
    import dataclasses

    raw = read_yaml_mapping(Path(path))
    for item in overrides:
        apply_override(raw, item)
    given, blank = raw.get("data") or {}, dataclasses.asdict(type(cfg.data)())
    return {key: blank[key] for key in task_class(cfg.data.kind).completed_keys if key in blank and key not in given}
