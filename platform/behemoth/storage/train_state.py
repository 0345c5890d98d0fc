"""The loop's position in a run, which every checkpoint keeps as train_state.json (storage/checkpoint.py): the
step, the epoch and the samples trained, and what early stopping and checkpoint.every_n_steps auto count."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done in the whole run
    epoch: int = 0  # the epoch in progress
    step_in_epoch: int = 0  # optimizer steps done in that epoch
    samples_seen: int = 0  # global samples trained on in the whole run
    world_size: int = 1  # workers when the checkpoint was written (elastic runs log a change)
    skipped_steps: int = 0  # steps whose update was skipped: a non-finite gradient norm (train.nonfinite: skip)
    # train.early_stopping: the best value of its metric so far, evaluations since it improved, and the step the
    # run stopped at (None: it has not stopped); the metric counted (None: a checkpoint from before it was kept)
    best_metric: float | None = None
    evals_without_improvement: int = 0
    stopped_early_at: int | None = None
    early_stopping_metric: str | None = None
    # checkpoint.every_n_steps: auto (worker/checkpoint_interval.py): the step of the next checkpoint (0: none
    # agreed yet), the times the run resumed from a checkpoint and lost work (its interruptions), its training
    # seconds, and whether the group ended on this checkpoint (a notice's last, or a rescue: checkpoints/rescue.py):
    # resuming loses nothing
    next_checkpoint_at: int = 0
    interruptions: int = 0
    trained_s: float = 0.0
    ended_on_notice: bool = False
    # and its account of checkpoint.hold_budget: the seconds checkpoints held the loop in the whole run (rank 0's
    # measure), and the last mean hold (a resumed group's first interval: no 20-step checkpoint per restart); the
    # wall seconds in the training loop, what the budget is a share of (steps, data waits, reports, evaluations,
    # checkpoints' holds: from one step's end to the next's; 0 in a checkpoint from before it was kept)
    held_s: float = 0.0
    hold_s: float = 0.0
    loop_s: float = 0.0

    def last_step(self, total_steps: int) -> int:
        """The step the run ends at: its last, or the one early stopping stopped it at."""
        return total_steps if self.stopped_early_at is None else min(self.stopped_early_at, total_steps)

    def advance(self, epoch_steps: int, global_batch: int, seconds: float = 0.0, wall_s: float = 0.0) -> None:
        """One optimizer step done (in `seconds` of training, `wall_s` in the loop since the step before ended);
        an epoch's last step moves to the next epoch's step 0."""
        self.step += 1
        self.trained_s += seconds
        self.loop_s += wall_s
        self.step_in_epoch += 1
        self.samples_seen += global_batch
        if self.step_in_epoch == epoch_steps:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
