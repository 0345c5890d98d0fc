"""Image classification: Ray Data decodes and augments the rank's samples; cross-entropy; top-1 accuracy."""

from __future__ import annotations

import ray.train.torch
import torch
import torch.nn.functional as F

from behemoth.config import JobConfig
from behemoth.data.images import ImageIndex, build_index, describe_samples, rank_dataset
from behemoth.models.registry import build_model


class ImageClassification:
    # --- driver side ------------------------------------------------------------------------------------
    best = ("val_accuracy", "max")
    reported = {"val_accuracy": "max", "val_loss": "min", "loss": "min"}

    @classmethod
    def check(cls, cfg: JobConfig) -> ImageIndex:
        """The index of samples (files or parquet rows, labels), built and checked on the driver."""
        return build_index(cfg.data)

    @classmethod
    def prepare(cls, cfg: JobConfig, index: ImageIndex) -> ImageIndex:
        return index  # the workers decode their own samples, in Ray Data tasks

    @classmethod
    def describe(cls, cfg: JobConfig, index: ImageIndex) -> str:
        return f"{index.train.num_rows} train / {index.val.num_rows} val samples, {len(index.classes)} classes"

    @classmethod
    def data_cpus(cls, cfg: JobConfig) -> float:
        return cfg.data.cpus_per_task  # decode tasks run beside the workers

    @staticmethod
    def summary_lines(m: dict) -> list[str]:
        out = []
        if "val_accuracy" in m:
            out.append(f"final val_acc:     {m['val_accuracy']:.4f} (val_loss {m['val_loss']:.4f}, "
                       f"{m['val_samples']} samples)")
        if m.get("bad_samples") or m.get("val_bad_samples"):
            out.append(f"dropped images:    {m.get('bad_samples', 0)} undecodable in train, "
                       f"{m.get('val_bad_samples', 0)} in val (data.max_bad_samples)")
        return out

    @staticmethod
    def progress_fields(m: dict) -> list[str]:
        return [f"val_loss {m['val_loss']:.4f}", f"val_acc {m['val_accuracy']:.4f}"] if "val_accuracy" in m else []

    # --- worker side ------------------------------------------------------------------------------------
    tokens_per_sample = None
    eval_size = 4  # see eval_sums

    def __init__(self, cfg: JobConfig, index: ImageIndex):
        self.cfg, self.index = cfg, index
        self.num_train_samples, self.num_val_samples = index.train.num_rows, index.val.num_rows

    def build_model(self):
        return build_model(self.cfg.model.name, len(self.index.classes))

    def train_batches(self, indices, epoch: int, batch_size: int):
        return self._batches(self.index.train, indices, epoch, batch_size, train=True)

    def eval_batches(self, indices, batch_size: int):
        return self._batches(self.index.val, indices, 0, batch_size, train=False)

    def example_batch(self, batch_size: int):
        device = ray.train.torch.get_device()
        size = self.cfg.data.image_size
        return {"image": torch.randn(batch_size, 3, size, size, device=device),
                "label": torch.zeros(batch_size, dtype=torch.long, device=device),
                "valid": torch.ones(batch_size, dtype=torch.bool, device=device)}

    def _batches(self, table, indices, epoch, batch_size, train):
        ds = rank_dataset(table, indices, self.cfg.data, seed=self.cfg.train.seed, epoch=epoch, train=train,
                          batch_size=batch_size)
        # On GPU, batches are pinned and copied to the device in Ray Data's prefetch threads, overlapping
        # the copy with the step before.
        return ds.iter_torch_batches(batch_size=batch_size, prefetch_batches=self.cfg.data.prefetch_batches,
                                     device=ray.train.torch.get_device(),
                                     pin_memory=self.cfg.scaling.use_gpu)

    def loss(self, model, batch):
        """Mean cross-entropy over the decodable samples (undecodable ones, valid=False, carry no loss)."""
        valid = batch["valid"].float()
        logits = model(pixel_values=batch["image"]).logits
        per_sample = F.cross_entropy(logits, batch["label"], reduction="none")
        n_valid = valid.sum()
        return (per_sample * valid).sum() / n_valid.clamp(min=1), n_valid

    def eval_sums(self, model, batch):
        # loss sum, correct, valid samples, undecodable samples (dropped within data.max_bad_samples)
        valid = batch["valid"]
        logits = model(pixel_values=batch["image"]).logits
        losses = F.cross_entropy(logits, batch["label"], reduction="none")
        correct = (logits.argmax(dim=1) == batch["label"]) & valid
        sums = [losses[valid].sum(), correct.sum(), valid.sum(), (~valid).sum()]
        return torch.stack(sums).to(torch.float64)

    def eval_metrics(self, sums):
        n = max(sums[2].item(), 1.0)
        return {"val_loss": sums[0].item() / n, "val_accuracy": sums[1].item() / n, "val_samples": int(n),
                "val_bad_samples": int(sums[3].item())}

    def bad_sample_ids(self, batch):
        return batch["sample_id"][~batch["valid"]].tolist()

    def describe_samples(self, sample_ids):
        return describe_samples(self.index.train, sample_ids)

    def classes(self):
        return self.index.classes
