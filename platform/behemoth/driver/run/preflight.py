"""Driver side: what can be found wrong with a job before Ray starts, beyond its keys and values (config/) and its
data (the task's check): the model and tokenizer it names can be had on this machine (HF_ENDPOINT well formed),
train.init_from exists, the tracking packages it names are installed, an epoch has at least one step and
train.profile's window ends by the run's last step. `behemoth check` and every run (sequence.check_data) go
through here.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from behemoth.config import JobConfig
from behemoth.data.order import steps_per_epoch
from behemoth.errors import CheckpointError, ConfigError, DataError
from behemoth.models import registry
from behemoth.models.sources import check_source, hub_endpoint
from behemoth.storage import paths


def _check_source(value: str, key: str, needs: str = "config.json") -> None:
    """A local folder or Hub name (models/sources.py), or an object store's folder (a URI: copied once per node
    when read, storage/model_copy.py) holding what from_pretrained reads: its listing is checked (every name in
    it too), nothing copied here (the task's check reads the config and tokenizer from a copy without weights)."""
    from behemoth.models.sources import TOKENIZER_FILES
    from behemoth.storage.model_copy import stored_listing

    files = stored_listing(value, key)
    if files is None:  # no object store's folder: a local folder or a Hub name
        check_source(value, key, needs)
        return
    wanted = (needs,) if needs else TOKENIZER_FILES
    if not any(name in files for name in wanted):
        raise ConfigError(f"{key} {value}: the folder holds no {' or '.join(wanted)} "
                          f"({len(files)} files there): upload the model's folder as from_pretrained reads it "
                          f"(e.g. `aws s3 sync DIR {value}`)")


def uploaded_working_dir() -> str | None:
    """This driver's folder where it runs in a working dir `ray job submit --working-dir` uploaded (Ray unpacks
    each upload into its session's cache of packages, and deletes it with the session or to make room), else
    None. (A `local://` working dir is the node's own folder, which Ray never deletes.)"""
    import json

    try:
        runtime_env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    working_dir = runtime_env.get("working_dir") if isinstance(runtime_env, dict) else None
    if not isinstance(working_dir, str) or not working_dir or working_dir.startswith("local://"):
        return None
    here = os.getcwd()  # (an entrypoint may `cd` elsewhere first: only Ray's unpacked copies are at risk)
    return here if f"{os.sep}runtime_resources{os.sep}working_dir_files{os.sep}" in f"{here}{os.sep}" else None


def check_paths_outlive_the_job(cfg: JobConfig) -> None:
    """The run's checkpoints and its MLflow folder or database outlive the job (check_outlives_the_job); a
    relative data.cache_dir is only a cost (the tokenised or decoded data made again by every submission): said."""
    check_outlives_the_job("checkpoint.storage_path", cfg.checkpoint.storage_path)
    check_outlives_the_job("tracking.mlflow.uri", cfg.tracking.mlflow.uri)
    cache = getattr(cfg.data, "cache_dir", "")
    folder = uploaded_working_dir()
    if folder and cache and paths.relative_local(cache):
        print(f"[behemoth] warning: data.cache_dir {cache!r} is a relative path, in the working dir `ray job submit` "
              f"uploaded ({folder}), a copy Ray deletes: the data prepared there is prepared again by every "
              f"submission. Give an absolute path (e.g. --set data.cache_dir=$PWD/{cache})", file=sys.stderr,
              flush=True)


def check_outlives_the_job(key: str, value: str | None) -> None:
    """Under `ray job submit --working-dir`, the driver runs in Ray's unpacked copy of the upload: a relative
    path to write to (checkpoint.storage_path, an MLflow folder or sqlite database, a sweep's folder) would be
    written inside it, and lost with it (the next submission, of a changed folder, runs in another copy and finds
    no checkpoint to resume). Refused, naming the fix."""
    folder = uploaded_working_dir()
    relative = paths.relative_local(value) if folder and value else None
    if relative:
        scheme, path = relative
        raise ConfigError(f"{key} {value!r} is a relative path, and this job runs in the working dir `ray job "
                          f"submit` uploaded ({folder}), a copy Ray deletes: what is written there is lost to the "
                          f"next submission. Give an absolute path on the cluster's nodes or shared storage (e.g. "
                          f"--set {key}={scheme}$PWD/{path} from the folder you submit from), or a URI")


def check_sources(cfg: JobConfig) -> None:
    """Before the task's own check (which loads the tokenizer): model.pretrained and data.tokenizer are local
    folders that exist, object-store folders holding a model or a tokenizer, or Hub names this machine can get
    (offline: one line, no retries); train.init_from is a
    folder holding weights (a checkpoint, a run's or a Hugging Face folder; under a URI too: its listing read
    here); the tracking packages it names are installed."""
    check_tracking(cfg)
    check_paths_outlive_the_job(cfg)
    hub_endpoint()  # (transformers imports huggingface_hub's downloads, which trip on a malformed one)
    if cfg.model.pretrained and not registry.is_import_path(cfg.model.name):
        _check_source(cfg.model.pretrained, "model.pretrained")
    tokenizer = getattr(cfg.data, "tokenizer", "")
    if tokenizer:
        _check_source(tokenizer, "data.tokenizer", needs="")
    source = cfg.train.init_from
    if source:
        from behemoth.storage import weights

        try:
            weights.resolve(source, cfg.train.init_from_checkpoint)
        except CheckpointError as e:
            raise ConfigError(f"train.init_from: {e}") from None


# (key, the package it needs, its name in words, the extra that installs it)
_TRACKERS = (("tracking.wandb.project", "wandb", "wandb", "wandb"),
             ("tracking.mlflow.uri", "mlflow", "MLflow", "mlflow"))


def check_tracking(cfg: JobConfig) -> None:
    """W&B or MLflow configured where the package is missing: found here, before Ray starts and the data is
    prepared, not when the run opens its tracking. Found, not imported (importing either takes seconds)."""
    for key, module, name, extra in _TRACKERS:
        section, field = key.split(".")[1:]
        if getattr(getattr(cfg.tracking, section), field) and not _importable(module):
            raise ConfigError(f"{key} is set but {name} is not installed: pip install 'behemoth[{extra}]' (or unset "
                              f"{key})")


def _importable(module: str) -> bool:
    if module in sys.modules:  # imported already, or marked as not importable (None)
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_epoch(cfg: JobConfig, samples: int | None) -> None:
    """An epoch of the training split has at least one step of train.global_batch_size samples (the last
    partial batch of every epoch is skipped: data/order.py), and train.profile's window fits in the run's steps
    (where they are known: `samples` None is a text corpus not yet packed, whose steps only train.max_steps
    bounds)."""
    batch = cfg.train.global_batch_size
    if samples == 0:  # (advice to lower the batch "to at most 0" helps no one: the data is what is wrong)
        blocks = (f" (for {cfg.data.kind}: not one block of data.seq_len {cfg.data.seq_len} tokens)"
                  if hasattr(cfg.data, "seq_len") else "")
        raise DataError(f"the training data ({cfg.data.source()}) makes no training sample{blocks}: check that "
                        f"its files hold what data.kind {cfg.data.kind} reads, or point the data keys at others")
    if samples is not None and samples < batch:
        raise ConfigError(f"train.global_batch_size {batch} exceeds the {samples} training samples: an epoch would "
                          f"have no step. Lower it to at most {samples} (a divisor of the workers' split: "
                          f"scaling.num_workers x micro-batch), or add data")
    _check_profile_window(cfg, samples)
    _warn_of_a_warmup_past_the_end(cfg, samples)


def _run_steps(cfg: JobConfig, samples: int | None) -> tuple[int, str] | None:
    """(the run's steps, what decides them), where they are known."""
    train, runs = cfg.train, []
    if samples is not None:
        epoch_steps = steps_per_epoch(samples, train.global_batch_size)
        runs.append((epoch_steps * train.epochs, f"{train.epochs} epoch(s) of {epoch_steps} steps"))
    if train.max_steps:
        runs.append((train.max_steps, "train.max_steps"))
    return min(runs) if runs else None


def _warn_of_a_warmup_past_the_end(cfg: JobConfig, samples: int | None) -> None:
    """A warm-up as long as the run or longer: the learning rate never reaches train.lr and the decay never
    starts. Said, not refused (a short trial run of a long job's settings is a fair thing to start)."""
    run, train = _run_steps(cfg, samples), cfg.train
    if run is None or (train.warmup_epochs is not None and samples is None):
        return
    warm = train.warmup_steps_for(None if samples is None else steps_per_epoch(samples, train.global_batch_size))
    if warm and warm >= run[0]:
        key = "train.warmup_steps" if train.warmup_epochs is None else "train.warmup_epochs"
        print(f"[behemoth] warning: {key} makes a warm-up of {warm} steps, not shorter than the run's "
              f"{run[0]} ({run[1]}): the learning rate never reaches train.lr {train.lr} and never decays",
              file=sys.stderr, flush=True)


def _check_profile_window(cfg: JobConfig, samples: int | None) -> None:
    """A window ending after the run's last step is never closed: no trace is written, and nothing says so."""
    window = cfg.train.profile
    run = _run_steps(cfg, samples) if window is not None else None
    if run is None:
        return
    steps, by = run
    last = window.start_step + window.steps
    if last > steps:
        raise ConfigError(f"train.profile records steps {window.start_step + 1}..{last}, beyond the run's {steps} "
                          f"steps ({by}): no trace would be written. Lower train.profile.start_step to at most "
                          f"{max(steps - window.steps, 0)}" + (" and train.profile.steps to at most "
                                                             f"{steps}" if window.steps > steps else ""))
