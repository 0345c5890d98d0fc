"""Tasks: what differs between workloads, each in one file that owns both sides, behind one registry keyed by
`data.kind`.

Driver side (class attributes and classmethods, used before and after a run):
  `data_config`     (optional) its `data:` section: a dataclass subclassing config.DataConfig with the task's own
                    keys, their checks (`validate`) and the models it can train (`check_model`); a job's `data:`
                    mapping is read into its kind's section when the config is loaded
  `best`            the metric that picks the best checkpoint, and "max" or "min"
  `reported`        metrics a sweep may optimise (with their modes)
  `check(cfg)`      read and check the data without Ray; what `prepare` needs next (e.g. an index)
  `prepare(cfg, checked)`  with Ray up: what the workers read (it travels once through the object store)
  `describe(checked)`      one line for `behemoth check`
  `summary_lines(metrics)` the task's lines in the run summary; `progress_fields(metrics)`: its progress-line fields
  `data_cpus(cfg)`  CPUs its data pipeline needs beside the workers (a sweep bounds concurrency with it)
  `data_modules(cfg, prepared)`  (optional) modules its data pipeline's Ray tasks will import for this data
                    (none: no Ray task will run): on a local Ray instance a process per worker is started with
                    them while Ray Train starts (driver/warmup.py)
  `model_from_checkpoint(cfg, ckpt)`, `save_for_transformers(cfg, out)`  (optional) for `behemoth export`:
                    the model a checkpoint holds, and the files beside it (image processor, tokenizer)
Worker side (an instance per worker, made from the prepared data): see the Task protocol below.

The loop (behemoth.worker.loop) owns everything that is the same for every workload: the global sample order,
DDP/FSDP, optimizer and schedule, checkpoints, reports. Adding a workload is one file plus one line in
config.TASKS; a task outside behemoth needs no line at all: `data.kind: my_package.my_module:MyTask`.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from behemoth.config import JobConfig, import_task


class Task(Protocol):
    cfg: JobConfig
    num_train_samples: int
    num_val_samples: int
    tokens_per_sample: int | None  # for tokens/s; None where a sample is not a token sequence
    eval_size: int  # length of the eval_sums vector

    def build_model(self) -> torch.nn.Module: ...

    def train_batches(self, indices, epoch: int, batch_size: int) -> Iterable[dict]:
        """Batches of the samples at `indices`, in that order. Each batch holds a "sample_id" tensor: the
        indices it carries (the sample ledger records them). The next epoch's call comes from a background
        thread a few steps before the current epoch's batches run out (behemoth.worker.feed), so two of its
        iterators may be alive at once."""

    def eval_batches(self, indices, batch_size: int, split: str = "val") -> Iterable[dict]:
        """Evaluation batches (no augmentation) of the samples at `indices` of a split: "val", or "train"
        (only `behemoth eval --split train` asks for it). A task whose evaluation batches are the same at
        every call may say so with a class attribute `eval_batches_repeat = True`: the worker then keeps
        them after the first evaluation (up to behemoth.worker.evaluate.KEEP_BYTES per worker)."""

    def example_batch(self, batch_size: int) -> dict:
        """A batch of the right shapes on the training device (FLOP counting, micro-batch search)."""

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss over the batch's valid samples, number of valid samples)."""

    def eval_sums(self, model, batch: dict) -> torch.Tensor:
        """Per-batch sums (float64) that evaluate() adds up over batches and ranks."""

    def eval_metrics(self, sums: torch.Tensor) -> dict: ...

    def bad_sample_ids(self, batch: dict) -> list[int]: ...

    def describe_samples(self, sample_ids) -> list[str]: ...

    def classes(self) -> list[str] | None: ...

    # Optional. Fine-tuning (train.init_from) with weights of another shape: (key, model's tensor, source's
    # tensor) -> may the model keep its fresh tensor (image classification: the head, for other classes).
    reinit_ok = None


def task_of(cfg: JobConfig) -> type:
    """Driver side: the task class of a job."""
    return import_task(cfg.data.kind)


def best_metric(cfg: JobConfig) -> tuple[str, str]:
    """The metric that picks the best checkpoint, and whether higher is better."""
    return task_of(cfg).best


def make_task(cfg: JobConfig, data) -> Task:
    """Worker side: the task for this job over the data the driver prepared."""
    return import_task(cfg.data.kind)(cfg, data)
