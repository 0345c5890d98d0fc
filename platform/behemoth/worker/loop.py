"""Worker side: the function Ray Train runs on every worker. Reads top to bottom like a one-file script:
config -> task (data + model + loss) -> DDP/FSDP -> optimizer -> restore -> loop (step, report, evaluate,
checkpoint).

What differs between workloads lives in behemoth.tasks; this file is the same for all of them. The rest of
the worker room: step_context (what every step is taken with), step_callbacks (what runs around each step: the
weight average, the sample ledger, a lone worker's memory copies, the fault hooks, the profiler), plan
(micro-batch x accumulation), feed (the steps' batches, each epoch's pipeline opened ahead), speed (TFLOP/s,
MFU), reporting (what a report step does, and when), checkpoint_interval (when a checkpoint is due), ledger (the
audit trail of samples), evaluate, parallel (DDP, FSDP, compression, compile), precision, optim. Saving and
restoring are the checkpoints room's (behemoth.checkpoints: the saver, restore_latest, the rescue); the
collectives are the host's (hosts/collectives.py).

It never imports ray.tune. Everything that decides *when* something happens (report, evaluate, checkpoint)
depends only on the step counter, which is identical on every rank: all ranks call the collective
operations (all-reduce, the report) the same number of times. Its host (Ray Train's worker, or a sweep's warm
lane) is reached only through hosts/.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch

from behemoth.storage.checkpoint import TrainState
from behemoth.config import JobConfig
from behemoth.errors import ConfigError
from behemoth.data.order import steps_per_epoch
from behemoth.metrics import PhaseClock, Window
from behemoth.tasks import Task, make_task
from behemoth import hosts
from behemoth.worker import parallel
from behemoth.hosts.collectives import all_reduce_sum, distributed
from behemoth.hosts.console import console
from behemoth.hosts.state_keeper import KeeperLink
from behemoth.worker.ema import WeightAverage
from behemoth.worker.fault_hooks import FaultHooks
from behemoth.worker.feed import EpochFeed
from behemoth.worker.ledger import SampleLedger
from behemoth.worker.memory_copies import MemoryCopies
from behemoth.worker.optim import build_optimizer, lr_schedule
from behemoth.worker.plan import batch_plan
from behemoth.worker.profiling import StepProfiler
from behemoth.worker.precision import autocast, device_settings, grad_scaler, master_weights
from behemoth.worker.early_stopping import resume_early_stopping
from behemoth.worker.reporting import Reporter
from behemoth.checkpoints import CheckpointSaver, Rescue, Trainables, load_init_from, restore_latest
from behemoth.worker.speed import SpeedMeter
from behemoth.worker.step_callbacks import Callbacks, callback_classes
from behemoth.worker.step_context import StepContext


def train_loop_per_worker(loop_config: dict) -> dict:
    clock = PhaseClock()  # where this worker group's time goes (the goodput account reads it from the reports)
    cfg: JobConfig = loop_config["job"]  # typed: checked once, on the driver (each process unpickles it)
    ctx = hosts.current()
    ctx.quiet_console()
    prepared = ctx.prepared_data(loop_config)
    task: Task = make_task(cfg, prepared)
    clock.mark("task_ready")
    rank, world, device = ctx.rank, ctx.world, ctx.device
    epoch_steps, total_steps = _steps(cfg, task)
    run, speed, micro_batch, accum, init_line = _build_run(cfg, task, clock, rank, world, device, total_steps,
                                                           epoch_steps)

    # Resume: the latest good checkpoint restores weights, optimizer, schedule, scaler, compression, data position.
    # (and a lone worker's newer copy in the driver's memory: checkpoint.memory_copy)
    copies = KeeperLink(loop_config["keeper"]) if loop_config.get("keeper") is not None else None
    state = restore_latest(run, loop_config.get("fence"), copies) or TrainState(world_size=world)
    early_line = resume_early_stopping(cfg, task, state)  # a rerun's early stopping: trains on, or counts anew
    feed = EpochFeed(task, cfg, rank, world, micro_batch, accum, epoch_steps)
    if state.step < state.last_step(total_steps):
        feed.start(state)  # the first epoch's pipeline starts in the background (and the next ones early)
    if rank == 0 and speed.flops_per_sample is None:
        speed.count(task, parallel.unwrap(run.model))  # ... while rank 0 counts the model's FLOPs
    clock.mark("restored")
    if rank == 0:
        _announce_resume(cfg, state, world, micro_batch, accum, init_line, early_line)
    state.world_size = world
    ledger = SampleLedger(cfg.train.sample_ledger, rank, world)
    saver = CheckpointSaver(cfg, rank, task.checkpoint_files(cfg, prepared) | task.kept_files(cfg, prepared), clock)
    # a peer lost, or the group stopped, while this worker trains: its state as a checkpoint (checkpoints/rescue.py)
    rescue = saver.rescue = Rescue(cfg, run, state, rank, saver.task_files, saver.job_yaml, loop_config.get("fence"))
    step_ctx = StepContext(cfg, task, run, device, rank, world, clock, speed, saver, micro_batch, accum, epoch_steps,
                           total_steps, resumed_from_step=state.step)  # what every step is taken with
    reporter = Reporter(step_ctx)
    if state.step >= state.last_step(total_steps):  # a rerun of a finished run: evaluate it, train nothing
        reporter.completed_run(state)

    # Around each step, at its named points in this order (worker/step_callbacks.py): train.ema_decay's average,
    # the sample ledger, a lone worker's copy of its state to the driver's memory (checkpoint.memory_copy), the
    # failure tests' pacing, kill and error (none in a real run), train.profile's window; then the task's own and
    # the user's (train.callbacks).
    callbacks = Callbacks([run.ema, ledger, MemoryCopies(step_ctx, copies, state, reporter), FaultHooks(),
                           StepProfiler(cfg, rank, device), *task.callbacks(),
                           *(cls() for cls in callback_classes(cfg.train.callbacks))])
    clock.mark("loop_started")
    # Python's full collections scan every object the process holds: in a training worker (torch, transformers,
    # Ray, the run's own) one took ~0.6 s on a 2-core machine, a stalled step wherever it fell (under DDP every
    # rank's). What the worker built before its loop lives through it: frozen, a full collection scans only what
    # the steps make. Given back after the loop (a lane's next trial must be able to collect this one's cycles).
    gc.freeze()
    try:
        with rescue.around_the_loop():  # a peer lost without notice: this worker's state, whole, as a checkpoint
            _train_steps(step_ctx, state, feed, callbacks, reporter, rescue)
    finally:
        gc.unfreeze()
    reporter.sender.flush()  # (the last reports, a checkpoint's among them, reach the host before the function ends)
    # Rank 0's return value reaches the driver as Result.return_value.
    return {"resumed_from_step": step_ctx.resumed_from_step, "final_step": state.step,
            "peak_source": speed.peak_source, "clock": clock.snapshot()}


def _train_steps(ctx: StepContext, state: TrainState, feed: EpochFeed, callbacks: Callbacks, reporter: Reporter,
                 rescue: Rescue) -> None:
    """The steps from `state` to the run's last: each with its callbacks, counted, and reported when due."""
    cfg, clock, window, bad_ids = ctx.cfg, ctx.clock, Window(), set()
    last_end = None  # the last step's end: the loop's wall time runs from it (the group's first step: its own time)
    while state.step < state.last_step(ctx.total_steps):  # (early stopping moves the last step: report.py)
        for micro_batches, wait_s in _timed(feed.steps(state)):
            clock.add("data_wait", wait_s)
            callbacks.before_step(ctx, state)
            step_started, blocked_before = time.perf_counter(), clock.totals["checkpoint"]
            loss_sum, n_valid = step(ctx, state, micro_batches, window, wait_s)
            callbacks.after_update(ctx, state, micro_batches, loss_sum, n_valid)
            # the step's time, less what it waited for a checkpoint snapshot (counted as checkpoint time)
            held = clock.totals["checkpoint"] - blocked_before
            step_s = clock.add("step", time.perf_counter() - step_started - held)
            now = time.perf_counter()
            state.advance(ctx.epoch_steps, cfg.train.global_batch_size, step_s,
                          step_s if last_end is None else now - last_end)
            last_end = now
            rescue.stepped()  # (the state is whole again: the step's update is counted)
            feed.ahead(state, ctx.total_steps)
            clock.mark_once("first_step")  # time to first step: the start-up a user waits through
            callbacks.after_step(ctx, state)
            if reporter.due(state):
                reporter.report(state, window, bad_ids)
                window = Window()
            callbacks.after_report(ctx, state)  # (the failure tests' kill point: after the report)
            if state.step >= state.last_step(ctx.total_steps):
                break


def _build_run(cfg: JobConfig, task: Task, clock: PhaseClock, rank: int, world: int, device, total_steps: int,
               epoch_steps: int | None = None):
    """torch's threads (scaling.torch_threads), the model (same initial weights on every rank, or
    train.init_from's), the batch plan (the global batch, fixed by the config, split evenly over the ranks and,
    on each rank, into `accum` micro-batches), DDP (gloo on CPU, nccl on GPU) or FSDP with compression and
    torch.compile, the optimizer and schedule.
    Returns (run, speed meter, micro-batch, accum, the fine-tuning line or None)."""
    if cfg.scaling.torch_threads:
        torch.set_num_threads(cfg.scaling.torch_threads)
    torch.manual_seed(cfg.train.seed)
    # in training mode whatever it was built in (transformers' from_pretrained returns a model in eval mode)
    model = device_settings(master_weights(task.build_model(), cfg.model.dtype).to(device).train(), device,
                            cfg.train.tf32, task.channels_last)
    # Fine-tuning: train.init_from's weights (unless the run resumes from its own checkpoints).
    init_line = load_init_from(model, cfg, task, rank, world)
    clock.mark("model_built")
    micro_batch, accum = batch_plan(cfg, world, model, task, device, rank)
    speed = SpeedMeter(cfg, device, world, micro_batch, accum)
    if rank == 0 and SpeedMeter.counts_before_wrapping(cfg):
        speed.count(task, model)
    # the weight average (train.ema_decay): a plain copy, before the wrappers (worker/ema.py)
    ema = WeightAverage(model, cfg.train.ema_decay) if cfg.train.ema_decay else None
    model, hook_state = parallel.wrap(model, cfg, console=console if rank == 0 else lambda m: None)
    optimizer = build_optimizer(model, cfg.train)
    run = Trainables(model, optimizer, lr_schedule(optimizer, cfg.train, total_steps, epoch_steps),
              grad_scaler(device, cfg.train.precision), hook_state, ema)
    return run, speed, micro_batch, accum, init_line


def step(ctx: StepContext, state: TrainState, micro_batches: list[dict], window: Window, wait_s: float):
    """A training step as the loop runs it between two report steps: the update, and the window's account of
    it, none of which waits for the device (the loss, the sample count and the unreadable samples stay device
    tensors until the report reads them; tests/unit/test_host_sync.py counts). Returns (loss_sum, n_valid)."""
    cfg, run = ctx.cfg, ctx.trainables
    # Reseed per step: dropout and the like draw from (seed, rank, step), so a resume is exact.
    torch.manual_seed(hash((cfg.train.seed, ctx.rank, state.step)) % 2**63)
    before_update = ctx.saver.before_update if ctx.saver is not None else None  # (a snapshot may be copying)
    loss_sum, n_valid, norm = train_step(run.model, run.optimizer, run.scheduler, run.scaler, micro_batches, cfg,
                                         ctx.task, ctx.device, before_update=before_update)
    if cfg.train.nonfinite == "skip" or run.scaler.is_enabled():  # a skipped step's loss is not the run's
        ok = torch.isfinite(norm)
        loss_sum, n_valid = torch.where(ok, loss_sum, 0.0), torch.where(ok, n_valid, 0)
    window.add(loss_sum, n_valid, wait_s, [ctx.task.bad_samples(batch) for batch in micro_batches], norm)
    return loss_sum, n_valid


def train_step(model, optimizer, scheduler, scaler, micro_batches: list[dict], cfg: JobConfig, task: Task,
               device: torch.device, before_update=None):
    """One optimizer step over this rank's micro-batches. Returns (loss summed over samples, samples).

    Each micro-batch's mean loss is weighted 1/len(micro_batches), so the accumulated gradient is the mean
    over the rank's share of the global batch; DDP then averages over the ranks. Only the last micro-batch's
    backward all-reduces (no_sync on the others): one gradient exchange per optimizer step.
    `before_update` runs before the weights change (a checkpoint snapshot may still be copying them).
    The gradient norm (before clipping) is returned too, as a device tensor: a non-finite one is the step
    train.nonfinite is about; with skip, the fused optimizer leaves everything as it was (`found_inf`).
    Returns (loss summed over samples, samples, gradient norm).
    """
    optimizer.zero_grad(set_to_none=True)
    loss_sum, n_sum = 0.0, 0.0
    weights = loss_weights(task, micro_batches)
    # a step that may be skipped (non-finite gradients): its forward moves BatchNorm's statistics (and count)
    # before anyone knows, and a NaN there would stay in every evaluation and checkpoint after; kept to be put back
    buffers = _buffers(model) if cfg.train.nonfinite == "skip" or scaler.is_enabled() else []
    before = [b.clone() for b in buffers]
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else parallel.no_grad_sync(model):
            try:
                with autocast(device, cfg.train.precision):
                    loss, n_valid = task.loss(model, batch)
                scaler.scale(loss * weights[i]).backward()
            except torch.cuda.OutOfMemoryError:
                # The same micro-batch runs out the same way after a restart: a config error, not retried.
                raise ConfigError(
                    f"out of GPU memory in a training step (train.micro_batch_size "
                    f"{cfg.train.micro_batch_size or 'not set: the worker share of the global batch'}, "
                    f"{len(micro_batches)} micro-batch(es) per step, precision {cfg.train.precision}): a restart "
                    f"would run out the same way. Lower train.micro_batch_size (accumulation keeps the global "
                    f"batch) or set it to auto, train in bf16, or shard the model (scaling.strategy fsdp_full)"
                ) from None
        loss_sum, n_sum = loss_sum + loss.detach().float() * n_valid, n_sum + n_valid
    scaler.unscale_(optimizer)  # the true gradients' norm (and clipping), not the fp16-scaled ones
    norm = parallel.grad_norm(model, cfg.train.grad_clip)
    if buffers:  # (on the device: where the step is skipped, the statistics as they were; no host sync)
        finite = torch.isfinite(norm)
        torch._foreach_copy_(buffers, [torch.where(finite, b, old) for b, old in zip(buffers, before)])
    if cfg.train.nonfinite == "skip" and not scaler.is_enabled():  # (fp16's scaler skips overflows itself)
        optimizer.found_inf = (~torch.isfinite(norm)).float()  # read by the fused update, on the device
    if before_update is not None:
        before_update()
    scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
    scaler.update()
    scheduler.step()
    return loss_sum, n_sum, norm


def loss_weights(task: Task, micro_batches: list[dict]) -> list:
    """Each micro-batch's weight in the step's gradient, which DDP then averages over the ranks: 1/n for n
    micro-batches, or where the task counts items (Task.loss_items: a chat's trained tokens) the micro-batch's
    items over the mean per rank of the global batch's, so that the step's gradient is the mean over all its
    items. One all-reduce of a device scalar; nothing read on the host."""
    counts = [task.loss_items(batch) for batch in micro_batches]
    if counts[0] is None:
        return [1.0 / len(micro_batches)] * len(micro_batches)
    total = torch.stack(counts).sum().to(torch.float32)
    world = 1
    if distributed():
        all_reduce_sum(total)
        world = torch.distributed.get_world_size()
    per_rank = total.clamp(min=1) / world
    return [count / per_rank for count in counts]


def _buffers(model) -> list[torch.Tensor]:
    return list(parallel.unwrap(model).buffers())


def _steps(cfg: JobConfig, task: Task) -> tuple[int, int]:
    """(optimizer steps per epoch, steps in the whole run)."""
    epoch_steps = steps_per_epoch(task.num_train_samples, cfg.train.global_batch_size)
    if epoch_steps == 0:
        raise ConfigError(f"train.global_batch_size {cfg.train.global_batch_size} exceeds the "
                          f"{task.num_train_samples} training samples: lower it")
    total_steps = epoch_steps * cfg.train.epochs
    return epoch_steps, min(total_steps, cfg.train.max_steps) if cfg.train.max_steps else total_steps


def _announce_resume(cfg: JobConfig, state: TrainState, world: int, micro_batch: int, accum: int,
                     init_line: str | None, early_line: str | None) -> None:
    if init_line:
        console(init_line)
    if state.step:
        console(f"resumed at step {state.step} (epoch {state.epoch}, step {state.step_in_epoch} in epoch)")
    if state.world_size != world:  # an elastic resize, or a rerun with another worker count
        global_batch = cfg.train.global_batch_size
        console(f"world size {state.world_size} -> {world}: samples per worker and step "
                f"{global_batch // state.world_size} -> {global_batch // world} (micro-batch {micro_batch} x "
                f"{accum} accumulation steps); global batch {global_batch}, LR schedule and sample order unchanged")
    if early_line:
        console(early_line)


def _timed(iterable):
    """Yield (item, seconds spent waiting for it): the data-wait part of each step."""
    it = iter(iterable)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        yield item, time.perf_counter() - t0
