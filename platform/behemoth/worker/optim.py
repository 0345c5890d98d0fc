"""Optimizer and learning-rate schedule from the `train` config section."""

from __future__ import annotations

import math

import torch

from behemoth.config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # No weight decay on biases and norm weights (1-d tensors), as in the standard ResNet/GPT recipes.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernels where the parameters are on a GPU (one kernel for the whole update, not a few per
    # tensor), and wherever train.nonfinite is skip: only they take a found_inf flag on the device and skip
    # the whole update by it (weights, moments and step count) without the host reading it (train_step).
    fused = bool(decay + no_decay) and ((decay + no_decay)[0].device.type == "cuda" or cfg.nonfinite == "skip")
    if cfg.optimizer == "sgd":
        # (torch has no fused SGD for FSDP's sharded parameters, DTensors: its first step failed. Fused AdamW has
        # one. The config refuses train.nonfinite: skip there, whose flag needs the fused kernel)
        sharded = any(type(p).__name__ == "DTensor" for p in decay + no_decay)
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0,
                               fused=(fused and not sharded) or None)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, fused=fused or None)


def warmup_steps(cfg: TrainConfig, epoch_steps: int | None) -> int:
    """train.warmup_steps, or train.warmup_epochs in steps of this run's global batch (rounded up)."""
    return cfg.warmup_steps_for(epoch_steps)


def lr_factor(cfg: TrainConfig, total_steps: int, step: int, warmup: int | None = None) -> float:
    """The learning rate at `step` (0-based: the step about to be taken) as a multiple of train.lr: a linear
    warm-up over `warmup` steps (default train.warmup_steps), then train.schedule down to min_lr_ratio at the
    last step."""
    warmup = cfg.warmup_steps if warmup is None else warmup
    if step < warmup:
        return (step + 1) / warmup
    after = max(total_steps - warmup, 1)
    progress = min((step - warmup) / after, 1.0)
    low = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "linear":
        return low + (1 - low) * (1 - progress)
    if cfg.schedule == "wsd":  # stable, then a linear decay over the last wsd_decay_fraction
        stable = 1 - cfg.wsd_decay_fraction
        return 1.0 if progress <= stable else low + (1 - low) * (1 - progress) / cfg.wsd_decay_fraction
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int, epoch_steps: int | None = None):
    """train.schedule as a LambdaLR (its state, the step count, is in every checkpoint; a plain function, so
    that state holds no entry for it). `epoch_steps`: for train.warmup_epochs."""
    warmup = warmup_steps(cfg, epoch_steps)

    def factor(step: int) -> float:
        return lr_factor(cfg, total_steps, step, warmup)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
