"""Worker side: the failure tests' hooks that act on training steps (hosts/faults.py; none in a real run), as
the loop's callback."""

from __future__ import annotations

from behemoth.hosts import faults
from behemoth.worker.step_callbacks import Callback


class FaultHooks(Callback):
    """SLOW_WORLD's pause inside each step's time; KILL_AT_STEP's kill and RAISE_AT_STEP's error after the step's
    report."""

    def after_update(self, ctx, state, micro_batches, loss_sum, n_valid) -> None:
        faults.slow_step(ctx.world, state.step)

    def after_report(self, ctx, state) -> None:
        faults.at_step(state.step, ctx.rank, ctx.clock.totals)
