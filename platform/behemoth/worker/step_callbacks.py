"""Worker side: what runs around every training step besides the update itself, as callbacks the loop lists
once and calls at four named points of each step (Composer's events, in one small file per callback: the
weight average in ema.py, the sample ledger in ledger.py, the fault hooks in faults.py, the profiler in
profiling.py). Each point calls the callbacks in the list's order; every method is a no-op by default. After
behemoth's own come the task's (`Task.callbacks()`) and the user's (`train.callbacks`: `callback_classes`),
each handed the step context (worker/step_context.py: the config, task, trainables, device, rank, world, ...).

The points, in a step's order:
- `before_step(ctx, state)`: before the step's reseeding and update (state.step: the steps done so far);
- `after_update(ctx, state, micro_batches, loss_sum, n_valid)`: after the optimizer step (taken or, where
  train.nonfinite skips it, skipped), before the state counts it; inside the step's time on the clock;
- `after_step(ctx, state)`: after the state counted the step and the clock took its time; before its report;
- `after_report(ctx, state)`: after the step's report, whether or not one was due (the last point of a step).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from behemoth.errors import ConfigError

if TYPE_CHECKING:  # annotations only
    import torch

    from behemoth.storage.checkpoint import TrainState
    from behemoth.worker.step_context import StepContext


class Callback:
    def before_step(self, ctx: StepContext, state: TrainState) -> None:
        """Before the step's update."""

    def after_update(self, ctx: StepContext, state: TrainState, micro_batches: list[dict], loss_sum: torch.Tensor,
                     n_valid: torch.Tensor) -> None:
        """After the optimizer step: this rank's loss summed over its samples and their count (device tensors;
        zero for a skipped non-finite step)."""

    def after_step(self, ctx: StepContext, state: TrainState) -> None:
        """After the state counted the step (state.step: the step just trained), before its report."""

    def after_report(self, ctx: StepContext, state: TrainState) -> None:
        """After the step's report (or its absence)."""


class Callbacks:
    """The loop's callbacks, each point called on every one of them in order."""

    def __init__(self, callbacks: Iterable[Callback | None]):
        self.callbacks = [callback for callback in callbacks if callback is not None]

    def before_step(self, ctx: StepContext, state: TrainState) -> None:
        for callback in self.callbacks:
            callback.before_step(ctx, state)

    def after_update(self, ctx: StepContext, state: TrainState, micro_batches: list[dict], loss_sum: torch.Tensor,
                     n_valid: torch.Tensor) -> None:
        for callback in self.callbacks:
            callback.after_update(ctx, state, micro_batches, loss_sum, n_valid)

    def after_step(self, ctx: StepContext, state: TrainState) -> None:
        for callback in self.callbacks:
            callback.after_step(ctx, state)

    def after_report(self, ctx: StepContext, state: TrainState) -> None:
        for callback in self.callbacks:
            callback.after_report(ctx, state)


def callback_classes(paths: list[str]) -> list[type[Callback]]:
    """train.callbacks' classes, imported (the driver checks them before Ray starts; each worker makes one of
    each): a path that does not import, or names no Callback subclass, is one ConfigError naming it."""
    found = []
    for path in paths:
        module, _, name = path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"train.callbacks: cannot import {path} ({e}); is it installed, or on PYTHONPATH "
                              f"(with ray job submit: in the --working-dir)?") from None
        if not (isinstance(cls, type) and issubclass(cls, Callback)):
            raise ConfigError(f"train.callbacks: {path} is not a subclass of behemoth.Callback (subclass it and "
                              f"define the points it needs: before_step, after_update, after_step, after_report)")
        found.append(cls)
    return found
