"""Worker side: the task's validation metrics over the whole validation set, each sample on one rank."""

from __future__ import annotations

import ray.train.torch
import torch

from behemoth.data.order import rank_eval_indices
from behemoth.tasks import Task
from behemoth.worker import parallel
from behemoth.worker.collectives import all_reduce_sum
from behemoth.worker.parallel import unwrap
from behemoth.worker.precision import autocast


@torch.no_grad()
def evaluate(model, task: Task, rank: int, world: int, batch_size: int) -> dict:
    """The task's validation metrics over the whole validation set, each sample on exactly one rank."""
    sharded = parallel.is_sharded(model)
    # DDP: the inner model, so no collectives run inside eval. FSDP: the sharded model gathers its
    # parameters in every forward, so all ranks must run the same number of forwards (see below).
    net = unwrap(model)
    net.eval()
    totals = torch.zeros(task.eval_size, dtype=torch.float64, device=ray.train.torch.get_device())
    indices = rank_eval_indices(task.num_val_samples, rank, world)
    forwards = 0
    if len(indices):
        for batch in task.eval_batches(indices, batch_size):
            with autocast(totals.device, task.cfg.train.precision):
                totals += task.eval_sums(net, batch).to(totals)
            forwards += 1
    if sharded:  # ranks with fewer batches join the others' all-gathers with forwards they discard
        most = max(-(-len(rank_eval_indices(task.num_val_samples, r, world)) // batch_size) for r in range(world))
        for _ in range(most - forwards):
            with autocast(totals.device, task.cfg.train.precision):
                task.eval_sums(net, task.example_batch(1))
    all_reduce_sum(totals)
    net.train()
    return task.eval_metrics(totals)
