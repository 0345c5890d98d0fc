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
from conftest import closable, job_dict


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


def _own_members(part) -> set[str]:
    """A part's members: what it defines or annotates, __init__ included, other dunders not."""
    return {n for n in [*vars(part), *vars(part).get("__annotations__", {})]
            if n == "__init__" or not n.startswith("__")} - {"_abc_impl"}


def test_a_task_is_its_five_parts_each_of_at_most_twelve_typed_members():
    """Issue 77 item 2: the contract is five small interfaces (the driver's data, the worker's batches, the
    model, the step, the evaluation), none over 12 members, none in two parts; `Task` adds none of its own; every
    method of a part is annotated (its return, but __init__'s, and each parameter but self/cls, the model, and the
    index lists `indices` and `sample_ids`)."""
    from behemoth.tasks.parts import TaskBatches, TaskData, TaskEvaluation, TaskModel, TaskStep

    parts = (TaskData, TaskBatches, TaskModel, TaskStep, TaskEvaluation)
    assert all(issubclass(Task, part) for part in parts)
    members = {part.__name__: _own_members(part) for part in parts}
    assert all(len(m) <= 12 for m in members.values()), {k: len(m) for k, m in members.items()}
    assert _own_members(Task) <= {"__orig_bases__", "__parameters__"}, _own_members(Task)
    everything = set().union(*members.values())
    assert sum(map(len, members.values())) == len(everything)  # (no member in two parts)
    for name in everything:
        member = inspect.getattr_static(Task, name, None)  # (None: annotated only, set by each worker)
        function = getattr(member, "__func__", member)
        if not callable(function) or isinstance(function, type):
            continue  # (an attribute: its annotation is the part's)
        signature = inspect.signature(function)
        untyped = [p for p in signature.parameters.values() if p.annotation is inspect.Parameter.empty
                   and p.name not in ("self", "cls", "model", "indices", "sample_ids")]
        assert not untyped and (name == "__init__" or signature.return_annotation is not inspect.Signature.empty), name
    # the driver's half is classmethods and class attributes only: the driver never holds an instance
    for name in members["TaskData"]:
        member = inspect.getattr_static(TaskData, name, None)
        assert isinstance(member, (classmethod, type)) or not callable(member), name


def test_a_ready_made_classification_gives_a_tasks_loss_and_evaluation_from_its_logits():
    from behemoth.tasks.classification import Classification

    class Rows(Classification, UntypedRegression):  # the regression's data, its step and evaluation replaced
        samples_are = "rows"

        def logits(self, model, batch):
            return model(batch["x"])

    assert not Rows.__abstractmethods__ and Rows.best == ("val_accuracy", "max")
    torch.manual_seed(0)
    task, model = Rows(None, None), torch.nn.Linear(3, 4)
    batch = {"x": torch.randn(6, 3), "label": torch.tensor([0, 1, 2, 3, 0, 1]), "sample_id": torch.arange(6)}
    logits = model(batch["x"])
    loss, n = task.loss(model, batch)
    assert torch.equal(loss, torch.nn.functional.cross_entropy(logits, batch["label"])) and int(n) == 6
    with torch.no_grad():
        sums = {k: float(v) for k, v in task.eval_sums(model, batch).items()}
    correct = int((logits.argmax(1) == batch["label"]).sum())
    metrics = task.eval_metrics(sums)
    assert metrics["val_accuracy"] == correct / 6 and metrics["val_samples"] == 6
    assert abs(metrics["val_loss"] - float(loss)) < 1e-6
    assert Rows.summary_lines(metrics)[0].endswith("6 rows)") and Rows.progress_fields(metrics)[1].startswith("val_acc")


def test_a_batch_without_sample_ids_is_one_error_naming_the_task_and_the_member_that_made_it():
    import pytest

    from behemoth.errors import ConfigError
    from behemoth.tasks.parts import checked_batches

    task = UntypedRegression.__new__(UntypedRegression)
    good = [{"x": torch.zeros(2), "sample_id": torch.arange(2)}] * 3
    assert list(checked_batches(iter(good), task, "train_batches")) == good
    assert list(checked_batches(iter([]), task, "train_batches")) == []
    for bad, said in (([{"x": torch.zeros(2)}], "a dict with keys ['x']"), ([(1, 2)], "a tuple"),
                      ([{"sample_id": [0, 1]}], "a dict with keys ['sample_id']")):
        with pytest.raises(ConfigError, match=f"task UntypedRegression's train_batches gave {said[:12]}"):
            list(checked_batches(iter(bad), task, "train_batches"))


def test_checked_batches_closed_at_its_first_batch_closes_the_pipeline_under_it():
    """An epoch left after its first batch (a run stopped at its first step, an epoch opened ahead and never trained):
    closing the checked batches closes the task's pipeline then (the image task's chain of Ray Datasets)."""
    from behemoth.tasks.parts import checked_batches

    closed = []
    pipeline = closable(closed)([{"sample_id": torch.arange(2)}] * 3)
    checked = checked_batches(pipeline, UntypedRegression.__new__(UntypedRegression), "train_batches")
    next(checked)
    checked.close()
    assert closed == [True]
