"""Worker side: when a lone worker copies its state to the driver's memory (checkpoint.memory_copy), as the loop's
callback after each step.

With one worker (an elastic run waiting for its replacement, a one-worker run) nothing protects the run against
its node going without notice but its last checkpoint. A copy (checkpoints/memory_copy.py) protects it as a
checkpoint would, for the price of a host snapshot and one transfer; its interval is checkpoint.every_n_steps
auto's rule (worker/checkpoint_interval.py) with the copies' own measured hold, as where nothing protects the
run, and its holds are the run's checkpoint account's (checkpoint.hold_budget), the disk checkpoints' too. While
copies protect the run the disk checkpoints are spaced as where a replica protects it (worker/reporting.py).

Copies are taken only by a group of one worker (its rank 0 decides alone: no rank must agree), with the run's
keeper reachable (the driver starts one for an auto run that may train on one worker), a state of at most
memory_copy.MAX_BYTES, and not under FSDP.
"""

from __future__ import annotations

import time

from behemoth.checkpoints import MemoryCopy
from behemoth.hosts.console import console
from behemoth.storage.checkpoint import TrainState
from behemoth.worker.checkpoint_interval import CheckpointInterval
from behemoth.worker.step_callbacks import Callback
from behemoth.worker.step_context import StepContext


class MemoryCopies(Callback):
    def __init__(self, ctx: StepContext, link, state: TrainState, reporter):
        cfg = ctx.cfg
        self.copy = MemoryCopy(link, ctx.trainables) if link is not None else None
        self.active = bool(self.copy is not None and cfg.checkpoint.memory_copy and ctx.world == 1
                           and cfg.checkpoint.every_n_steps == "auto")
        if self.active and not self.copy.fits():
            self.active = False
            console("one worker, but its state is not copied to the driver's memory (checkpoint.memory_copy): FSDP, "
                    "or a state over 2 GiB; a loss without notice costs the steps since the last checkpoint")
        self.interval = CheckpointInterval(cfg)  # the copies' own holds (the account is the run's: the state's)
        self.reporter = reporter
        reporter.copies_protect = self.active  # (the disk checkpoints are spaced as where a replica protects)
        self.next_at = state.step + 1  # the first copy after the first step, the next one measured ...
        self.warm = False  # ... (the first connects to the keeper and allocates the host buffers: ~0.1 s here)
        self.last = (state.step, state.trained_s)
        self.said: int | None = None

    def after_step(self, ctx: StepContext, state: TrainState) -> None:
        if (not self.active or state.step < self.next_at
                or self.reporter.interval.due(state, ctx.total_steps)):  # (a checkpoint on disk at this step)
            return
        began = time.perf_counter()
        sent = self.copy.send(state)
        held = time.perf_counter() - began
        ctx.clock.add("checkpoint", held)
        self.reporter.copied(held)
        state.held_s += held  # checkpoint.hold_budget's account over the run
        if sent and self.warm:
            self.interval.measured(held)
        self.warm = self.warm or sent
        if not self.interval.holds:  # (none measured yet)
            self.next_at = state.step + 1
            return
        step_s = (state.trained_s - self.last[1]) / max(state.step - self.last[0], 1)
        self.last = (state.step, state.trained_s)
        seconds, why = self.interval.seconds(state, ahead_s=(ctx.total_steps - state.step) * step_s)
        steps = max(1, round(seconds / step_s)) if step_s > 0 else 1
        self.next_at = state.step + steps
        if self.said is None or abs(steps - self.said) >= 0.2 * self.said:
            self.said = steps
            console(f"one worker, nothing else protects the run: its state is copied to the driver's memory every "
                    f"{steps} steps (checkpoint.memory_copy: a copy holds the loop {held * 1000:.1f} ms; {why})")
