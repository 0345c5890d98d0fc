"""Worker side: what every step of a run is taken with, built once by the loop after its run is built and
restored, and handed to the step, the reporter and the callbacks instead of a dozen arguments each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    import torch

    from behemoth.checkpoints import CheckpointSaver, Trainables
    from behemoth.config import JobConfig
    from behemoth.metrics import PhaseClock
    from behemoth.tasks import Task
    from behemoth.worker.speed import SpeedMeter


@dataclass
class StepContext:
    cfg: JobConfig
    task: Task
    trainables: Trainables  # what a step updates and a checkpoint saves: model, optimizer, schedule, scaler, EMA
    device: torch.device
    rank: int
    world: int
    clock: PhaseClock  # where this worker group's time goes (the goodput account)
    speed: SpeedMeter
    saver: CheckpointSaver | None  # None: steps outside a run (a test's), which checkpoint nothing
    micro_batch: int  # samples per micro-batch on this rank ...
    accum: int  # ... and micro-batches per step: the rank's share of the global batch
    epoch_steps: int  # optimizer steps per epoch
    total_steps: int  # steps in the whole run (early stopping may end it sooner: TrainState.last_step)
    resumed_from_step: int = 0  # where this worker group started: the step of the checkpoint it restored
