"""What differs between workloads, behind one small interface the worker loop calls (see Task below).

The loop (behemoth.loop) owns everything that is the same for every workload: the global sample order,
DDP, optimizer and schedule, checkpoints, reports. A task owns the data it feeds, the model it builds, the
loss, and the validation metrics. Two tasks exist: image classification and causal language modelling.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from behemoth.config import TEXT_KINDS, JobConfig


class Task(Protocol):
    cfg: JobConfig
    num_train_samples: int
    num_val_samples: int
    tokens_per_sample: int | None  # for tokens/s; None where a sample is not a token sequence
    eval_size: int  # length of the eval_sums vector

    def build_model(self) -> torch.nn.Module: ...

    def train_batches(self, indices, epoch: int, batch_size: int) -> Iterable[dict]:
        """Batches of the samples at `indices`, in that order. Each batch holds a "sample_id" tensor: the
        indices it carries (the sample ledger records them)."""

    def eval_batches(self, indices, batch_size: int) -> Iterable[dict]: ...

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


def is_text(cfg: JobConfig) -> bool:
    return cfg.data.kind in TEXT_KINDS


def best_metric(cfg: JobConfig) -> tuple[str, str]:
    """The metric that picks the best checkpoint, and whether higher is better."""
    return ("val_loss", "min") if is_text(cfg) else ("val_accuracy", "max")


def make_task(cfg: JobConfig, data) -> Task:
    """Worker side: the task for this job over the data the driver prepared (an index or token blocks)."""
    if is_text(cfg):
        from behemoth.tasks.causal_lm import CausalLM

        return CausalLM(cfg, data)
    from behemoth.tasks.image import ImageClassification

    return ImageClassification(cfg, data)
