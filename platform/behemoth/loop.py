"""Worker side: the function Ray Train runs on every worker. Reads top to bottom like a one-file script:
config -> task (data + model + loss) -> DDP -> optimizer -> restore -> loop (step, report, evaluate, checkpoint).

What differs between image classification and language modelling lives in behemoth.tasks; this file is
the same for both.

It never imports ray.tune. Everything that decides *when* something happens (report, evaluate, checkpoint)
depends only on the step counter, which is identical on every rank: all ranks call the collective
operations (all-reduce, ray.train.report) the same number of times.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import sys
import tempfile
import threading
import time

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from behemoth import autobatch, checkpoint, metrics, parallel
from behemoth.checkpoint import CheckpointError, TrainState, unwrap
from behemoth.config import JobConfig, config_from_dict, dump_yaml
from behemoth.data.images import BadSampleError
from behemoth.data.order import rank_eval_indices, rank_train_indices, steps_per_epoch
from behemoth.metrics import Window, data_wait_fraction, progress_line, throughput
from behemoth.optim import build_optimizer, warmup_cosine
from behemoth.precision import autocast, grad_scaler
from behemoth.tasks import Task, make_task


def train_loop_per_worker(loop_config: dict) -> dict:
    cfg = config_from_dict(loop_config["job"], where="job config")
    _quiet_ray_train_reports()
    task: Task = make_task(cfg, ray.get(loop_config["data_ref"]))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if cfg.scaling.torch_threads:
        torch.set_num_threads(cfg.scaling.torch_threads)
    global_batch = cfg.train.global_batch_size
    epoch_steps = steps_per_epoch(task.num_train_samples, global_batch)
    if epoch_steps == 0:
        raise ValueError(f"train.global_batch_size {global_batch} exceeds the {task.num_train_samples} training "
                         f"samples: lower it")
    total_steps = epoch_steps * cfg.train.epochs
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)

    # Same initial weights on every rank. The plan: the global batch is fixed by the config, split evenly
    # over the ranks and, on each rank, into `accum` micro-batches.
    torch.manual_seed(cfg.train.seed)
    model = task.build_model().to(device)
    micro_batch, accum = batch_plan(cfg, world, model, task, device, rank)
    speed = SpeedMeter(cfg, task, model, device, world, micro_batch, accum)
    # DDP (gloo on CPU, nccl on GPU) or FSDP; gradient compression; torch.compile.
    model, hook_state = parallel.wrap(model, cfg, console=console if rank == 0 else lambda m: None)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = warmup_cosine(optimizer, cfg.train, total_steps)
    scaler = grad_scaler(device, cfg.train.precision)

    # Resume: the latest good checkpoint restores weights, optimizer, schedule, scaler, compression state and
    # the data position.
    state = restore_latest(model, optimizer, scheduler, scaler, hook_state) or TrainState(world_size=world)
    if rank == 0 and state.step:
        console(f"resumed at step {state.step} (epoch {state.epoch}, step {state.step_in_epoch} in epoch)")
    if rank == 0 and state.world_size != world:  # an elastic resize, or a rerun with another worker count
        before = global_batch // state.world_size
        console(f"world size {state.world_size} -> {world}: samples per worker and step {before} -> "
                f"{global_batch // world} (micro-batch {micro_batch} x {accum} accumulation steps); global batch "
                f"{global_batch}, LR schedule and sample order unchanged")
    state.world_size = world
    ledger = SampleLedger(cfg.train.sample_ledger, rank, world)
    saver = CheckpointSaver(cfg, task, rank)
    resumed_from_step = state.step
    if state.step >= total_steps:  # a rerun of a finished run: evaluate its final weights, train nothing
        if rank == 0:
            console(f"run already complete at step {state.step}: nothing to train")
        ray.train.report({"step": state.step, "epoch": state.step / epoch_steps, "samples_seen": state.samples_seen,
                          **evaluate(model, task, rank, world, micro_batch)})

    window, bad_ids = Window(), set()
    while state.step < total_steps:
        indices = rank_train_indices(task.num_train_samples, global_batch, cfg.train.seed, state.epoch,
                                     rank, world, start_step=state.step_in_epoch)
        batches = _grouped(task.train_batches(indices, state.epoch, micro_batch), accum)
        for micro_batches, wait_s in _timed(batches):
            # Reseed per step: dropout and the like draw from (seed, rank, step), so a resume is exact.
            torch.manual_seed(hash((cfg.train.seed, rank, state.step)) % 2**63)
            loss_sum, n_valid = train_step(model, optimizer, scheduler, scaler, micro_batches, cfg, task, device,
                                           before_update=saver.before_update)
            for batch in micro_batches:
                bad_ids.update(task.bad_sample_ids(batch))
            window.add(loss_sum, n_valid, wait_s)
            ledger.record(state, micro_batches, loss_sum, n_valid)
            state.step += 1
            state.step_in_epoch += 1
            state.samples_seen += global_batch
            if state.step_in_epoch == epoch_steps:  # epoch done: the next one starts at its step 0
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
            if _report_due(cfg, state, total_steps):
                _report(cfg, state, total_steps, epoch_steps, window, bad_ids, task, model, optimizer,
                        scheduler, scaler, hook_state, rank, world, micro_batch, speed, saver)
                window = Window()
            if state.step >= total_steps:
                break
    # Rank 0's return value reaches the driver as Result.return_value.
    return {"resumed_from_step": resumed_from_step, "final_step": state.step, "peak_source": speed.peak_source}


def train_step(model, optimizer, scheduler, scaler, micro_batches: list[dict], cfg: JobConfig, task: Task,
               device: torch.device, before_update=None):
    """One optimizer step over this rank's micro-batches. Returns (loss summed over samples, samples).

    Each micro-batch's mean loss is weighted 1/len(micro_batches), so the accumulated gradient is the mean
    over the rank's share of the global batch; DDP then averages over the ranks. Only the last micro-batch's
    backward all-reduces (no_sync on the others): one gradient exchange per optimizer step.
    `before_update` runs before the weights change (a checkpoint snapshot may still be copying them).
    """
    optimizer.zero_grad(set_to_none=True)
    loss_sum, n_sum = 0.0, 0.0
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else parallel.no_grad_sync(model):
            with autocast(device, cfg.train.precision):
                loss, n_valid = task.loss(model, batch)
            scaler.scale(loss / len(micro_batches)).backward()
        loss_sum, n_sum = loss_sum + loss.detach().float() * n_valid, n_sum + n_valid
    if cfg.train.grad_clip:
        scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    if before_update is not None:
        before_update()
    scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
    scaler.update()
    scheduler.step()
    return loss_sum, n_sum


def batch_plan(cfg: JobConfig, world: int, model, task: Task, device, rank: int) -> tuple[int, int]:
    """(per-worker micro-batch, accumulation steps) whose product times the world is the global batch."""
    share = cfg.train.global_batch_size // world
    micro = cfg.train.micro_batch_size
    if micro is None:
        return share // cfg.train.grad_accum_steps, cfg.train.grad_accum_steps
    if micro == "auto":
        micro = _auto_micro_batch(cfg, model, task, device, share, rank)
    return micro, share // micro


def _auto_micro_batch(cfg: JobConfig, model, task: Task, device, share: int, rank: int) -> int:
    """train.micro_batch_size auto: search on this rank, agree on the smallest result over the ranks."""
    cap_mb = cfg.train.auto_batch_memory_mb
    cap = int(cap_mb * 2**20) if cap_mb else int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    slots = 2 if cfg.train.optimizer == "adamw" else int(cfg.train.momentum > 0)
    buffers = {k: v.clone() for k, v in model.named_buffers()}  # the probes must not move BN statistics

    def loss_at(m):
        with autocast(device, cfg.train.precision):
            return task.loss(model, task.example_batch(m))[0]

    largest, micro = autobatch.find_micro_batch(model, loss_at, share, device, cap, slots)
    model.load_state_dict(buffers, strict=False)
    agreed = torch.tensor([micro], device=device)
    if _distributed():
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    micro = int(agreed.item())
    if rank == 0:
        console(f"micro_batch_size auto: up to {largest} samples fit in {cap / 2**20:.0f} MiB; using {micro} "
                f"(x {share // micro} accumulation steps = {share} per worker, global batch "
                f"{cfg.train.global_batch_size})")
    return micro


class SpeedMeter:
    """Achieved TFLOP/s, MFU and peak memory for the reports. The model's FLOPs per sample are counted once,
    before training, on a forward of one example batch. MFU only where the device's peak is known (a GPU's
    data sheet, or train.peak_tflops): see metrics.peak_flops."""

    def __init__(self, cfg: JobConfig, task: Task, model, device, world: int, micro_batch: int, accum: int):
        self.device, self.world, self.micro_batch, self.accum = device, world, micro_batch, accum
        buffers = {k: v.clone() for k, v in model.named_buffers()}
        model.eval()
        batch = task.example_batch(1)  # FLOPs per sample do not depend on the batch; one sample is cheapest
        self.flops_per_sample = metrics.training_flops_per_sample(lambda: task.loss(model, batch), 1)
        model.train()
        model.load_state_dict(buffers, strict=False)
        self.peak, self.peak_source = metrics.peak_flops(device, cfg.train.precision, cfg.train.peak_tflops)

    def metrics(self, samples_per_s: float) -> dict:
        out = {"tflops_per_worker": self.flops_per_sample * samples_per_s / self.world / 1e12,
               "peak_mem_gb": metrics.peak_memory_bytes(self.device) / 1e9,
               "model_tflops_per_sample": self.flops_per_sample / 1e12,
               "micro_batch_size": self.micro_batch, "grad_accum_steps": self.accum}
        if self.peak:
            out["mfu"] = metrics.mfu(self.flops_per_sample, samples_per_s, self.world, self.peak)
        return out


@torch.no_grad()
def evaluate(model, task: Task, rank: int, world: int, batch_size: int) -> dict:
    """The task's validation metrics over the whole validation set, each sample on exactly one rank."""
    sharded = parallel.is_sharded(model)
    # DDP: the inner model, so no collectives run inside eval. FSDP: the sharded model gathers its
    # parameters in every forward, so all ranks must run the same number of forwards (see below).
    net = unwrap(model)
    net.eval()
    totals = torch.zeros(task.eval_size, dtype=torch.float64, device=ray.train.torch.get_device())
    indices = rank_eval_indices(task.num_val_samples, rank, world)
    forwards = 0
    if len(indices):
        for batch in task.eval_batches(indices, batch_size):
            with autocast(totals.device, task.cfg.train.precision):
                totals += task.eval_sums(net, batch).to(totals)
            forwards += 1
    if sharded:  # ranks with fewer batches join the others' all-gathers with forwards they discard
        most = max(-(-len(rank_eval_indices(task.num_val_samples, r, world)) // batch_size) for r in range(world))
        for _ in range(most - forwards):
            with autocast(totals.device, task.cfg.train.precision):
                task.eval_sums(net, task.example_batch(1))
    _all_reduce_sum(totals)
    net.train()
    return task.eval_metrics(totals)


def restore_latest(model, optimizer, scheduler, scaler, hook_state=None) -> TrainState | None:
    """Restore the newest checkpoint that passes verification; None for a fresh run.

    Candidates, newest first: complete checkpoints in the run folder newer than Ray Train's latest (written
    and uploaded, but the worker or driver died before Ray Train registered them), Ray Train's latest, then
    its earlier ones. A candidate that fails verification is skipped with a warning naming it.
    """
    latest = ray.train.get_checkpoint()
    candidates = [latest] if latest else []
    candidates += [r.checkpoint for r in reversed(ray.train.get_all_reported_checkpoints())
                   if latest is None or r.checkpoint.path != latest.path]
    registered = -1  # the step of Ray's latest, read even if the checkpoint is damaged
    if latest and os.path.isdir(latest.path):
        try:
            registered = checkpoint.read_state(latest.path).step
        except (OSError, ValueError, TypeError):
            pass
    rank0 = ray.train.get_context().get_world_rank() == 0
    if rank0:
        _remove_partial_uploads({c.path for c in candidates})
    unregistered = [p for step, p in _run_folder_checkpoints() if step > registered]
    if unregistered and rank0:
        console(f"restoring from {unregistered[0]}: complete on disk, but not registered with Ray Train when "
                f"the run stopped")
    for ckpt in unregistered + candidates:
        try:
            parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, hook_state=hook_state)
            if isinstance(ckpt, str):
                return checkpoint.load(ckpt, **parts)
            with ckpt.as_directory() as d:
                return checkpoint.load(d, **parts)
        except CheckpointError as e:
            console(f"WARNING: skipping checkpoint {getattr(ckpt, 'path', ckpt)}: {e}")
    if candidates:  # Ray Train had registered checkpoints and none passes: never silently start over
        tried = [getattr(c, "path", c) for c in unregistered + candidates]
        raise CheckpointError(f"no checkpoint of this run passes verification (tried {tried})")
    # Nothing registered: what failed were unregistered folders (an upload cut short by the failure, whose
    # manifest was copied before the rest). Nothing was committed yet, so the run starts from step 0.
    return None


def _remove_partial_uploads(registered: set[str]) -> None:
    """Delete checkpoint folders of this run that have no manifest and that Ray Train never registered:
    uploads cut short by a failure (upload_manifest_last puts the manifest last). No upload of this run is in
    flight while a worker group starts (the previous group is gone), so each one is dead."""
    import pyarrow.fs

    storage = ray.train.get_context().get_storage()
    fs, run_dir = storage.storage_filesystem, storage.experiment_fs_path
    entries = fs.get_file_info(pyarrow.fs.FileSelector(run_dir, allow_not_found=True))
    for entry in entries:
        if entry.type != pyarrow.fs.FileType.Directory or not entry.base_name.startswith("checkpoint_"):
            continue
        manifest = fs.get_file_info(f"{entry.path}/{checkpoint.MANIFEST}")
        if manifest.type == pyarrow.fs.FileType.NotFound and entry.path not in registered:
            console(f"removing {entry.path}: a checkpoint upload that did not finish (no manifest); it is never "
                    f"restored")
            fs.delete_dir(entry.path)


def _run_folder_checkpoints() -> list[tuple[int, str]]:
    """Complete checkpoints in this run's folder, newest first. Local storage only: on a URI the registered
    checkpoints are all behemoth restores from."""
    import pyarrow.fs

    storage = ray.train.get_context().get_storage()
    if not isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem):
        return []
    return checkpoint.complete_checkpoints(storage.experiment_fs_path)


# ---------------------------------------------------------------------------------------------------------
# Reporting: metrics every log_every steps, evaluation and checkpoints when due


def _report_due(cfg: JobConfig, state: TrainState, total_steps: int) -> bool:
    return (state.step >= total_steps or state.step % cfg.train.log_every == 0
            or _eval_due(cfg, state, total_steps) or state.step % cfg.checkpoint.every_n_steps == 0)


def _eval_due(cfg: JobConfig, state: TrainState, total_steps: int) -> bool:
    every = cfg.eval.every_n_steps
    return (state.step >= total_steps or (cfg.eval.per_epoch and state.step_in_epoch == 0)
            or bool(every and state.step % every == 0))


def _report(cfg, state, total_steps, epoch_steps, window, bad_ids, task, model, optimizer, scheduler, scaler,
            hook_state, rank, world, micro_batch, speed, saver) -> None:
    report = _train_metrics(cfg, state, total_steps, epoch_steps, window, bad_ids, task,
                            lr=scheduler.get_last_lr()[0])
    report.update(speed.metrics(report["samples_per_s"]))
    if saver.last_block_s is not None:
        report["checkpoint_block_s"] = saver.last_block_s
    evaluate_now = _eval_due(cfg, state, total_steps)
    checkpoint_now = state.step % cfg.checkpoint.every_n_steps == 0 or state.step >= total_steps
    if evaluate_now or checkpoint_now:
        sync_buffers(model)
    if evaluate_now:
        report.update(evaluate(model, task, rank, world, micro_batch))
    if rank == 0:
        console(progress_line(report, total_steps, cfg.train.epochs))
    if checkpoint_now:
        saver.save_and_report(report, state, model, optimizer, scheduler, scaler, hook_state)
    else:
        ray.train.report(report)


class CheckpointSaver:
    """Checkpoints through ray.train.report, from rank 0 (DDP keeps the ranks identical: one copy of the state
    is the whole state; FSDP gathers the full state on rank 0).

    With checkpoint.async_save the step waits only for a host-memory snapshot of the state, and under DDP
    only for part of it: the parameters and optimizer state are copied while the next step's forward and
    backward run, and that step waits for the copy before its optimizer update (`before_update`). Writing
    the files, the manifest and the upload run in Ray Train's upload thread (CheckpointUploadMode.ASYNC,
    which still registers checkpoints in report order). `last_block_s` is how long the last checkpoint held
    the training loop (at the report, and before the next update), reported with the next metrics.
    """

    def __init__(self, cfg: JobConfig, task: Task, rank: int):
        self.cfg, self.task, self.rank = cfg, task, rank
        self.last_block_s = None
        # Host buffers the snapshots copy into, reused while no write of an earlier snapshot still reads them.
        self.buffers: dict = {}
        self.buffers_free = threading.Event()
        self.buffers_free.set()
        self.copying = None  # the last snapshot while its copy may still read the live state

    def before_update(self) -> None:
        """Called before every optimizer update: the snapshot's copy of the state must be complete."""
        if self.copying is not None:
            t0 = time.perf_counter()
            self.copying.wait_sources_free()
            self.copying = None
            self.last_block_s += time.perf_counter() - t0

    def save_and_report(self, metrics, state, model, optimizer, scheduler, scaler, hook_state) -> None:
        t0 = time.perf_counter()
        hook_states = _gather_to_rank0(hook_state.to_bytes()) if hook_state is not None else None
        snap, reuse = None, self.buffers_free.is_set()
        if self.rank == 0 or parallel.is_sharded(model):
            snap = checkpoint.snapshot(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                       state=state, classes=self.task.classes(), job_yaml=dump_yaml(self.cfg),
                                       hook_states=hook_states, buffers=self.buffers if reuse else None,
                                       overlap=self.cfg.checkpoint.async_save)
        if not self.cfg.checkpoint.async_save:
            with tempfile.TemporaryDirectory() as tmp:
                ckpt = ray.train.Checkpoint.from_directory(str(checkpoint.write(tmp, snap))) if snap else None
                ray.train.report(metrics, checkpoint=ckpt,
                                 checkpoint_upload_fn=functools.partial(upload_manifest_last, step=snap.step) if snap else None)
        elif snap is None:
            ray.train.report(metrics)
        else:
            if reuse:
                self.buffers_free.clear()  # until the upload thread has written this snapshot
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tempfile.mkdtemp()),
                             checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                             checkpoint_upload_fn=self._write_then_upload(snap, self.buffers_free if reuse else None))
        self.copying = snap
        self.last_block_s = time.perf_counter() - t0

    @staticmethod
    def _write_then_upload(snap, written):
        """The upload function Ray Train calls in its upload thread: write the snapshot into the (empty) local
        checkpoint folder, free its buffers, then upload it (Ray deletes the local folder after)."""

        def write_then_upload(ckpt, dir_name):
            try:
                checkpoint.write(ckpt.path, snap)
            finally:
                if written is not None:
                    written.set()
            return upload_manifest_last(ckpt, dir_name, snap.step)

        return write_then_upload


def upload_manifest_last(ckpt, dir_name: str, step: int):
    """Copy a written checkpoint folder to the run's storage (local or URI) with its manifest last: Ray's own
    copy moves the files in parallel, so a copy cut short (the worker or node dies) could leave a manifest
    beside incomplete files. Uploaded this way, a folder in the run folder without a manifest is an upload
    that did not finish (restore_latest removes it), and one with a manifest has all its files."""
    import shutil

    import pyarrow.fs

    storage = ray.train.get_context().get_storage()
    held = tempfile.mkdtemp(prefix="manifest-")
    try:
        shutil.move(os.path.join(ckpt.path, checkpoint.MANIFEST), held)
        persisted = storage.persist_current_checkpoint(ckpt, dir_name)
        checkpoint.fault_injection_point(step)
        pyarrow.fs.copy_files(os.path.join(held, checkpoint.MANIFEST), f"{persisted.path}/{checkpoint.MANIFEST}",
                              source_filesystem=pyarrow.fs.LocalFileSystem(),
                              destination_filesystem=persisted.filesystem)
    finally:
        shutil.rmtree(held, ignore_errors=True)
    return persisted


def _train_metrics(cfg, state, total_steps, epoch_steps, window, bad_ids, task, lr) -> dict:
    stats = torch.tensor([float(window.loss_sum), float(window.loss_count)], dtype=torch.float64,
                         device=ray.train.torch.get_device())
    _all_reduce_sum(stats)
    bad = _union_across_ranks(bad_ids)
    if len(bad) > cfg.data.max_bad_samples:
        names = task.describe_samples(list(bad)[:20])
        raise BadSampleError(f"{len(bad)} undecodable images exceed data.max_bad_samples="
                             f"{cfg.data.max_bad_samples}: {names}")
    elapsed = window.elapsed()
    samples_per_s = throughput(window.steps * cfg.train.global_batch_size, elapsed)
    metrics = {
        "step": state.step,
        "total_steps": total_steps,
        "epoch": state.step / epoch_steps,
        "loss": stats[0].item() / max(stats[1].item(), 1.0),
        "lr": lr,
        "samples_per_s": samples_per_s,
        "data_wait_frac": data_wait_fraction(window.data_wait_s, elapsed),
        "eta_s": (total_steps - state.step) * cfg.train.global_batch_size / max(samples_per_s, 1e-9),
        "samples_seen": state.samples_seen,
        "bad_samples": len(bad),
        "world_size": state.world_size,
        "wall_time": time.time(),  # rank 0's clock as it reports: spans between reports include everything
    }
    if task.tokens_per_sample:
        metrics["tokens_per_s"] = samples_per_s * task.tokens_per_sample
    return metrics


def sync_buffers(model) -> None:
    """Give every rank rank 0's buffers (BatchNorm running stats).

    DDP broadcasts buffers at the start of each forward, so after a step every rank holds running stats
    updated with its own micro-batch. Before evaluating or checkpointing, all ranks adopt rank 0's: the same
    values DDP would broadcast at the next step, so evaluation is consistent and the checkpoint is the state.
    """
    if _distributed():
        for buffer in unwrap(model).buffers():
            dist.broadcast(buffer, src=0)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce_sum(t: torch.Tensor) -> None:
    if _distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)


def _gather_to_rank0(obj):
    """[obj of rank 0, obj of rank 1, ...] on rank 0, None elsewhere."""
    if not _distributed():
        return [obj]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def _union_across_ranks(ids: set) -> set:
    if not _distributed():
        return set(ids)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(ids))
    return set().union(*map(set, gathered))


def _quiet_ray_train_reports() -> None:
    """Keep the console to behemoth's progress lines: Ray 2.60 logs every report at INFO from a logger named
    by its file path (not under `ray.train`), so RunConfig's LoggingConfig cannot filter it."""
    from ray.train.v2._internal.execution import context as train_context

    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)


def console(message: str) -> None:
    """A line for the user's console. Not print(): Ray Train's print patch would show it twice."""
    sys.stdout.write(f"[behemoth] {message}\n")
    sys.stdout.flush()


class SampleLedger:
    """Appends {"step", "epoch", "rank", "world", "group", "node", "pid", "ids", "loss_sum", "samples"} per
    trained step to FOLDER/rank<r>.jsonl (loss_sum: this rank's loss summed over its samples of the step).

    An audit trail of the data order (train.sample_ledger). `ids` are the `sample_id`s of the batches the
    step actually trained on, as the data pipeline delivered them (not the slice of the planned order it
    asked for): an audit against the planned order thus catches a pipeline that skips, repeats or reorders
    samples, as well as a wrong resume position. `group` names the worker group (rank 0's pid and
    start time, the same on every rank): after a failure or a resize, the steps that were redone appear
    under two groups, and for each step the records of the last group that trained it are what the final
    weights were trained on.
    """

    def __init__(self, folder: str | None, rank: int, world: int):
        self.file = None
        if folder:
            os.makedirs(folder, exist_ok=True)
            self.file = open(os.path.join(folder, f"rank{rank}.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
        self.rank, self.world = rank, world
        self.node = ray.get_runtime_context().get_node_id()
        group = [f"{os.getpid()}-{time.time():.3f}"]
        if folder and _distributed():
            dist.broadcast_object_list(group, src=0)
        self.group = group[0]

    def record(self, state: TrainState, micro_batches: list[dict], loss_sum, samples) -> None:
        if self.file is not None:
            ids = torch.cat([batch["sample_id"].reshape(-1).cpu() for batch in micro_batches]).tolist()
            line = {"step": state.step + 1, "epoch": state.epoch, "rank": self.rank, "world": self.world,
                    "group": self.group, "node": self.node, "pid": os.getpid(), "ids": ids,
                    "loss_sum": float(loss_sum), "samples": float(samples)}
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()


def _grouped(iterable, n: int):
    """Lists of n consecutive items (the micro-batches of one optimizer step); a short tail is dropped."""
    it = iter(iterable)
    while len(group := list(itertools.islice(it, n))) == n:
        yield group


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

