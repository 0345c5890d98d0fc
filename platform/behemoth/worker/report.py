"""Worker side: what happens at a report step, and when: metrics every train.log_every steps, evaluation and
checkpoints when due (small policies below, functions of the step counter alone, so every rank decides alike)."""

from __future__ import annotations

import time

import torch

from behemoth.checkpoint import TrainState
from behemoth.config import JobConfig
from behemoth.errors import BadSampleError
from behemoth.metrics import PhaseClock, Window, data_wait_fraction, progress_line, throughput
from behemoth.tasks import Task
from behemoth import worker_context as context
from behemoth.worker.collectives import all_reduce_sum, sync_buffers, union_across_ranks
from behemoth.worker.console import console
from behemoth.worker.evaluate import evaluate
from behemoth.worker.run import Run
from behemoth.worker.saver import CheckpointSaver, send_report
from behemoth.worker.speed import SpeedMeter


def evaluate_due(cfg: JobConfig, state: TrainState, total_steps: int) -> bool:
    every = cfg.eval.every_n_steps
    return (state.step >= total_steps or (cfg.eval.per_epoch and state.step_in_epoch == 0)
            or bool(every and state.step % every == 0))


def checkpoint_due(cfg: JobConfig, state: TrainState, total_steps: int) -> bool:
    return state.step >= total_steps or state.step % cfg.checkpoint.every_n_steps == 0


def report_due(cfg: JobConfig, state: TrainState, total_steps: int) -> bool:
    return (state.step % cfg.train.log_every == 0 or evaluate_due(cfg, state, total_steps)
            or checkpoint_due(cfg, state, total_steps))


class Reporter:
    """Builds and sends a step's report: training metrics over the window since the last report (summed over
    the ranks), speed, evaluation and a checkpoint when due; rank 0 prints the progress line."""

    def __init__(self, cfg: JobConfig, task: Task, run: Run, speed: SpeedMeter, saver: CheckpointSaver,
                 micro_batch: int, total_steps: int, epoch_steps: int, clock: PhaseClock,
                 resumed_from_step: int = 0):
        ctx = context.current()
        self.cfg, self.task, self.run, self.speed, self.saver = cfg, task, run, speed, saver
        self.rank, self.world = ctx.rank, ctx.world
        self.micro_batch, self.total_steps, self.epoch_steps = micro_batch, total_steps, epoch_steps
        self.clock, self.resumed_from_step = clock, resumed_from_step

    def report(self, state: TrainState, window: Window, bad_ids: set) -> None:
        started, clock = time.perf_counter(), self.clock.snapshot()  # the phases up to this report
        report = {**self.train_metrics(state, window, bad_ids), **clock,
                  "resumed_from_step": self.resumed_from_step}
        report.update(self.speed.metrics(report["samples_per_s"]))
        if self.saver.last_block_s is not None:
            report["checkpoint_block_s"] = self.saver.last_block_s
        evaluate_now = evaluate_due(self.cfg, state, self.total_steps)
        checkpoint_now = checkpoint_due(self.cfg, state, self.total_steps)
        if evaluate_now or checkpoint_now:
            sync_buffers(self.run.model)
        eval_s = checkpoint_s = 0.0
        if evaluate_now:
            t0 = time.perf_counter()
            report.update(self.evaluate())
            eval_s = time.perf_counter() - t0
            report["eval_s"] = eval_s
        if self.rank == 0:
            console(progress_line(report, self.total_steps, self.cfg.train.epochs, self.task.progress_fields(report)))
        if checkpoint_now:
            t0 = time.perf_counter()
            self.saver.save_and_report(report, state, self.run)
            checkpoint_s = time.perf_counter() - t0
        else:
            send_report(report)
        self.clock.add("eval", eval_s)
        self.clock.add("checkpoint", checkpoint_s)
        self.clock.add("report", time.perf_counter() - started - eval_s - checkpoint_s)

    def evaluate(self) -> dict:
        return evaluate(self.run.model, self.task, self.rank, self.world, self.micro_batch)

    def completed_run(self, state: TrainState) -> None:
        """A rerun of a finished run: evaluate its final weights, train nothing."""
        if self.rank == 0:
            console(f"run already complete at step {state.step}: nothing to train")
        send_report({"step": state.step, "epoch": state.step / self.epoch_steps,
                       "samples_seen": state.samples_seen, **self.clock.snapshot(),
                       "resumed_from_step": self.resumed_from_step, **self.evaluate()})

    def train_metrics(self, state: TrainState, window: Window, bad_ids: set) -> dict:
        cfg = self.cfg
        stats = torch.tensor([float(window.loss_sum), float(window.loss_count)], dtype=torch.float64,
                             device=context.device())
        all_reduce_sum(stats)
        bad = union_across_ranks(bad_ids)
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
            "loss": stats[0].item() / max(stats[1].item(), 1.0),
            "lr": self.run.scheduler.get_last_lr()[0],
            "samples_per_s": samples_per_s,
            "data_wait_frac": data_wait_fraction(window.data_wait_s, elapsed),
            "eta_s": (self.total_steps - state.step) * cfg.train.global_batch_size / max(samples_per_s, 1e-9),
            "samples_seen": state.samples_seen,
            "bad_samples": len(bad),
            "world_size": state.world_size,
        }
        if self.task.tokens_per_sample:
            metrics["tokens_per_s"] = samples_per_s * self.task.tokens_per_sample
        return metrics
