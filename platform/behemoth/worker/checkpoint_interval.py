"""When to checkpoint: every checkpoint.every_n_steps steps, or with `auto` as often as checkpoints pay.

A checkpoint costs the seconds it holds the training loop (C: with asynchronous saves only the snapshot to host
memory); an interruption without notice costs the work since the last one (half an interval on average). Young
and Daly's optimum interval between checkpoints is then sqrt(2 C M) seconds of training, M the mean time between
interruptions. C is measured: the median hold of this run's own checkpoints so far (rank 0's; on a worker
that trains on its CPU, with the CPU seconds of the background write, which the step's cores gave up). M is
checkpoint.interruption_every_s until the run has met an interruption (or its training time, where that is
longer: none came in it), then what the run met: its training seconds over its interruptions, an interruption
being each resume of the run from its checkpoint that lost work (not one from a notice's last checkpoint: the
notice lost nothing, and counting it would checkpoint more often for no gain; train_state.json keeps both
counts, so they add up over restarts and reruns). Leaning on what the run meets is the cheap side of the error: too short an M costs
checkpoints of milliseconds (asynchronous saves), too long a one costs the work an interruption throws away.
With checkpoint.hold_budget B (a share of the time in the training loop: TrainState.loop_s, steps, data waits,
reports and the holds themselves) the interval is instead the shortest whose holds stay within it, C / B seconds with C the mean hold (CheckFreq's rule): for a user who bounds the work an interruption loses rather
than its expectation, and the way to compare with a fixed interval at the same blocking cost.
The budget is an account over the whole run (train_state.json: the seconds checkpoints held the loop, every one
counted: periodic, a notice's, a resumed group's first, a lone worker's copies to the driver's memory): a deficit
pushes the next checkpoint back until it is repaid, a surplus is spent where checkpoints pay most. The account
may also spend ahead, up to BORROW_SHARE of what the rest of the run will earn (its steps left at the current
step time: the run's length is known), since where a checkpoint pays most comes when it comes (a node lost, the
run on one worker until its replacement joins) and the run's first minutes, its first checkpoint and a notice's
two, leave little earned by then; a half, because a run on fewer workers than it will have again steps slower
than it will, so that what it spends stays within the budget over the whole run.
Where they pay depends on whether a replica protects the run: under DDP with the rescue checkpoint
(checkpoints/rescue.py) and two or more workers, losing a worker without notice costs no step (a live peer
writes the state), so a periodic checkpoint guards only against what the rescue cannot cover (two workers lost
at once, a write longer than Ray Train's stop allows): while protected the interval is PROTECTED_STRETCH times
longer. With one worker left (an elastic run waiting for its replacement) nothing protects it: with a hold
budget it checkpoints DEGRADED_SPEEDUP times as often while the account has a surplus (what the protected time
saved). In the preemption storm the no-notice preemptions struck the one-worker group every time.
The interval in steps is those seconds over this run's seconds per step, at least 1 step and at most
MAX_INTERVAL_S of training, and never shorter than the last background write took: a checkpoint taken while
both earlier snapshots are still being written waits for the older (its hold is then the write's, not the
snapshot's: in the storm, intervals of 5 steps under writes of ~0.2 s held the loop 0.1-0.2 s each).

Every rank must checkpoint at the same step: rank 0 proposes the interval at each report, the report's
all-reduce hands every rank rank 0's number; each checkpoint sets the step of the next one in the train state
(so a resumed run keeps it), and a report whose interval is shorter brings it closer (after an interruption).
"""

from __future__ import annotations

import math
import statistics

from behemoth.config import JobConfig
from behemoth.storage.checkpoint import TrainState

FIRST_STEPS = 20  # auto's first checkpoint, before any hold is measured: this many steps in
MAX_INTERVAL_S = 3600.0  # the longest interval auto sets, in seconds of training (a lost driver costs at most that)
KEPT_HOLDS = 8  # the holds the median is taken over (the latest: a cache warmed, pinned buffers allocated)
PROTECTED_STRETCH = 8.0  # the interval's factor while a replica protects the run (above)
DEGRADED_SPEEDUP = 4.0  # with a hold budget in surplus, the interval's divisor while nothing protects it
RESCUE_FITS_S = 2.5  # a rescue protects only where a write takes less (Ray Train's stop gives the workers 5 s)
BORROW_SHARE = 0.5  # of what the rest of the run will earn, the share the account may spend ahead (above)


def young_daly_s(hold_s: float, interruption_every_s: float) -> float:
    """The checkpoint interval, in seconds of training, that loses least to checkpoints and interruptions."""
    return math.sqrt(2.0 * max(hold_s, 0.0) * interruption_every_s)


def expected_interruption_s(cfg: JobConfig, state: TrainState) -> float:
    """The mean training time between interruptions as this run knows it: what it met, or before any, the
    configured expectation (or its training time so far, where longer)."""
    if state.interruptions:
        return max(state.trained_s, 1e-3) / state.interruptions
    return max(cfg.checkpoint.interruption_every_s, state.trained_s)


class CheckpointInterval:
    """Whether a checkpoint is due at a step, and (auto) what rank 0 proposes the next interval to be."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.auto = cfg.checkpoint.every_n_steps == "auto"
        self.holds: list[float] = []
        self.said: float | None = None  # the interval the log last said, in seconds of training

    def due(self, state: TrainState, total_steps: int) -> bool:
        if state.step >= total_steps:
            return True
        if not self.auto:
            return state.step % self.cfg.checkpoint.every_n_steps == 0
        return state.step >= (state.next_checkpoint_at or FIRST_STEPS)

    def measured(self, hold_s: float | None, state: TrainState | None = None) -> None:
        """A checkpoint's hold on the loop (the saver's measure, reported after it), counted in `state`'s
        account."""
        if hold_s is not None:
            self.holds = (self.holds + [hold_s])[-KEPT_HOLDS:]
            if state is not None:
                state.held_s += hold_s
                state.hold_s = statistics.fmean(self.holds)

    def resumed(self, state: TrainState) -> None:
        """A group resumed from `state`: its last mean hold stands in until this group measures its own."""
        if not self.holds and state.hold_s > 0:
            self.holds = [state.hold_s]

    def seconds(self, state: TrainState, write_s: float | None = None, protected: bool = False,
                pending_s: float = 0.0, account: bool = True, ahead_s: float = 0.0) -> tuple[float, str]:
        """Rank 0's interval in seconds of training and why (after a hold is measured); `protected`: a replica
        protects the run (above); with a hold budget, `pending_s`: the hold of a checkpoint about to be taken
        (not yet in the account), `account`: the interval the account allows (else the rule's alone), and
        `ahead_s`: the training seconds the rest of the run is expected to take (what it may borrow against)."""
        hold = statistics.median(self.holds)
        budget = self.cfg.checkpoint.hold_budget
        if budget:  # as often as the budget allows (a share of the time: the mean hold, not the median)
            hold = statistics.fmean(self.holds)
            seconds = hold / budget
            why = (f"checkpoint.hold_budget {budget:g}: a checkpoint holds the loop {hold:.3f} s, "
                   f"{hold:.3f} / {budget:g} = {seconds:.1f} s")
        else:
            every = expected_interruption_s(self.cfg, state)
            seconds = young_daly_s(hold, every)
            why = (f"a checkpoint holds the loop {hold:.3f} s, an interruption expected every {every:.0f} s of "
                   f"training ({state.interruptions} met in {state.trained_s:.0f} s; checkpoint.interruption_every_s "
                   f"{self.cfg.checkpoint.interruption_every_s:g}); sqrt(2 x {hold:.3f} x {every:.0f}) = "
                   f"{seconds:.1f} s")
        if protected:
            seconds, why = seconds * PROTECTED_STRETCH, f"{why}, x {PROTECTED_STRETCH:g} while a replica protects"
        elif budget:
            seconds, why = (seconds / DEGRADED_SPEEDUP, f"{why} / {DEGRADED_SPEEDUP:g} with nothing to protect the "
                                                        f"run, while the account over the run has the budget for it")
        if budget and account:  # no sooner than the account has this checkpoint's hold (and a pending one's) earned
            earned = budget * (max(state.loop_s, state.trained_s) + BORROW_SHARE * max(ahead_s, 0.0))
            seconds = max(seconds, (hold + pending_s - (earned - state.held_s)) / budget)
        if seconds > MAX_INTERVAL_S:
            seconds, why = MAX_INTERVAL_S, f"{why}, at most {MAX_INTERVAL_S:.0f} s"
        if write_s and write_s > seconds:
            seconds, why = write_s, f"{why}, no closer than the last write took ({write_s:.2f} s)"
        return seconds, why

    def propose(self, state: TrainState, step_s: float, write_s: float | None = None, protected: bool = False,
                checkpointing: bool = False, steps_left: int = 0) -> int:
        """Rank 0's interval in steps (FIRST_STEPS until a hold is measured); `write_s`: how long the last
        background write took (the interval's floor); `checkpointing`: this step checkpoints (its hold is the
        account's too); `steps_left`: the run's steps after this one (what the account may borrow against)."""
        if not self.holds or step_s <= 0:
            return FIRST_STEPS
        pending = statistics.fmean(self.holds) if checkpointing else 0.0
        return max(1, round(self.seconds(state, write_s, protected, pending, ahead_s=steps_left * step_s)[0]
                            / step_s))

    def line(self, state: TrainState, step_s: float, write_s: float | None = None,
             protected: bool = False, steps_left: int = 0) -> str | None:
        """The log's line where the rule's interval (the account's wait left out: it moves at every report)
        moved by a fifth or more since it was last said (its steps follow the step time's noise)."""
        if not self.auto or not self.holds:
            return None
        seconds, why = self.seconds(state, write_s, protected, account=False)
        if self.said and abs(seconds - self.said) < 0.2 * self.said:
            return None
        self.said = seconds
        now = self.seconds(state, write_s, protected, ahead_s=steps_left * step_s)[0]
        if now > 1.01 * seconds:
            why = f"{why}; for now every {now:.1f} s, as the account over the run allows"
        steps = max(1, round(now / step_s)) if step_s > 0 else FIRST_STEPS
        return f"checkpoint every {steps} steps (checkpoint.every_n_steps auto: {why} at {step_s:.3f} s a step)"
