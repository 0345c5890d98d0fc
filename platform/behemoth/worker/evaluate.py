"""Worker side: the task's validation metrics over the whole validation set, each sample on one rank; and
the function `behemoth eval` runs on every worker (a checkpoint's model through the same evaluation)."""

from __future__ import annotations

import ray
import ray.train
import ray.train.torch
import torch

from behemoth import weights
from behemoth.config import config_from_dict
from behemoth.data.order import rank_eval_indices
from behemoth.tasks import Task, make_task
from behemoth.worker import parallel
from behemoth.worker.collectives import all_reduce_sum
from behemoth.worker.parallel import unwrap
from behemoth.worker.precision import autocast


@torch.no_grad()
def evaluate(model, task: Task, rank: int, world: int, batch_size: int, split: str = "val") -> dict:
    """The task's validation metrics over the whole validation set (or, for `behemoth eval --split train`,
    the training set without augmentation), each sample on exactly one rank."""
    sharded = parallel.is_sharded(model)
    # DDP: the inner model, so no collectives run inside eval. FSDP: the sharded model gathers its
    # parameters in every forward, so all ranks must run the same number of forwards (see below).
    net = unwrap(model)
    net.eval()
    totals = torch.zeros(task.eval_size, dtype=torch.float64, device=ray.train.torch.get_device())
    n = task.num_val_samples if split == "val" else task.num_train_samples
    indices = rank_eval_indices(n, rank, world)
    forwards = 0
    if len(indices):
        for batch in task.eval_batches(indices, batch_size, split):
            with autocast(totals.device, task.cfg.train.precision):
                totals += task.eval_sums(net, batch).to(totals)
            forwards += 1
    if sharded:  # ranks with fewer batches join the others' all-gathers with forwards they discard
        most = max(-(-len(rank_eval_indices(n, r, world)) // batch_size) for r in range(world))
        for _ in range(most - forwards):
            with autocast(totals.device, task.cfg.train.precision):
                task.eval_sums(net, task.example_batch(1))
    all_reduce_sum(totals)
    net.train()
    return task.eval_metrics(totals)


def evaluate_checkpoint_per_worker(loop_config: dict) -> dict:
    """`behemoth eval` on one worker: build the job's model, load the checkpoint's weights, run the task's
    evaluation of a split with the run's batch size. Rank 0's return value is the metrics."""
    cfg = config_from_dict(loop_config["job"], where="job config")
    task = make_task(cfg, ray.get(loop_config["data_ref"]))
    ctx = ray.train.get_context()
    if cfg.scaling.torch_threads:
        torch.set_num_threads(cfg.scaling.torch_threads)
    model = task.build_model()
    source = loop_config["checkpoint"]
    weights.load_weights(model, weights.read_state_dict(source), source)
    model.to(ray.train.torch.get_device())
    return evaluate(model, task, ctx.get_world_rank(), ctx.get_world_size(), loop_config["batch_size"],
                    loop_config["split"])
