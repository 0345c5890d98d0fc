"""Worker side: the objects one run trains with, held together (what a step updates and a checkpoint saves)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Trainables:
    model: torch.nn.Module  # wrapped: DDP or FSDP, maybe compiled
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    scaler: Any  # torch.amp.GradScaler (disabled unless fp16 on a GPU)
    hook_state: Any = None  # the gradient-compression hook's state (PowerSGD), None without one
    ema: Any = None  # worker.ema.WeightAverage (train.ema_decay), None without one

    def parts(self) -> dict:
        """The keyword arguments checkpoint.load and checkpoint.snapshot take."""
        return dict(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                    ema=self.ema)

    def evaluated(self) -> torch.nn.Module:
        """The model evaluation runs: the weight average where there is one."""
        return self.model if self.ema is None else self.ema.module
