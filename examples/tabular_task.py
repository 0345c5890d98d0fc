"""A workload of one's own: tabular classification from CSV files, prepared with Ray Data on the CPUs, trained
with DDP by behemoth (checkpoints, resume, evaluation, tracking, sweeps: the platform's, nothing here).

The job names the task by import path (`data.kind: examples.tabular_task:TabularClassification`) and gives its
own `data:` keys (TabularData). What the task does:
- before Ray (`check`): every file's header read, the label and categorical columns found, one line naming the
  file and the column where one is missing;
- with Ray up (`prepare`): the CSVs read by Ray Data, each numeric column's mean and standard deviation and each
  categorical column's values computed over the training rows, every row turned into standardised numbers plus
  one-hot categories by Ray Data tasks; what the workers get: the two splits' feature matrices and labels;
- on each worker: batches of its rows (behemoth's loop passes the rank's sample indices), a two-layer network
  and its logits; the loss (cross-entropy) and the evaluation (val_loss, val_accuracy) are taken ready-made
  (`behemoth.Classification`).

Try it from the repository root:

    python examples/tabular_task.py data/tabular            # writes train.csv and val.csv there
    PYTHONPATH=. behemoth train examples/tabular_task.yaml
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from behemoth import Classification, Task
from behemoth.config import DataConfig
from behemoth.errors import DataError

Prepared = dict  # {"train": (x, y), "val": (x, y), "classes": [...], "features": [...]}


@dataclass
class TabularData(DataConfig):
    """The task's `data:` keys beside the common ones (data.train_files, data.val_files, ...)."""

    label_column: str = "label"
    categorical: list[str] = field(default_factory=list)  # columns of strings, one-hot encoded
    hidden: int = 64  # the network's hidden width


def _header(path: str) -> list[str]:
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def _named(columns: list[str], most: int = 20) -> str:
    """A header's column names for a message, the first `most` of them, each cut to 40 characters."""
    shown = ", ".join(c[:40] for c in columns[:most])
    return f"[{shown}{', ...' if len(columns) > most else ''}] ({len(columns)} columns)"


def _featurise(batch, *, numeric, means, stds, categories, label_column, classes):
    """One Ray Data batch (numpy columns) -> {"x": float32 [n, features], "y": int64 [n]}."""
    parts = [((batch[c].astype(np.float32) - means[c]) / stds[c])[:, None] for c in numeric]
    for c, values in categories.items():
        parts.append((batch[c].astype(str)[:, None] == np.array(values)[None, :]).astype(np.float32))
    labels = {name: i for i, name in enumerate(classes)}
    return {"x": np.concatenate(parts, axis=1), "y": np.array([labels[str(v)] for v in batch[label_column]])}


class TabularClassification(Classification, Task[dict, Prepared]):
    """Its loss and evaluation are behemoth's ready-made classifier's (`Classification`: cross-entropy, val_loss,
    val_accuracy) over `logits`; the rest is its own."""

    # --- driver side ------------------------------------------------------------------------------------
    data_config = TabularData
    samples_are = "rows"

    @classmethod
    def check(cls, cfg) -> dict:
        d = cfg.data
        files = {"train": list(d.train_files), "val": list(d.val_files)}
        if not files["train"] or not files["val"]:
            raise DataError("data.train_files and data.val_files: name the training and validation CSV files")
        columns = None
        for path in files["train"] + files["val"]:
            if not Path(path).is_file():
                raise DataError(f"{path} does not exist (data.train_files / data.val_files)")
            header = _header(path)
            for column in [d.label_column, *d.categorical]:
                if column not in header:
                    raise DataError(f"{path} has no column '{column}' (data.label_column / data.categorical); "
                                    f"its columns: {_named(header)}")
            if columns is not None and header != columns:
                raise DataError(f"{path}: its columns {_named(header)} differ from {files['train'][0]}'s "
                                f"{_named(columns)}")
            columns = header
        return {"files": files, "columns": columns}

    @classmethod
    def prepare(cls, cfg, checked: dict) -> Prepared:
        import ray.data
        from ray.data.aggregate import Mean, Std

        d = cfg.data
        numeric = [c for c in checked["columns"] if c != d.label_column and c not in d.categorical]
        train = ray.data.read_csv(checked["files"]["train"]).materialize()  # (read once, aggregated below)
        moments = train.aggregate(*(Mean(c) for c in numeric), *(Std(c) for c in numeric)) if numeric else {}
        means = {c: float(moments[f"mean({c})"]) for c in numeric}
        stds = {c: float(moments[f"std({c})"]) or 1.0 for c in numeric}
        categories = {c: sorted(str(v) for v in train.unique(c)) for c in d.categorical}
        classes = sorted(str(v) for v in train.unique(d.label_column))
        fn_kwargs = dict(numeric=numeric, means=means, stds=stds, categories=categories,
                         label_column=d.label_column, classes=classes)
        out = {"classes": classes, "features": numeric + [f"{c}={v}" for c, vs in categories.items() for v in vs]}
        for split in ("train", "val"):
            ds = train if split == "train" else ray.data.read_csv(checked["files"]["val"])
            batches = list(ds.map_batches(_featurise, batch_format="numpy", fn_kwargs=fn_kwargs)
                           .iter_batches(batch_format="numpy", batch_size=None))
            out[split] = (np.concatenate([b["x"] for b in batches]).astype(np.float32),
                          np.concatenate([b["y"] for b in batches]))
        return out

    @classmethod
    def describe(cls, cfg, checked: dict) -> str:
        return f"CSV files: {len(checked['files']['train'])} train, {len(checked['files']['val'])} val"

    # --- worker side ------------------------------------------------------------------------------------
    def __init__(self, cfg, data: Prepared):
        super().__init__(cfg, data)
        self.data = data
        self.num_train_samples, self.num_val_samples = len(data["train"][1]), len(data["val"][1])

    def build_model(self):
        features, hidden = self.data["train"][0].shape[1], self.cfg.data.hidden
        return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(hidden, len(self.data["classes"])))

    def _batches(self, split, indices, batch_size):
        x, y = self.data[split]
        for start in range(0, len(indices), batch_size):
            ids = np.asarray(indices[start:start + batch_size], dtype=np.int64)
            yield {"x": torch.from_numpy(x[ids]), "label": torch.from_numpy(y[ids]), "sample_id": torch.from_numpy(ids)}

    def train_batches(self, indices, epoch, batch_size):
        return self._batches("train", indices, batch_size)

    def eval_batches(self, indices, batch_size, split="val"):
        return self._batches(split, indices, batch_size)

    def example_batch(self, batch_size):
        x = torch.zeros(batch_size, self.data["train"][0].shape[1])
        return {"x": x, "label": torch.zeros(batch_size, dtype=torch.long)}

    def logits(self, model, batch):
        """The batches are made on the host: the rows go to the model's device (a GPU's, or the CPU) here."""
        return model(batch["x"].to(next(model.parameters()).device, non_blocking=True))

    def describe_samples(self, sample_ids):
        return [f"training row {i}" for i in sample_ids]


def write_demo(folder: str | Path, rows: int = 3000, seed: int = 0) -> Path:
    """train.csv and val.csv (a fifth of `rows`) in `folder`: six numeric columns on very different scales (so
    standardising matters), a region of four values, and a label of three classes that depends on both."""
    rng = np.random.default_rng(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    scales = np.array([1.0, 10.0, 100.0, 0.1, 1000.0, 5.0])
    weights, by_region = rng.normal(size=(6, 3)), rng.normal(size=(4, 3))
    regions = np.array(["north", "south", "east", "west"])
    for name, n in (("train", rows), ("val", rows // 5)):
        x = rng.normal(size=(n, 6))
        region = rng.integers(0, 4, size=n)
        label = (x @ weights + 1.5 * by_region[region]).argmax(1)
        with open(folder / f"{name}.csv", "w", newline="") as f:
            out = csv.writer(f)
            out.writerow([f"f{i}" for i in range(6)] + ["region", "label"])
            for row, r, y in zip(x * scales, region, label):
                out.writerow([f"{v:.6g}" for v in row] + [regions[r], f"class_{y}"])
    return folder


if __name__ == "__main__":
    print(f"wrote {write_demo(sys.argv[1] if len(sys.argv) > 1 else 'data/tabular')}/train.csv and val.csv")
