"""Worker side: the batch plan: per-worker micro-batch x accumulation steps x workers = the global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from behemoth.config import JobConfig
from behemoth.tasks import Task
from behemoth.worker import autobatch
from behemoth.hosts.collectives import distributed
from behemoth.hosts.console import console
from behemoth.worker.precision import autocast


def batch_plan(cfg: JobConfig, world: int, model, task: Task, device, rank: int) -> tuple[int, int]:
    """(per-worker micro-batch, accumulation steps) whose product times the world is the global batch."""
    share = cfg.train.global_batch_size // world
    micro = cfg.train.micro_batch_size
    if micro is None:
        return share // cfg.train.grad_accum_steps, cfg.train.grad_accum_steps
    if micro == "auto":
        micro = _auto_micro_batch(cfg, model, task, device, share, rank)
    return micro, share // micro


def _auto_micro_batch(cfg: JobConfig, model, task: Task, device, share: int, rank: int) -> int:
    """train.micro_batch_size auto: search on this rank, agree on the smallest result over the ranks."""
    cap_mb = cfg.train.auto_batch_memory_mb
    cap = int(cap_mb * 2**20) if cap_mb else int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    slots = 2 if cfg.train.optimizer == "adamw" else int(cfg.train.momentum > 0)
    buffers = {k: v.clone() for k, v in model.named_buffers()}  # the probes must not move BN statistics

    def loss_at(m):
        with autocast(device, cfg.train.precision):
            return task.loss(model, task.example_batch(m))[0]

    largest, micro = autobatch.find_micro_batch(model, loss_at, share, device, cap, slots)
    model.load_state_dict(buffers, strict=False)
    agreed = torch.tensor([micro], device=device)
    if distributed():
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    micro = int(agreed.item())
    if rank == 0:
        console(f"micro_batch_size auto: up to {largest} samples fit in {cap / 2**20:.0f} MiB; using {micro} "
                f"(x {share // micro} accumulation steps = {share} per worker, global batch "
                f"{cfg.train.global_batch_size})")
    return micro
