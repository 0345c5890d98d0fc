"""Two real processes, a real gloo process group, behemoth's own training step, hooks, sharding and
checkpoint code, and no Ray: what the speed switches do to the numbers, measured against plain DDP.

`run(rank, world, port, out)` runs every scenario in one process group (starting processes costs seconds)
and each rank saves {scenario: result or error text} to OUT/rank<r>.pt for the tests to check.
"""

from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from behemoth.storage import checkpoint
from behemoth.checkpoints import live_state
from behemoth.worker import parallel
from behemoth.storage.checkpoint import TrainState
from behemoth.config import JobConfig
from behemoth.worker.loop import train_step
from behemoth.worker.precision import grad_scaler

GLOBAL_BATCH, STEPS, FEATURES, CLASSES = 32, 6, 48, 10
CPU = torch.device("cpu")


class ToyTask:
    """Classification of fixed random data: the loss interface behemoth's train_step calls."""

    def loss_items(self, batch):  # the Task contract's default: each micro-batch's mean weighs the same
        return None

    def loss(self, model, batch):
        logits = model(batch["x"])
        return F.cross_entropy(logits, batch["y"]), torch.tensor(float(len(batch["y"])))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))


def global_batches(steps: int = STEPS):
    """The first `steps` global batches of one fixed stream (labels from a fixed random linear map)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    x = torch.randn(16, GLOBAL_BATCH, FEATURES, generator=g)[:steps]
    return x, (x @ w).argmax(-1)


def config(**train) -> JobConfig:
    cfg = JobConfig()
    cfg.train.optimizer, cfg.train.lr, cfg.train.momentum, cfg.train.weight_decay = "sgd", 0.1, 0.9, 0.0
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def train(model, cfg: JobConfig, rank: int, world: int, accum: int = 1, steps: int = STEPS, start: int = 0,
          optimizer=None, scheduler=None):
    """behemoth's train_step over this rank's share of each global batch, in `accum` micro-batches.
    Returns (per-step global mean loss, optimizer, scheduler)."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum)
    scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scaler, task = grad_scaler(CPU, cfg.train.precision), ToyTask()
    x, y = global_batches(start + steps)
    share = GLOBAL_BATCH // world
    micro = share // accum
    losses = []
    for step in range(start, start + steps):
        xs, ys = x[step, rank * share:(rank + 1) * share], y[step, rank * share:(rank + 1) * share]
        batches = [{"x": xs[i:i + micro], "y": ys[i:i + micro]} for i in range(0, share, micro)]
        loss_sum, n, _ = train_step(model, optimizer, scheduler, scaler, batches, cfg, task, CPU)
        total = torch.stack([loss_sum.detach(), torch.as_tensor(n, dtype=torch.float32)])
        dist.all_reduce(total)
        losses.append((total[0] / total[1]).item())
    return losses, optimizer, scheduler


def full_params(model) -> dict:
    """Every parameter whole, on every rank (FSDP's shards gathered)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if parallel.is_sharded(model):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in parallel.unwrap(model).state_dict().items()}


def ddp(bucket_cap_mb: float = 25.0) -> DDP:
    return DDP(make_model(), bucket_cap_mb=bucket_cap_mb)


def first_step_grads(cfg: JobConfig, rank: int, world: int, warm_steps: int = 0) -> dict:
    """The all-reduced gradients of one step (after warm_steps of training) with cfg's compression."""
    model = ddp(bucket_cap_mb=0.005)  # several gradient buckets, as in a real model
    compression = parallel.register_compression(model, cfg.train)
    if warm_steps:
        train(model, cfg, rank, world, steps=warm_steps)
    x, y = global_batches(warm_steps + 1)
    share = GLOBAL_BATCH // world
    model.zero_grad()
    F.cross_entropy(model(x[warm_steps, rank * share:(rank + 1) * share]),
                    y[warm_steps, rank * share:(rank + 1) * share]).backward()
    del compression
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


# ---------------------------------------------------------------------------------------------------------
# Scenarios: each returns plain data (tensors, floats) for the tests


def baseline(rank, world, out):
    model = ddp()
    losses, _, _ = train(model, config(), rank, world)
    return {"losses": losses, "params": full_params(model)}


def accumulation(rank, world, out):
    model = ddp()
    losses, _, _ = train(model, config(), rank, world, accum=2)
    return {"losses": losses, "params": full_params(model)}


def compression(kind, rank_r=2):
    def scenario(rank, world, out):
        cfg = config(grad_compression=kind, powersgd_rank=rank_r, powersgd_warmup_steps=2)
        model = ddp(bucket_cap_mb=0.005)
        parallel.register_compression(model, cfg.train)
        losses, _, _ = train(model, cfg, rank, world)
        # PowerSGD compresses from its 3rd step on: compare that step's gradient with plain all-reduce's
        grads = first_step_grads(cfg, rank, world, warm_steps=2)
        exact = first_step_grads(config(), rank, world, warm_steps=2)
        return {"losses": losses, "params": full_params(model), "grads": grads, "exact_grads": exact}

    return scenario


def bf16_autocast(rank, world, out):
    model = ddp()
    losses, _, _ = train(model, config(precision="bf16"), rank, world)
    return {"losses": losses, "params": full_params(model)}


def powersgd_restore(rank, world, out):
    """Train 4 steps with PowerSGD, checkpoint (behemoth's save/load), train 4 more; then a fresh process
    state restored from the checkpoint trains the same 4. Also a restore without the compression state."""
    cfg = config(grad_compression="powersgd", powersgd_rank=1, powersgd_warmup_steps=2)
    model = ddp(bucket_cap_mb=0.005)
    hook = parallel.register_compression(model, cfg.train)
    _, opt, sched = train(model, cfg, rank, world, steps=4)
    states = [None] * world if rank == 0 else None
    dist.gather_object(hook.to_bytes(), states, dst=0)
    folder = os.path.join(out, "powersgd_ckpt")
    if rank == 0:
        live_state.save(folder, model=model, optimizer=opt, scheduler=sched, state=TrainState(step=4),
                        task_files={}, job_yaml="", hook_states=states)
    dist.barrier()
    train(model, cfg, rank, world, start=4, steps=4, optimizer=opt, scheduler=sched)
    straight = full_params(model)
    results = {"straight": straight}
    for name, restore_hook in (("restored", True), ("without_state", False)):
        model = ddp(bucket_cap_mb=0.005)
        hook = parallel.register_compression(model, cfg.train)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        live_state.load(folder, model=model, optimizer=opt, scheduler=sched, hook_state=hook if restore_hook else None)
        if not restore_hook:
            hook.state.iter = 4  # the same schedule (compressing), only the error feedback and Q are new
        train(model, cfg, rank, world, start=4, steps=4, optimizer=opt, scheduler=sched)
        results[name] = full_params(model)
    return results


def fsdp(strategy):
    def scenario(rank, world, out):
        cfg = config()
        model = parallel.shard(make_model(), reshard_after_forward=strategy == "fsdp_full")
        losses, opt, sched = train(model, cfg, rank, world, steps=3, accum=2)
        folder = os.path.join(out, f"{strategy}_ckpt")
        snap = live_state.snapshot(model=model, optimizer=opt, scheduler=sched, state=TrainState(step=3),
                                   task_files={}, job_yaml="")  # collective: every rank gathers
        if rank == 0:
            checkpoint.write(folder, snap)
        dist.barrier()
        more, _, _ = train(model, cfg, rank, world, start=3, steps=3, accum=2, optimizer=opt, scheduler=sched)
        final = full_params(model)
        fresh = parallel.shard(make_model(), reshard_after_forward=strategy == "fsdp_full")
        opt2 = torch.optim.SGD(fresh.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum)
        sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
        step = live_state.load(folder, model=fresh, optimizer=opt2, scheduler=sched2).step
        train(fresh, cfg, rank, world, start=3, steps=3, accum=2, optimizer=opt2, scheduler=sched2)
        local = sum(p.to_local().numel() for p in model.parameters())
        return {"losses": losses + more, "params": final, "restored": full_params(fresh), "restored_step": step,
                "local_numel": local, "full_numel": sum(v.numel() for v in final.values())}

    return scenario


def layouts(rank, world, out):
    """Both checkpoint layouts under both strategies: FSDP and DDP each train 3 steps and save (FSDP sharded
    with DCP and full; DDP full), then fresh models of either strategy restore each checkpoint and train 3
    more. Returns the weights each ends on (and a control restoring only the weights: momentum lost)."""
    from behemoth.checkpoints.sharded import ShardedWriter

    cfg = config()

    def fresh(strategy):
        model = parallel.shard(make_model(), reshard_after_forward=True) if strategy == "fsdp" else ddp()
        opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def save_sharded(model, opt, sched, folder):
        writer = ShardedWriter(rank)
        small = checkpoint.Snapshot(*live_state.extras(scheduler=sched, state=TrainState(step=3), task_files={},
                                                          job_yaml=""), 3) if rank == 0 else None
        writer.commit(writer.start(model, opt, folder)[0], folder, small)

    results, folders = {}, {k: os.path.join(out, f"layout_{k}") for k in ("sharded", "fsdp_full", "ddp_full")}
    for strategy in ("fsdp", "ddp"):
        model, opt, sched = fresh(strategy)
        accum = 2 if strategy == "fsdp" else 1
        train(model, cfg, rank, world, steps=3, accum=accum, optimizer=opt, scheduler=sched)
        parts = dict(model=model, optimizer=opt, scheduler=sched, state=TrainState(step=3), task_files={}, job_yaml="")
        if strategy == "fsdp":
            save_sharded(model, opt, sched, folders["sharded"])
            snap = live_state.snapshot(**parts)  # collective: every rank gathers
            if rank == 0:
                checkpoint.write(folders["fsdp_full"], snap)
        elif rank == 0:
            live_state.save(folders["ddp_full"], **parts)
        dist.barrier()
        train(model, cfg, rank, world, start=3, steps=3, accum=accum, optimizer=opt, scheduler=sched)
        results[f"{strategy}_final"] = full_params(model)
    results["files"] = sorted(os.listdir(os.path.join(folders["sharded"], checkpoint.STATE_DIR)))
    for layout, strategy in (("sharded", "fsdp"), ("sharded", "ddp"), ("fsdp_full", "ddp"), ("ddp_full", "fsdp"),
                             ("sharded", "ddp_weights_only")):
        model, opt, sched = fresh(strategy.split("_")[0])
        weights_only = strategy.endswith("weights_only")
        step = live_state.load(folders[layout], model=model, optimizer=None if weights_only else opt,
                                  scheduler=sched).step
        train(model, cfg, rank, world, start=step, steps=3, accum=2 if strategy == "fsdp" else 1, optimizer=opt,
              scheduler=sched)
        results[f"{layout}->{strategy}"] = full_params(model)
    return results


def fsdp_bf16(rank, world, out):
    """FSDP under precision bf16: what a layer computes with (the gathered parameters), and what is kept (the
    shards, their gradients, the optimizer state)."""
    cfg = config(precision="bf16", optimizer="adamw")
    model = make_model()
    computed_with = []
    model[2].register_forward_pre_hook(lambda module, args: computed_with.append(module.weight.dtype))
    model = parallel.shard(model, reshard_after_forward=True, precision="bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, _, _ = train(model, cfg, rank, world, steps=2, optimizer=optimizer)
    return {"losses": losses, "computed_with": sorted({str(d) for d in computed_with}),
            "kept": sorted({str(p.dtype) for p in model.parameters()}),
            "grads": sorted({str(p.grad.dtype) for p in model.parameters()}),
            "optimizer_state": sorted({str(v.dtype) for st in optimizer.state.values() for k, v in st.items()
                                       if k != "step"})}


SCENARIOS = {
    "baseline": baseline,
    "accumulation": accumulation,
    "fp16": compression("fp16"),
    "bf16": compression("bf16"),
    "powersgd": compression("powersgd"),
    "bf16_autocast": bf16_autocast,
    "powersgd_restore": powersgd_restore,
    "fsdp_grad_op": fsdp("fsdp_grad_op"),
    "fsdp_full": fsdp("fsdp_full"),
    "layouts": layouts,
    "fsdp_bf16": fsdp_bf16,
}


def run(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    results = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = scenario(rank, world, out)
        except Exception:  # noqa: BLE001 - the test names the scenario and shows this traceback
            results[name] = traceback.format_exc()
        dist.barrier()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()
