"""The rank's training batches, epoch after epoch, with the next epoch's input pipeline started before the
current epoch ends.

Each epoch has its own pipeline (the image task's is a Ray Dataset over the rank's samples in the epoch's
order): starting one costs seconds before its first batch (the execution plan, the first decode tasks, the
processes that run them), which the training steps would wait through at every epoch start. So, before an
epoch's end, a background thread builds the next epoch's pipeline and pulls its first micro-batches: its
start-up overlaps the last steps and the end-of-epoch evaluation. How far before: `LOOKAHEAD_STEPS`, or as many
steps as twice the last measured opening takes at the current step rate where that is more (a data-bound run
of 224-px JPEGs steps in ~0.1 s and opens an epoch in ~1-2 s), at most half an epoch; or as soon as the current
epoch's pipeline has opened its last part (a train_batches iterator with an `all_opened` event, such as the image
task's chain of decode windows), whichever comes first. The run's first
epoch is opened the same way right after the restore, so that rank 0's FLOP count overlaps its start-up. The
order is unchanged: the next epoch's samples depend only on (seed, epoch, rank, world size), as they do when it
is started at the boundary; a resume starts mid-epoch, as it would without the lookahead.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator

from behemoth.storage.checkpoint import TrainState
from behemoth.data.prefetch import OpenedAhead
from behemoth.data.order import rank_train_indices
from behemoth.tasks.parts import checked_batches

LOOKAHEAD_STEPS = 4  # these steps plus the end-of-epoch evaluation are what overlaps a pipeline's start-up


class EpochFeed:
    """`steps(state)`: lists of `accum` micro-batches, one per optimizer step, from the state's position to the
    end of its epoch. `ahead(state, total_steps)` after each step starts the next epoch early when due."""

    def __init__(self, task, cfg, rank: int, world: int, micro_batch: int, accum: int, epoch_steps: int):
        self.task, self.cfg, self.rank, self.world = task, cfg, rank, world
        self.micro_batch, self.accum, self.epoch_steps = micro_batch, accum, epoch_steps
        self._next: _Started | None = None
        self._open_s: float | None = None  # the last epoch opened in the background: seconds to its first step
        self._steps_timed: tuple[float, int] | None = None  # (time of this epoch's first step, steps since)
        self._all_opened: dict[int, object] = {}  # epoch -> its pipeline's all_opened event, where it has one

    def start(self, state: TrainState) -> None:
        """Open the state's epoch (from its position) in the background: the set-up before the first step
        (the FLOP count) overlaps the pipeline's start-up."""
        epoch, start_step = state.epoch, state.step_in_epoch
        self._next = _Started(epoch, start_step, lambda: self._open(epoch, start_step))

    def steps(self, state: TrainState) -> Iterator[list]:
        started = self._next
        if started is not None and (started.epoch, started.start_step) == (state.epoch, state.step_in_epoch):
            self._next = None
            return started.iterator(self._opened)
        return self._open(state.epoch, state.step_in_epoch)

    def ahead(self, state: TrainState, total_steps: int) -> None:
        self._time_step(state)
        left = self.epoch_steps - state.step_in_epoch
        next_epoch_starts_at = state.step + left
        due = left <= self._lead_steps() or self._all_opened_in(state.epoch)
        if self._next is None and 0 < left and due and next_epoch_starts_at < total_steps:
            epoch = state.epoch + 1  # bound now: the state moves on while the thread starts
            self._next = _Started(epoch, 0, lambda: self._open(epoch, 0))

    def _time_step(self, state: TrainState) -> None:
        """Count a step: the mean step time is taken over the epoch so far (a data-bound run's steps alternate
        between batches waiting and batches waited for)."""
        if self._steps_timed is None or state.step_in_epoch <= 1:
            self._steps_timed = (time.monotonic(), 0)
        else:
            self._steps_timed = (self._steps_timed[0], self._steps_timed[1] + 1)

    def _lead_steps(self) -> int:
        """How many steps before an epoch's end the next one is opened."""
        began, steps = self._steps_timed or (0.0, 0)
        if not (self._open_s and steps):
            return LOOKAHEAD_STEPS
        step_s = (time.monotonic() - began) / steps
        return max(LOOKAHEAD_STEPS, min(math.ceil(2 * self._open_s / step_s), self.epoch_steps // 2))

    def _all_opened_in(self, epoch: int) -> bool:
        """Whether the epoch's pipeline has opened all of its parts (the image task's chain of decode windows,
        data/prefetch.Chain): the next epoch's tasks then queue behind its last ones, as a next window's would.
        Waiting for the last steps instead leaves CPUs idle: Ray Data yields a block only once the next is done,
        so the last steps arrive when every decode task of the epoch has ended."""
        for old in [e for e in list(self._all_opened) if e < epoch]:  # (the opening thread adds to it)
            del self._all_opened[old]
        event = self._all_opened.get(epoch)
        return event is not None and event.is_set()

    def _opened(self, seconds: float) -> None:
        self._open_s = seconds

    def _open(self, epoch: int, start_step: int) -> Iterator[list]:
        indices = rank_train_indices(self.task.num_train_samples, self.cfg.train.global_batch_size,
                                     self.cfg.train.seed, epoch, self.rank, self.world, start_step=start_step)
        batches = self.task.train_batches(indices, epoch, self.micro_batch)
        self._all_opened[epoch] = getattr(batches, "all_opened", None)
        return _grouped(checked_batches(batches, self.task, "train_batches"), self.accum)


class _Started:
    """An epoch's step iterator opened in a daemon thread that also pulls its first step's batches."""

    def __init__(self, epoch: int, start_step: int, open_fn: Callable[[], Iterator]):
        self.epoch, self.start_step = epoch, start_step
        self._ahead = OpenedAhead(open_fn, name=f"behemoth-epoch-{epoch}")

    def iterator(self, opened: Callable[[float], None] = lambda seconds: None) -> Iterator[list]:
        """The epoch's steps; `opened` is told how long the opening took (the time to its first step)."""
        steps = self._ahead.iterator()
        first = next(steps, None)  # waits for the thread; raises its error here
        opened(self._ahead.seconds)
        if first is not None:
            yield first
            yield from steps


def _grouped(iterable: Iterable, n: int) -> Iterator[list]:
    """Lists of n consecutive items (the micro-batches of one optimizer step); a short tail is dropped."""
    it = iter(iterable)
    try:
        while len(group := list(itertools.islice(it, n))) == n:
            yield group
    finally:
        if hasattr(it, "close"):  # an epoch left early: its pipeline (a prefetch thread) stops now, not at GC
            it.close()
