"""The typed task contract (issue 68 item 3): `Task` is generic over what `check` returns and what `prepare`
returns, its signatures say so (no `Any` for the checked or prepared data), the built-in tasks name theirs, and a
user's task written against the untyped contract (`class MyTask(Task)`, no parameters, no annotations) and named
by import path keeps working: found by the registry, checked, prepared, built per worker, its loss taken."""

from __future__ import annotations

import inspect
import typing

import numpy as np
import torch

from behemoth.tasks import Task, make_task, task_of
from behemoth.tasks.registry import task_class
from conftest import job_dict


class UntypedRegression(Task):
    """A user's task as the contract before types asked for it: nothing parameterised, nothing annotated."""

    best = ("val_mse", "min")
    reported = {"val_mse": "min", "loss": "min"}
    eval_sum_names = ("squared_error", "rows")

    @classmethod
    def check(cls, cfg):
        rng = np.random.default_rng(cfg.train.seed)
        x = rng.normal(size=(40, 3)).astype(np.float32)
        return {"x": x, "y": x.sum(axis=1)}

    @classmethod
    def prepare(cls, cfg, data):
        return {**data, "prepared": True}

    @classmethod
    def describe(cls, cfg, data):
        return f"{len(data['x'])} rows"

    def __init__(self, cfg, data):
        super().__init__(cfg, data)
        self.data = data
        self.num_train_samples, self.num_val_samples = 32, 8

    def build_model(self):
        return torch.nn.Linear(3, 1)

    def train_batches(self, indices, epoch, batch_size):
        for start in range(0, len(indices), batch_size):
            ids = np.asarray(indices[start:start + batch_size])
            yield {"x": torch.from_numpy(self.data["x"][ids]), "y": torch.from_numpy(self.data["y"][ids]),
                   "sample_id": torch.from_numpy(ids)}

    def eval_batches(self, indices, batch_size, split="val"):
        return self.train_batches([32 + i for i in indices], 0, batch_size)

    def example_batch(self, batch_size):
        return {"x": torch.zeros(batch_size, 3), "y": torch.zeros(batch_size)}

    def loss(self, model, batch):
        return torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"]), torch.tensor(len(batch["y"]))

    def eval_sums(self, model, batch):
        return {"squared_error": ((model(batch["x"]).squeeze(1) - batch["y"]) ** 2).sum(), "rows": len(batch["y"])}

    def eval_metrics(self, sums):
        return {"val_mse": sums["squared_error"] / max(sums["rows"], 1.0)}


def test_a_users_untyped_task_by_import_path_keeps_working(tmp_path):
    from behemoth.job import config_from_dict

    job = job_dict(tmp_path, tmp_path / "runs")
    job["data"] = {"kind": "unit.test_task_contract:UntypedRegression"}
    cfg = config_from_dict(job)
    assert task_class(cfg.data.kind) is UntypedRegression and task_of(cfg) is UntypedRegression
    checked = UntypedRegression.check(cfg)
    assert UntypedRegression.describe(cfg, checked) == "40 rows"
    prepared = UntypedRegression.prepare(cfg, checked)
    assert prepared["prepared"] and UntypedRegression.train_samples(cfg, prepared) is None  # (the default)
    assert UntypedRegression.checkpoint_files(cfg, prepared) == {} and UntypedRegression.data_modules(cfg, prepared) == ()
    task = make_task(cfg, prepared)
    assert type(task) is UntypedRegression and task.loss_items({}) is None
    torch.manual_seed(0)
    model = task.build_model()
    (batch,) = task.train_batches(list(range(8)), 0, 8)
    loss, n = task.loss(model, batch)
    expected = ((model(torch.from_numpy(prepared["x"][:8])).squeeze(1) - torch.from_numpy(prepared["y"][:8])) ** 2)
    assert int(n) == 8 and torch.allclose(loss, expected.mean())


# The contract's members that take or return the checked or prepared data: (member, parameter or "return").
DATA_SIGNATURES = [("check", "return"), ("prepare", "checked"), ("prepare", "return"), ("describe", "checked"),
                   ("train_samples", "data"), ("data_modules", "prepared"), ("checkpoint_files", "prepared"),
                   ("__init__", "prepared")]


def test_the_contract_types_its_checked_and_prepared_data():
    from behemoth.tasks.contract import CheckedT, PreparedT

    assert Task.__parameters__ == (CheckedT, PreparedT)
    for member, name in DATA_SIGNATURES:
        signature = inspect.signature(getattr(Task, member))
        annotation = signature.return_annotation if name == "return" else signature.parameters[name].annotation
        assert annotation in ("CheckedT", "PreparedT", "CheckedT | PreparedT"), (member, name, annotation)
        assert "Any" not in str(annotation)


def test_the_built_in_tasks_name_their_data_types():
    from behemoth.data.image.images import ImageIndex
    from behemoth.data.text.labelled_text import LabelledRows, TokenisedRows
    from behemoth.data.text.text import Unit
    from behemoth.data.text.text_packing import TokenIndex
    from behemoth.tasks.causal_lm import CausalLM
    from behemoth.tasks.chat import ChatLM
    from behemoth.tasks.image import ImageClassification
    from behemoth.tasks.text_classification import TextClassification

    def parameters(cls):
        (base,) = [b for b in cls.__orig_bases__ if typing.get_origin(b) is Task]
        return typing.get_args(base)

    assert parameters(ImageClassification) == (ImageIndex, ImageIndex)
    assert parameters(CausalLM) == (list[Unit], TokenIndex) and issubclass(ChatLM, CausalLM)
    assert parameters(TextClassification) == (LabelledRows, TokenisedRows)
