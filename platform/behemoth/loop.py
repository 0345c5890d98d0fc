"""Worker side: the function Ray Train runs on every worker. Reads top to bottom like a one-file script:
config -> data index -> model (DDP) -> optimizer -> restore -> loop (step, report, evaluate, checkpoint).

It never imports ray.tune. Everything that decides *when* something happens (report, evaluate, checkpoint)
depends only on the step counter, which is identical on every rank: all ranks call the collective
operations (all-reduce, ray.train.report) the same number of times.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

from behemoth import checkpoint
from behemoth.checkpoint import CheckpointError, TrainState, unwrap
from behemoth.config import JobConfig, config_from_dict, dump_yaml
from behemoth.data.images import BadSampleError, ImageIndex, describe_samples, rank_dataset
from behemoth.data.order import rank_eval_indices, rank_train_indices, steps_per_epoch
from behemoth.metrics import Window, data_wait_fraction, progress_line, throughput
from behemoth.models.registry import build_model
from behemoth.optim import build_optimizer, warmup_cosine


def train_loop_per_worker(loop_config: dict) -> dict:
    cfg = config_from_dict(loop_config["job"], where="job config")
    _quiet_ray_train_reports()
    index: ImageIndex = ray.get(loop_config["index_ref"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if cfg.scaling.torch_threads:
        torch.set_num_threads(cfg.scaling.torch_threads)

    # The plan: the global batch is fixed by the config and split evenly over the ranks.
    global_batch = cfg.train.global_batch_size
    micro_batch = global_batch // world
    epoch_steps = steps_per_epoch(index.train.num_rows, global_batch)
    if epoch_steps == 0:
        raise ValueError(f"train.global_batch_size {global_batch} exceeds the {index.train.num_rows} training "
                         f"samples: lower it")
    total_steps = epoch_steps * cfg.train.epochs
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)

    # Same initial weights on every rank; prepare_model wraps in DDP (gloo on CPU, nccl on GPU).
    torch.manual_seed(cfg.train.seed)
    model = ray.train.torch.prepare_model(build_model(cfg.model.name, len(index.classes)))
    optimizer = build_optimizer(model, cfg.train)
    scheduler = warmup_cosine(optimizer, cfg.train, total_steps)

    # Resume: the latest good checkpoint restores weights, optimizer, schedule and the data position.
    state = restore_latest(model, optimizer, scheduler) or TrainState(world_size=world)
    if rank == 0 and state.step:
        console(f"resumed at step {state.step} (epoch {state.epoch}, step {state.step_in_epoch} in epoch)")
    state.world_size = world
    resumed_from_step = state.step
    if state.step >= total_steps:  # a rerun of a finished run: evaluate its final weights, train nothing
        if rank == 0:
            console(f"run already complete at step {state.step}: nothing to train")
        ray.train.report({"step": state.step, "epoch": state.step / epoch_steps, "samples_seen": state.samples_seen,
                          **evaluate(model, index, cfg, rank, world, micro_batch)})

    window, bad_ids = Window(), set()
    while state.step < total_steps:
        indices = rank_train_indices(index.train.num_rows, global_batch, cfg.train.seed, state.epoch,
                                     rank, world, start_step=state.step_in_epoch)
        ds = rank_dataset(index.train, indices, cfg.data, seed=cfg.train.seed, epoch=state.epoch, train=True,
                          batch_size=micro_batch)
        batches = ds.iter_torch_batches(batch_size=micro_batch, prefetch_batches=cfg.data.prefetch_batches)
        for batch, wait_s in _timed(batches):
            # Reseed per step: dropout and the like draw from (seed, rank, step), so a resume is exact.
            torch.manual_seed(hash((cfg.train.seed, rank, state.step)) % 2**63)
            loss_sum, n_valid = train_step(model, optimizer, scheduler, batch, cfg)
            bad_ids.update(batch["sample_id"][~batch["valid"]].tolist())
            window.add(loss_sum, n_valid, wait_s)
            state.step += 1
            state.step_in_epoch += 1
            state.samples_seen += global_batch
            if state.step_in_epoch == epoch_steps:  # epoch done: the next one starts at its step 0
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
            if _report_due(cfg, state, total_steps):
                _report(cfg, state, total_steps, epoch_steps, window, bad_ids, index, model, optimizer,
                        scheduler, rank, world, micro_batch)
                window = Window()
            if state.step >= total_steps:
                break
    # Rank 0's return value reaches the driver as Result.return_value.
    return {"resumed_from_step": resumed_from_step, "final_step": state.step}


def train_step(model, optimizer, scheduler, batch: dict, cfg: JobConfig):
    """One optimizer step on this rank's micro-batch. Undecodable samples (valid=False) carry no loss."""
    valid = batch["valid"].float()
    logits = model(pixel_values=batch["image"]).logits
    per_sample = F.cross_entropy(logits, batch["label"], reduction="none")
    n_valid = valid.sum()
    loss = (per_sample * valid).sum() / n_valid.clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.train.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    optimizer.step()
    scheduler.step()
    return loss.detach() * n_valid, n_valid


@torch.no_grad()
def evaluate(model, index: ImageIndex, cfg: JobConfig, rank: int, world: int, batch_size: int) -> dict:
    """Top-1 accuracy and loss over the whole validation set, each sample on exactly one rank."""
    net = unwrap(model)  # no DDP collectives inside eval
    net.eval()
    # loss sum, correct, valid samples, undecodable samples (dropped within data.max_bad_samples)
    totals = torch.zeros(4, dtype=torch.float64, device=ray.train.torch.get_device())
    indices = rank_eval_indices(index.val.num_rows, rank, world)
    if len(indices):
        ds = rank_dataset(index.val, indices, cfg.data, seed=cfg.train.seed, epoch=0, train=False,
                          batch_size=batch_size)
        for batch in ds.iter_torch_batches(batch_size=batch_size, prefetch_batches=cfg.data.prefetch_batches):
            valid = batch["valid"]
            logits = net(pixel_values=batch["image"]).logits
            losses = F.cross_entropy(logits, batch["label"], reduction="none")
            correct = (logits.argmax(dim=1) == batch["label"]) & valid
            totals += torch.stack([losses[valid].sum(), correct.sum(), valid.sum(), (~valid).sum()]).to(totals)
    _all_reduce_sum(totals)
    net.train()
    n = max(totals[2].item(), 1.0)
    return {"val_loss": totals[0].item() / n, "val_accuracy": totals[1].item() / n, "val_samples": int(n),
            "val_bad_samples": int(totals[3].item())}


def restore_latest(model, optimizer, scheduler) -> TrainState | None:
    """Restore from Ray's latest checkpoint; if it fails verification, from the newest earlier one that passes."""
    latest = ray.train.get_checkpoint()
    if latest is None:
        return None
    candidates = [latest]
    for reported in reversed(ray.train.get_all_reported_checkpoints()):
        if reported.checkpoint.path != latest.path:
            candidates.append(reported.checkpoint)
    for ckpt in candidates:
        try:
            with ckpt.as_directory() as d:
                return checkpoint.load(d, model=model, optimizer=optimizer, scheduler=scheduler)
        except CheckpointError as e:
            console(f"WARNING: skipping checkpoint {ckpt.path}: {e}")
    raise CheckpointError(f"no checkpoint of this run passes verification (tried {[c.path for c in candidates]})")


# ---------------------------------------------------------------------------------------------------------
# Reporting: metrics every log_every steps, evaluation and checkpoints when due


def _report_due(cfg: JobConfig, state: TrainState, total_steps: int) -> bool:
    return (state.step >= total_steps or state.step % cfg.train.log_every == 0
            or _eval_due(cfg, state, total_steps) or state.step % cfg.checkpoint.every_n_steps == 0)


def _eval_due(cfg: JobConfig, state: TrainState, total_steps: int) -> bool:
    every = cfg.eval.every_n_steps
    return (state.step >= total_steps or (cfg.eval.per_epoch and state.step_in_epoch == 0)
            or bool(every and state.step % every == 0))


def _report(cfg, state, total_steps, epoch_steps, window, bad_ids, index, model, optimizer, scheduler,
            rank, world, micro_batch) -> None:
    metrics = _train_metrics(cfg, state, total_steps, epoch_steps, window, bad_ids, index,
                             lr=scheduler.get_last_lr()[0])
    evaluate_now = _eval_due(cfg, state, total_steps)
    checkpoint_now = state.step % cfg.checkpoint.every_n_steps == 0 or state.step >= total_steps
    if evaluate_now or checkpoint_now:
        sync_buffers(model)
    if evaluate_now:
        metrics.update(evaluate(model, index, cfg, rank, world, micro_batch))
    if rank == 0:
        console(progress_line(metrics, total_steps, cfg.train.epochs))
    if not checkpoint_now:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if rank == 0:  # DDP keeps the ranks identical: one copy of the state is the whole state
            checkpoint.save(tmp, model=model, optimizer=optimizer, scheduler=scheduler, state=state,
                            classes=index.classes, job_yaml=dump_yaml(cfg))
            ckpt = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=ckpt)


def _train_metrics(cfg, state, total_steps, epoch_steps, window, bad_ids, index, lr) -> dict:
    stats = torch.tensor([float(window.loss_sum), float(window.loss_count)], dtype=torch.float64,
                         device=ray.train.torch.get_device())
    _all_reduce_sum(stats)
    bad = _union_across_ranks(bad_ids)
    if len(bad) > cfg.data.max_bad_samples:
        names = describe_samples(index.train, list(bad)[:20])
        raise BadSampleError(f"{len(bad)} undecodable images exceed data.max_bad_samples="
                             f"{cfg.data.max_bad_samples}: {names}")
    elapsed = window.elapsed()
    samples_per_s = throughput(window.steps * cfg.train.global_batch_size, elapsed)
    return {
        "step": state.step,
        "epoch": state.step / epoch_steps,
        "loss": stats[0].item() / max(stats[1].item(), 1.0),
        "lr": lr,
        "samples_per_s": samples_per_s,
        "data_wait_frac": data_wait_fraction(window.data_wait_s, elapsed),
        "eta_s": (total_steps - state.step) * cfg.train.global_batch_size / max(samples_per_s, 1e-9),
        "samples_seen": state.samples_seen,
        "bad_samples": len(bad),
        "world_size": state.world_size,
    }


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

