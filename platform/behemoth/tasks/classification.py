"""A ready-made step and evaluation for a classifier: cross-entropy over the task's logits against its labels,
validation loss and accuracy, the summary's line and the progress fields. A task takes it by naming it first
among its bases, `class MyTask(Classification, Task[...])`, and gives `logits(model, batch)` (and `labels(batch)`
where its labels are not `batch["label"]`). Text classification and examples/tabular_task.py take it; image
classification keeps its own (label smoothing, mixed samples, top-5, unreadable images).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

from behemoth.tasks.parts import Batch, TaskEvaluation, TaskStep

if TYPE_CHECKING:
    import torch


class Classification(TaskStep, TaskEvaluation):
    """Loss and evaluation of a classifier over `logits(model, batch)` ([N, classes]) and `labels(batch)` ([N],
    class indices). Metrics: val_loss (mean cross-entropy), val_accuracy (top-1), val_samples; the best
    checkpoint by val_accuracy."""

    best = ("val_accuracy", "max")
    reported = {"val_accuracy": "max", "val_loss": "min", "loss": "min"}
    eval_sum_names = ("loss", "correct", "samples")

    # What a sample is, in the plural, for the summary's line ("500 texts").
    samples_are: ClassVar[str] = "samples"

    @abc.abstractmethod
    def logits(self, model, batch: Batch) -> torch.Tensor:
        """The model's logits for the batch, [N, classes] (on the model's device)."""

    def labels(self, batch: Batch) -> torch.Tensor:
        """The batch's class indices, [N]. Default: batch["label"]."""
        return batch["label"]

    def _scored(self, model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(model, batch).float()  # (the loss in fp32 under autocast)
        return logits, self.labels(batch).to(logits.device, non_blocking=True)  # (a no-op where it is there)

    def loss(self, model, batch: Batch):
        import torch
        import torch.nn.functional as F

        logits, labels = self._scored(model, batch)
        return F.cross_entropy(logits, labels), torch.full((), float(len(labels)), device=labels.device)

    def eval_sums(self, model, batch: Batch):
        import torch.nn.functional as F

        logits, labels = self._scored(model, batch)
        return {"loss": F.cross_entropy(logits, labels, reduction="sum"),
                "correct": (logits.argmax(dim=1) == labels).sum(), "samples": len(labels)}

    def eval_metrics(self, sums: dict[str, float]) -> dict:
        n = max(sums["samples"], 1.0)
        return {"val_loss": sums["loss"] / n, "val_accuracy": sums["correct"] / n, "val_samples": int(n)}

    @classmethod
    def summary_lines(cls, m: dict) -> list[str]:
        if "val_accuracy" not in m:
            return []
        return [f"final val_acc:     {m['val_accuracy']:.4f} (val_loss {m['val_loss']:.4f}, "
                f"{m['val_samples']} {cls.samples_are})"]

    @staticmethod
    def progress_fields(m: dict) -> list[str]:
        return [f"val_loss {m['val_loss']:.4f}", f"val_acc {m['val_accuracy']:.4f}"] if "val_accuracy" in m else []
