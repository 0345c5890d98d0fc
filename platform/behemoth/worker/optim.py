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
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    # the fused kernel where the parameters are on a GPU: one kernel for the whole update, not a few per tensor
    fused = bool(decay + no_decay) and (decay + no_decay)[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, fused=fused or None)


def warmup_cosine(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    """Linear warmup from 0 to lr over warmup_steps, then cosine decay to lr * min_lr_ratio at total_steps."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min((step - cfg.warmup_steps) / max(total_steps - cfg.warmup_steps, 1), 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
