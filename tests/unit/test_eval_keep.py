"""Evaluation batches kept by the worker for tasks whose evaluation batches repeat: the second evaluation
reads none from the task, delivers the same batches, and nothing is kept when too big or cut short."""

import numpy as np
import pytest
import torch
from behemoth.worker import evaluate


class Task:
    def __init__(self, repeat=True, fail_at=None):
        self.calls, self.fail_at = 0, fail_at
        self.eval_batches_repeat = repeat

    def eval_batches(self, indices, batch_size, split="val"):
        self.calls += 1
        for i in range(0, len(indices), batch_size):
            if i == self.fail_at:
                raise ValueError("undecodable")
            part = indices[i:i + batch_size]
            yield {"x": torch.tensor(part, dtype=torch.float32), "ids": torch.tensor(part)}


@pytest.fixture(autouse=True)
def empty_cache():
    evaluate._KEPT.clear()
    yield
    evaluate._KEPT.clear()


def batches(task, indices, split="val"):
    return [{k: v.clone() for k, v in b.items()}
            for b in evaluate._eval_batches(task, np.asarray(indices), 4, split, torch.device("cpu"))]


def same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def test_kept_after_the_first_evaluation():
    task = Task()
    first = batches(task, range(10))
    assert same(batches(task, range(10)), first) and task.calls == 1
    assert [b["ids"].tolist() for b in first] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    batches(task, range(10), split="train")  # another split, other indices: read from the task
    batches(task, range(1, 11))
    assert task.calls == 3


def test_tasks_that_do_not_say_so_are_read_every_time():
    task = Task(repeat=False)
    batches(task, range(10))
    batches(task, range(10))
    assert task.calls == 2


def test_nothing_kept_when_too_big_or_cut_short(monkeypatch):
    monkeypatch.setattr(evaluate, "KEEP_BYTES", 100)  # 3 batches of 4 x (4 + 8) bytes = 144 > 100
    task = Task()
    batches(task, range(10))
    batches(task, range(10))
    assert task.calls == 2
    monkeypatch.setattr(evaluate, "KEEP_BYTES", 2**20)
    failing = Task(fail_at=8)
    for _ in range(2):
        with pytest.raises(ValueError):
            batches(failing, range(10))
    assert failing.calls == 2


def test_a_new_task_in_the_same_process_reads_its_own_batches_and_the_old_ones_go_with_their_task():
    """A sweep's lane trains trial after trial in one process: the batches were kept per (split, batch size,
    indices) alone, so a trial with another data.image_size (or another validation file of as many rows) was
    evaluated on the trial before's batches, and every trial's stayed in memory."""
    import gc

    class Scaled(Task):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def eval_batches(self, indices, batch_size, split="val"):
            for b in super().eval_batches(indices, batch_size, split):
                yield {**b, "x": b["x"] * self.scale}

    first, second = Scaled(1), Scaled(64)
    batches(first, range(10))
    assert [b["x"].tolist() for b in batches(second, range(10))][0] == [0, 64, 128, 192]
    assert second.calls == 1
    del first
    gc.collect()
    assert list(evaluate._KEPT) == [second]
