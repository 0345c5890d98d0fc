"""Worker side: the task's validation metrics over the whole validation set, each sample on one rank; and
the function `behemoth eval` runs on every worker (a checkpoint's model through the same evaluation)."""

from __future__ import annotations

import hashlib
import weakref

import numpy as np
import torch

from behemoth.config import JobConfig
from behemoth.storage import weights
from behemoth.data.order import rank_eval_indices
from behemoth.tasks import Task, make_task
from behemoth import hosts
from behemoth.worker import parallel
from behemoth.hosts.collectives import all_reduce_sum
from behemoth.models.wrappers import unwrap
from behemoth.worker.precision import autocast, master_weights


@torch.no_grad()
def evaluate(model, task: Task, rank: int, world: int, batch_size: int, split: str = "val") -> dict:
    """The task's validation metrics over the whole validation set (or, for `behemoth eval --split train`,
    the training set without augmentation), each sample on exactly one rank."""
    sharded = parallel.is_sharded(model)
    # DDP: the inner model, so no collectives run inside eval. FSDP: the sharded model gathers its
    # parameters in every forward, so all ranks must run the same number of forwards (see below).
    net = unwrap(model)
    net.eval()
    names = task.eval_sum_names
    totals = torch.zeros(len(names), dtype=torch.float64, device=hosts.device())
    n = task.num_val_samples if split == "val" else task.num_train_samples
    indices = rank_eval_indices(n, rank, world)
    forwards = 0
    if len(indices):
        for batch in _eval_batches(task, indices, batch_size, split, totals.device):
            with autocast(totals.device, task.cfg.train.precision):
                totals += _stacked(task.eval_sums(net, batch), names, totals)
            forwards += 1
    if sharded:  # ranks with fewer batches join the others' all-gathers with forwards they discard
        most = max(-(-len(rank_eval_indices(n, r, world)) // batch_size) for r in range(world))
        for _ in range(most - forwards):
            with autocast(totals.device, task.cfg.train.precision):
                task.eval_sums(net, task.example_batch(1))
    all_reduce_sum(totals)
    metrics = task.eval_metrics(dict(zip(names, totals.tolist())))
    if rank == 0 and split == "val" and not sharded:
        with autocast(totals.device, task.cfg.train.precision):
            samples = task.eval_samples(net)
        if samples:
            metrics["val_outputs"] = samples  # (val_samples is a count: the image task's)
    net.train()
    return metrics


def _stacked(sums: dict, names: tuple[str, ...], like: torch.Tensor) -> torch.Tensor:
    """A batch's named sums as one float64 vector in the task's order (one all-reduce for all of them)."""
    if set(sums) != set(names):
        raise TypeError(f"eval_sums returned {sorted(sums)}; the task's eval_sum_names are {list(names)}")
    return torch.stack([torch.as_tensor(sums[n]).to(like) for n in names])


# Evaluation batches kept in this worker process, for tasks whose evaluation batches are the same every time
# (`eval_batches_repeat`, e.g. images: centre crop, no augmentation): per task object (one per run, or per
# trial in a sweep's lane: a trial with another image_size or validation file never sees the one before's),
# (split, batch size, indices) -> batches on the CPU, or None where they outgrew KEEP_BYTES. Otherwise every
# evaluation would build a new Ray Data pipeline and pay its start-up; kept, every evaluation after the first
# is forwards only. They go with their task.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
KEEP_BYTES = 256 * 2**20  # per worker: CIFAR-size validation sets fit many times; ImageNet's does not


def _eval_batches(task: Task, indices, batch_size: int, split: str, device):
    if not task.eval_batches_repeat:
        yield from task.eval_batches(indices, batch_size, split)
        return
    key = (split, batch_size, hashlib.sha1(np.ascontiguousarray(indices).tobytes()).hexdigest())
    kept_by_task = _KEPT.setdefault(task, {})
    if kept_by_task.get(key) is not None:
        for batch in kept_by_task[key]:
            yield {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        return
    kept, size = [], 0
    for batch in task.eval_batches(indices, batch_size, split):
        if kept is not None:
            size += sum(v.numel() * v.element_size() for v in batch.values() if torch.is_tensor(v))
            if size > KEEP_BYTES:
                kept = None
            else:
                kept.append({k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()})
        yield batch
    kept_by_task[key] = kept  # only once every batch was delivered: a pass cut short by an error keeps nothing


def evaluate_checkpoint_per_worker(loop_config: dict) -> dict:
    """`behemoth eval` on one worker: build the job's model, load the checkpoint's weights, run the task's
    evaluation of a split with the run's batch size. Rank 0's return value is the metrics."""
    cfg: JobConfig = loop_config["job"]  # typed: checked once, on the driver (each process unpickles it)
    ctx = hosts.current()
    task = make_task(cfg, ctx.prepared_data(loop_config))
    if cfg.scaling.torch_threads:
        torch.set_num_threads(cfg.scaling.torch_threads)
    model = master_weights(task.build_model(), cfg.model.dtype)  # as the run trained it
    source = loop_config["checkpoint"]
    weights.load_weights(model, weights.read_state_dict(source), source)
    model.to(ctx.device)
    return evaluate(model, task, ctx.rank, ctx.world, loop_config["batch_size"], loop_config["split"])
