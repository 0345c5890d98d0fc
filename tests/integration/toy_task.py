"""A workload behemoth does not know: linear regression on generated data, as a user would write their own.

Everything a task needs is in this file, its own `data:` keys (ToyData) included: the members behemoth.tasks.Task
requires, and of its optional ones only what this task wants differently. The job names it by
import path (`data.kind: integration.toy_task:LinearRegression`). Ray Train workers import it by name (the tests' Ray instance puts
tests/ on their PYTHONPATH).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import ray.train.torch
import torch

from behemoth.config import DataConfig
from behemoth.errors import ConfigError
from behemoth.tasks import Task

TRAIN, VAL = 512, 128
# What check returns and the workers read: the generated rows, {"x": features, "y": targets}.
Rows = dict[str, np.ndarray]


@dataclass
class ToyData(DataConfig):
    """This task's `data:` keys beside the common ones (data.kind, data.prefetch_batches, ...)."""

    features: int = 8
    noise: float = 0.01
    nan_rows: int = 0  # training rows (the first ones) whose target is NaN: a step that trains on one goes NaN

    def validate(self) -> None:
        super().validate()
        if self.features < 1:
            raise ConfigError(f"data.features must be >= 1, got {self.features}")


class LinearRegression(Task[Rows, Rows]):
    # --- driver side ------------------------------------------------------------------------------------
    data_config = ToyData
    best = ("val_mse", "min")
    reported = {"val_mse": "min", "loss": "min"}

    @classmethod
    def check(cls, cfg) -> Rows:
        rng = np.random.default_rng(cfg.train.seed)
        w = rng.normal(size=cfg.data.features)
        x = rng.normal(size=(TRAIN + VAL, cfg.data.features)).astype(np.float32)
        y = (x @ w + cfg.data.noise * rng.normal(size=TRAIN + VAL)).astype(np.float32)
        y[:cfg.data.nan_rows] = np.nan
        return {"x": x, "y": y}

    @classmethod
    def prepare(cls, cfg, data: Rows) -> Rows:
        return data

    @classmethod
    def describe(cls, cfg, data: Rows) -> str:
        return f"{TRAIN} train / {VAL} val rows of {cfg.data.features} features"

    @staticmethod
    def summary_lines(m):
        return [f"final val_mse:     {m['val_mse']:.5f}"] if "val_mse" in m else []

    @staticmethod
    def progress_fields(m):
        return [f"val_mse {m['val_mse']:.5f}"] if "val_mse" in m else []

    # --- worker side ------------------------------------------------------------------------------------
    eval_sum_names = ("squared_error", "rows")

    def __init__(self, cfg, data: Rows):
        super().__init__(cfg, data)
        self.data = data
        self.num_train_samples, self.num_val_samples = TRAIN, VAL

    def build_model(self):
        features = self.cfg.data.features
        print(f"toy task: a linear model of {features} features", flush=True)  # a user's print, on each worker
        return torch.nn.Linear(features, 1)

    def _batches(self, offset, indices, batch_size):
        device = ray.train.torch.get_device()
        for start in range(0, len(indices), batch_size):
            ids = np.asarray(indices[start:start + batch_size], dtype=np.int64)
            yield {"x": torch.from_numpy(self.data["x"][offset + ids]).to(device),
                   "y": torch.from_numpy(self.data["y"][offset + ids]).to(device), "sample_id": torch.from_numpy(ids)}

    def train_batches(self, indices, epoch, batch_size):
        return self._batches(0, indices, batch_size)

    def eval_batches(self, indices, batch_size, split="val"):
        return self._batches(TRAIN if split == "val" else 0, indices, batch_size)

    def example_batch(self, batch_size):
        device = ray.train.torch.get_device()
        return {"x": torch.zeros(batch_size, self.cfg.data.features, device=device), "y": torch.zeros(batch_size, device=device)}

    def loss(self, model, batch):
        return torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"]), torch.tensor(len(batch["y"]))

    def eval_sums(self, model, batch):
        err = ((model(batch["x"]).squeeze(1) - batch["y"]) ** 2).sum()
        return {"squared_error": err, "rows": len(batch["y"])}

    def eval_metrics(self, sums):
        return {"val_mse": sums["squared_error"] / max(sums["rows"], 1.0)}

    def describe_samples(self, sample_ids):
        return [f"row {i}" for i in sample_ids]
