"""Driver side: what can be found wrong with a job before Ray starts, beyond its keys and values (config/) and its
data (the task's check): the model and tokenizer it names can be had on this machine, train.init_from exists,
and an epoch has at least one step. `behemoth check` and every run (trainer.prepare_data) go through here.
"""

from __future__ import annotations

from behemoth.config import JobConfig
from behemoth.errors import CheckpointError, ConfigError
from behemoth.models import registry
from behemoth.models.sources import check_source
from behemoth.storage import filesystem


def check_sources(cfg: JobConfig) -> None:
    """Before the task's own check (which loads the tokenizer): model.pretrained and data.tokenizer are local
    folders that exist or Hub names this machine can get (offline: one line, no retries); train.init_from is a
    folder that exists (a URI is read where it is, when the run resolves it)."""
    if cfg.model.pretrained and not registry.is_import_path(cfg.model.name):
        check_source(cfg.model.pretrained, "model.pretrained")
    tokenizer = getattr(cfg.data, "tokenizer", "")
    if tokenizer:
        check_source(tokenizer, "data.tokenizer", needs="")
    source = cfg.train.init_from
    if source and not filesystem.is_uri(source):
        from behemoth.storage import weights

        try:
            weights.resolve(source, cfg.train.init_from_checkpoint)
        except CheckpointError as e:
            raise ConfigError(f"train.init_from: {e}") from None


def check_epoch(cfg: JobConfig, samples: int | None) -> None:
    """An epoch of the training split has at least one step of train.global_batch_size samples (the last
    partial batch of every epoch is skipped: data/order.py)."""
    batch = cfg.train.global_batch_size
    if samples is not None and samples < batch:
        raise ConfigError(f"train.global_batch_size {batch} exceeds the {samples} training samples: an epoch would "
                          f"have no step. Lower it to at most {samples} (a divisor of the workers' split: "
                          f"scaling.num_workers x micro-batch), or add data")
