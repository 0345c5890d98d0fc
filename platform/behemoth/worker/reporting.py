"""Worker side: what happens at a report step, and when: metrics every train.log_every steps, evaluation and
checkpoints when due (small policies below, functions of the step counter alone, so every rank decides alike),
and how a report reaches the host without holding the step (worker/report_sender.py)."""

from __future__ import annotations

import math
import time

import torch

from behemoth.storage.checkpoint import TrainState
from behemoth.config import JobConfig
from behemoth.errors import BadSampleError, NonFiniteError, PreemptionExit
from behemoth.metrics import (CHECKPOINT_SCORE, Window, checkpoint_score, data_wait_fraction,
                              progress_line, throughput)
from behemoth.tasks import run_metric
from behemoth import hosts
from behemoth.hosts.collectives import all_reduce_sum, union_across_ranks
from behemoth.worker.parallel import sync_buffers
from behemoth.hosts.console import console
from behemoth.worker.evaluate import evaluate
from behemoth.checkpoints import send_report, why_no_rescue
from behemoth.worker.checkpoint_interval import FIRST_STEPS, RESCUE_FITS_S, CheckpointInterval
from behemoth.worker.early_stopping import early_stop
from behemoth.worker.report_sender import ReportSender
from behemoth.worker.step_context import StepContext


def evaluate_due(cfg: JobConfig, state: TrainState, total_steps: int) -> bool:
    every = cfg.eval.every_n_steps
    return (state.step >= total_steps or (cfg.eval.per_epoch and state.step_in_epoch == 0)
            or bool(every and state.step % every == 0))


def report_due(cfg: JobConfig, state: TrainState, total_steps: int, interval: CheckpointInterval) -> bool:
    return (state.step % cfg.train.log_every == 0 or evaluate_due(cfg, state, total_steps)
            or interval.due(state, total_steps))


# The fewest seconds between two reports handed to Ray Train (where its host takes them by polling): each costs
# the reporting thread a few milliseconds of Python (an actor call for the ranks' barrier, the queue), which the
# training thread's own Python then waits for (one GIL). At the controller's 0.2 s poll that was ~3 % of a
# 23 ms CPU step; at 1 s, ~1 % (BENCHMARKS.md, "P1 at the fast shape"). Evaluations go at once.
REPORT_EVERY_S = 1.0
# A preemption notice: the loop checkpoints at once (in the foreground: the node may go early; its duration is
# measured; not where a replica protects the run: UNMEASURED_WRITE_S below) and trains on; its last checkpoint is taken when the deadline is as close as that duration x
# FINAL_WRITE_FACTOR, two report periods and NOTICE_SAFETY_S. The group then waits for the node to go: Ray Train
# ends it failure.preemption_grace_s after the deadline, so that the group it starts next is placed on the nodes
# left (a node still going counts as room for workers: a group started at the deadline waited for it); where that
# does not happen, the group ends itself then (PreemptionExit, charged to failure.max_preemptions). No step
# trained in the notice is lost, and none waits but the last write's margin and the grace: a deadline far ahead
# (a year: a wrong clock) only moves the last checkpoint that far.
FINAL_WRITE_FACTOR = 1.5
NOTICE_SAFETY_S = 1.0
RECLAIM_POLL_S = 0.5  # how often a group held after a notice's last checkpoint asks whether the node is gone
# Where a replica protects the run (checkpoint.every_n_steps auto: the rescue, a lone worker's memory copies) the
# notice's first checkpoint is left out: a node gone before the deadline is rescued like one lost without notice.
# The last one is then spaced by the last background write's time, or this where none was measured yet.
UNMEASURED_WRITE_S = 1.0


def run_epochs(epochs: int, total_steps: int, epoch_steps: int) -> float:
    """The epochs the run trains: train.epochs, or fewer where train.max_steps ends it first."""
    return min(float(epochs), total_steps / max(epoch_steps, 1))


class Reporter:
    """Builds and sends a step's report: training metrics over the window since the last report (summed over
    the ranks), speed, evaluation and a checkpoint when due; rank 0 prints the progress line."""

    def __init__(self, ctx: StepContext):
        self.cfg, self.task, self.run = ctx.cfg, ctx.task, ctx.trainables
        self.speed, self.saver = ctx.speed, ctx.saver
        self.rank, self.world = ctx.rank, ctx.world
        self.micro_batch, self.total_steps, self.epoch_steps = ctx.micro_batch, ctx.total_steps, ctx.epoch_steps
        self.clock, self.resumed_from_step = ctx.clock, ctx.resumed_from_step
        interval = hosts.current().report_interval_s
        self.sender = ReportSender(max(interval, REPORT_EVERY_S) if interval > 0 else 0.0)
        self.interval = CheckpointInterval(self.cfg)  # checkpoint.every_n_steps (auto: as often as they pay)
        # whether any rank's loss would be rescued by a live one (rank 1's case: rank 0's rescues it)
        self.rescuable = self.interval.auto and self.world > 1 and why_no_rescue(self.cfg, self.run, 1) is None
        # a preemption notice (the host's: a spot node about to be reclaimed): its deadline (inf: none given),
        # and how long the checkpoint it called for at once took (None: not written yet)
        self.notice: float | None = None
        self.notice_write_s: float | None = None
        self._checkpoint_began: float | None = None  # the clock's checkpoint time when the last checkpoint began
        self.copies_protect = False  # a lone worker's copies to the driver's memory protect it (memory_copies.py)
        self.step_s, self._step_total = 0.0, 0.0  # the steps' own time, per step, over the last window

    def due(self, state: TrainState) -> bool:
        """Whether this step reports (a log step, an evaluation or a checkpoint)."""
        return report_due(self.cfg, state, self.total_steps, self.interval)

    def report(self, state: TrainState, window: Window, bad_ids: set) -> None:
        started, clock = time.perf_counter(), self.clock.snapshot()  # the phases up to this report
        self._measure_holds(state, window)
        evaluate_now = evaluate_due(self.cfg, state, self.total_steps)
        checkpoint_now = self.interval.due(state, self.total_steps)
        metrics, send_now, agreed = self.train_metrics(state, window, bad_ids)
        report = {**metrics, **clock, "resumed_from_step": self.resumed_from_step}
        first_notice = self.notice is not None and self.notice_write_s is None
        ending = agreed["final"] or (first_notice and self.notice == math.inf)  # (no deadline: the group ends now)
        if first_notice and not ending and agreed["protected"]:
            # a replica protects the run (rank 0's word): a node gone before the deadline is rescued by a live
            # worker (or resumed from the lone worker's copy), so the notice's one checkpoint is its last, before
            # the deadline, spaced by the last background write's time
            self.notice_write_s = self.saver.write_s() or UNMEASURED_WRITE_S
            self._say_notice(state, first_notice, ending, protected=True)
            first_notice = False
        if first_notice or agreed["final"]:
            checkpoint_now, report["preemption_checkpoint"] = True, True
            self._say_notice(state, first_notice, ending)
        report.update(self.speed.metrics(report["samples_per_s"]))
        report.update(self.saver.block_metrics())
        if evaluate_now or checkpoint_now:
            sync_buffers(self.run.model)
            if self.run.ema is not None:  # (its BatchNorm statistics average each rank's own)
                sync_buffers(self.run.ema.module)
        eval_s = checkpoint_s = 0.0
        if evaluate_now:
            eval_s, stops = self._evaluated(state, report)
            checkpoint_now = checkpoint_now or stops  # (a stop's last checkpoint holds the decision)
        if self.rank == 0:
            console(progress_line(report, self.total_steps, run_epochs(self.cfg.train.epochs, self.total_steps,
                                                                       self.epoch_steps),
                                  self.task.progress_fields(report)))
        if self.interval.auto:  # the agreed interval: from this checkpoint, or sooner than planned where it shrank
            state.next_checkpoint_at = state.step + agreed["interval"] if checkpoint_now else \
                min(state.next_checkpoint_at or FIRST_STEPS, state.step + agreed["interval"])
        if checkpoint_now:
            t0, self._checkpoint_began = time.perf_counter(), self.clock.totals["checkpoint"]
            # retention ranks checkpoints by the run's metric (the latest is kept too): this one's, where evaluated
            metric, order = run_metric(self.task, self.cfg)
            report[CHECKPOINT_SCORE] = checkpoint_score(report.get(metric), order)
            self.sender.attach_pending(report)  # (and the reports before it reach the host first: the saver)
            state.ended_on_notice = ending  # (kept in this checkpoint only: the run resumes from it losing nothing)
            self.saver.save_and_report(report, state, self.run, sync=first_notice or ending, sender=self.sender)
            state.ended_on_notice = False
            self.sender.after_checkpoint = True
            checkpoint_s = time.perf_counter() - t0
            if first_notice:
                self.notice_write_s = checkpoint_s
        else:
            # an evaluation's report goes at once (a sweep's scheduler decides on it)
            self.sender.send(report, now=send_now or evaluate_now)
        self.clock.add("eval", eval_s)
        self.clock.add("checkpoint", checkpoint_s)
        self.clock.add("report", time.perf_counter() - started - eval_s - checkpoint_s)
        self._after(state, agreed, ending)

    def _evaluated(self, state: TrainState, report: dict) -> tuple[float, bool]:
        """The evaluation into `report`: (its seconds, whether train.early_stopping ends the run here)."""
        t0 = time.perf_counter()
        report.update(self.evaluate())
        report["eval_s"] = eval_s = time.perf_counter() - t0
        if not (self.cfg.train.early_stopping and early_stop(self.cfg, self.task, state, report, self.total_steps)):
            return eval_s, False
        if self.rank == 0:
            rule = self.cfg.train.early_stopping
            console(f"early stop at step {state.step}: {state.early_stopping_metric} has not improved on "
                    f"{state.best_metric:.4g} by more than {rule.min_delta:g} for {rule.patience} evaluations "
                    f"(train.early_stopping)")
        return eval_s, True

    def _after(self, state: TrainState, agreed: dict, ending: bool) -> None:
        """The interval's line where it moved; after a notice's last checkpoint, the group's end."""
        line = (self.interval.line(state, agreed["step_s"], self.saver.write_s(), self.protected(),
                                   self.total_steps - state.step) if self.rank == 0 else None)
        if line:
            console(line)
        if ending:
            # held until the node is gone (else the next group is sized with it, still alive while it drains, and
            # waits out its placement timeout), at most to the deadline and its grace (inf: it ends now)
            # (every RECLAIM_POLL_S: each live rank reads Ray's node table, a call to its control store)
            until = self.notice + self.cfg.failure.preemption_grace_s + NOTICE_SAFETY_S
            while self.notice != math.inf and time.time() < until:
                if self._reclaimed():
                    console(f"rank {self.rank}: the preempted node is gone "
                            f"{time.time() - self.notice:+.1f} s from its deadline: the worker group ends now")
                    break
                time.sleep(min(RECLAIM_POLL_S, max(until - time.time(), 0.0)))
            raise PreemptionExit(f"the worker group ends for a preemption, its last checkpoint at step {state.step} "
                                 f"written before the node's deadline; the run goes on from it")

    def protected(self) -> bool:
        """Whether a replica protects the run now (checkpoint_interval.py): a worker lost without notice would be
        rescued by a live one, whose write fits the time Ray Train gives it (the last periodic write's), or a
        lone worker's state is copied to the driver's memory."""
        return self.copies_protect or (self.rescuable and (self.saver.write_s() or 0.0) < RESCUE_FITS_S)

    def copied(self, held_s: float) -> None:
        """A memory copy held the loop `held_s` (in the clock's checkpoint time): not part of the hold of a
        checkpoint on disk being measured."""
        if self._checkpoint_began is not None:
            self._checkpoint_began += held_s

    def _reclaimed(self) -> bool:
        try:
            return hosts.current().reclaimed()
        except Exception:  # noqa: BLE001  (a node table not read: the hold goes on, to the deadline at most)
            return False

    def _measure_holds(self, state: TrainState, window: Window) -> None:
        """What the last checkpoint held the loop (checkpoint.every_n_steps auto's C): the clock's checkpoint time
        since it began (its report's wait for the reports before it and for an earlier write still going, its
        snapshot, and the next update's wait for the snapshot's copy; on a worker training on its CPU, plus the
        CPU seconds of the latest background write, which the step's cores gave up: at a checkpoint every 20 steps
        those slowed the storm's 1-CPU workers by ~12 %), and the steps' own time since the last report (its step
        time: reports and checkpoints left out)."""
        totals = self.clock.totals
        if self._checkpoint_began is not None:
            held = totals["checkpoint"] - self._checkpoint_began
            if hosts.device().type == "cpu":  # a background write's CPU seconds came out of training's cores
                held += self.saver.write_cpu_s() or 0.0
            self.interval.measured(held, state)
            self._checkpoint_began = None
        self.step_s = (totals["step"] - self._step_total) / max(window.steps, 1)
        self._step_total = totals["step"]

    def _say_notice(self, state: TrainState, first: bool, ending: bool, protected: bool = False) -> None:
        if self.rank != 0:
            return
        if protected:
            console(f"preemption notice (a node of this worker group is reclaimed in "
                    f"{self.notice - time.time():.0f} s): training on; a replica protects the run until then, so "
                    f"its one checkpoint is the last, just before the deadline")
        elif first and self.notice == math.inf:
            console(f"preemption notice with no deadline: checkpoint at step {state.step}, then the worker group "
                    f"ends and the run goes on from it on the nodes it gets")
        elif first:
            console(f"preemption notice (a node of this worker group is reclaimed in "
                    f"{self.notice - time.time():.0f} s): checkpoint at step {state.step} now, training on; the last "
                    f"one just before the deadline, then the run goes on from it on the nodes it gets")
        else:
            console(f"preemption deadline in {self.notice - time.time():.1f} s: last checkpoint at step {state.step}")

    def final_margin_s(self, step_s: float) -> float:
        """How close to the notice's deadline the last checkpoint is taken (see FINAL_WRITE_FACTOR)."""
        return FINAL_WRITE_FACTOR * (self.notice_write_s or 0.0) + 2 * self.cfg.train.log_every * step_s + NOTICE_SAFETY_S

    def evaluate(self) -> dict:
        return evaluate(self.run.evaluated(), self.task, self.rank, self.world, self.micro_batch)

    def completed_run(self, state: TrainState) -> None:
        """A rerun of a finished run: evaluate its final weights, train nothing."""
        if self.rank == 0 and state.stopped_early_at is not None:
            console(f"run stopped early at step {state.step}: {state.early_stopping_metric or 'its metric'} did "
                    f"not improve on {state.best_metric} for {state.evals_without_improvement} evaluations "
                    f"(train.early_stopping): nothing to train. To train on from here: --set "
                    f"train.early_stopping=null, or a train.early_stopping.patience above "
                    f"{state.evals_without_improvement}")
        elif self.rank == 0:
            console(f"run already complete at step {state.step}: nothing to train")
        self.sender.flush()
        send_report({"step": state.step, "epoch": state.step / self.epoch_steps,
                       "samples_seen": state.samples_seen, **self.clock.snapshot(),
                       "resumed_from_step": self.resumed_from_step, **self.evaluate()})

    def train_metrics(self, state: TrainState, window: Window, bad_ids: set) -> tuple[dict, bool]:
        """(the window's metrics, summed over the ranks; whether this report is sent now: rank 0's vote)."""
        cfg = self.cfg
        bad_ids.update(window.bad_sample_ids())
        norm, nonfinite, first_bad = window.grad_norm_stats()
        # one all-reduce: the loss, the samples, whether any rank dropped samples, rank 0's vote to send, and
        # the non-finite steps (the same on every rank: the norm is of the reduced gradients)
        deadline = hosts.current().preemption_deadline()
        step_s = self.step_s or window.elapsed() / max(window.steps, 1)
        # rank 0's: the checkpoint interval it proposes (auto), and whether the notice's last checkpoint is due
        if self.rank == 0 and self.interval.auto:
            self.interval.resumed(state)
            proposed = self.interval.propose(state, step_s, self.saver.write_s(), self.protected(),
                                             checkpointing=self.interval.due(state, self.total_steps),
                                             steps_left=self.total_steps - state.step)
        else:
            proposed = 0
        final = (self.rank == 0 and self.notice not in (None, math.inf) and self.notice_write_s is not None
                 and self.notice - time.time() <= self.final_margin_s(step_s))
        stats, task_sums = self._reduced([float(window.loss_sum), float(window.loss_count), float(len(bad_ids)),
                                          float(self.rank == 0 and self.sender.due()), float(nonfinite),
                                          float(deadline is not None), float(proposed), float(final),
                                          deadline if deadline is not None else 0.0,
                                          float(self.rank == 0 and self.interval.auto and self.protected())])
        self.nonfinite_guard(state, window, stats[0], stats[4], first_bad)
        if stats[5] > 0 and self.notice is None:  # any rank's notice (Ray Train tells every worker of the group,
            # each when its own watcher call returns): the deadline of the ranks that have it, the same on every
            # rank (a rank without it yet took "no deadline" and ended the group alone while the others trained on)
            self.notice = stats[8] / stats[5]
        bad = union_across_ranks(bad_ids) if stats[2] else set()  # (a gather of Python objects: only if any)
        if len(bad) > cfg.data.max_bad_samples:
            names = self.task.describe_samples(list(bad)[:20])
            raise BadSampleError(f"{len(bad)} {self.task.bad_samples_are} exceed data.max_bad_samples="
                                 f"{cfg.data.max_bad_samples}: {names}")
        elapsed = window.elapsed()
        samples_per_s = throughput(window.steps * cfg.train.global_batch_size, elapsed)
        metrics = {
            "step": state.step,
            "total_steps": self.total_steps,
            "epoch": state.step / self.epoch_steps,
            "loss": stats[0] / max(stats[1], 1.0),
            "lr": self._lr_of_step(state.step),
            "samples_per_s": samples_per_s,
            "data_wait_frac": data_wait_fraction(window.data_wait_s, elapsed),
            "eta_s": (self.total_steps - state.step) * cfg.train.global_batch_size / max(samples_per_s, 1e-9),
            "samples_seen": state.samples_seen,
            "bad_samples": len(bad),
            "world_size": state.world_size,
        }
        if self.task.tokens_per_sample:
            metrics["tokens_per_s"] = samples_per_s * self.task.tokens_per_sample
        if task_sums:
            metrics.update(self.task.window_metrics(task_sums))
        if norm is not None:
            metrics["grad_norm"] = norm
        if state.skipped_steps:
            metrics["skipped_steps"] = state.skipped_steps
        if self.interval.auto:
            metrics["checkpoint_interval_steps"] = int(stats[6])
        return metrics, bool(stats[3]), {"interval": int(stats[6]), "final": stats[7] > 0, "step_s": step_s,
                                         "protected": stats[9] > 0}

    def _lr_of_step(self, step: int) -> float:
        """The learning rate step `step` (1-based: the report's last) trained with; the scheduler has already
        moved on to the next step's (get_last_lr), which was reported before: a step high in warm-up, min_lr at
        the end."""
        scheduler = self.run.scheduler
        return scheduler.base_lrs[0] * scheduler.lr_lambdas[0](max(step - 1, 0))

    def _reduced(self, stats: list[float]) -> tuple[list[float], dict[str, float]]:
        """`stats` summed over the ranks in one all-reduce, with the task's own window sums (by their names)
        riding on it."""
        names = self.task.window_sum_names
        vector = torch.tensor(stats, dtype=torch.float64).to(hosts.device())
        if names:
            vector = torch.cat([vector, self.task.take_window_sums().to(vector)])
        all_reduce_sum(vector)
        out = vector.tolist()
        return out[:len(stats)], dict(zip(names, out[len(stats):]))

    def nonfinite_guard(self, state: TrainState, window: Window, loss_sum: float, nonfinite: float,
                        first_bad: int | None) -> None:
        """train.nonfinite: a window with a non-finite gradient norm or loss stops the run here (before this
        report's checkpoint, if any: the last good one stays the latest) under stop; under skip (and fp16's
        overflows, which its scaler skipped) the skipped steps are counted in the train state."""
        first_step = state.step - window.steps + 1
        scaler_skips = self.run.scaler.is_enabled()
        if nonfinite and (self.cfg.train.nonfinite == "skip" or scaler_skips):
            state.skipped_steps += round(nonfinite / self.world)
        elif nonfinite:
            at = first_step + (first_bad or 0)
            raise NonFiniteError(f"step {at}: the gradient norm is not finite (NaN or Inf): the run stops "
                                 f"(train.nonfinite: stop); its checkpoints before step {at} are kept. Lower "
                                 f"train.lr, set train.grad_clip, check the data, or skip such steps with "
                                 f"train.nonfinite: skip")
        if not math.isfinite(loss_sum):
            raise NonFiniteError(f"steps {first_step}-{state.step}: the loss is not finite (NaN or Inf): the run "
                                 f"stops; its checkpoints before step {first_step} are kept. Lower train.lr, check "
                                 f"the data, or train in bf16 or fp32 rather than fp16")
