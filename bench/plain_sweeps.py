"""The baselines of bench/sweep_vs_tune.py: the demo sweep (jobs/configs/sweep_demo.yaml) written as the two plain
scripts a careful user would write instead of behemoth.

  --host tune    Ray Tune alone, Tune's PyTorch tutorial pattern: the training loop in the trial's function,
                 `tune.report(metrics, checkpoint=...)` after every epoch, `tune.get_checkpoint()` to resume;
                 each trial holds 1 CPU.
  --host train   Ray Tune + Ray Train, as Ray 2.60's docs show for Train V2: a Tune function per trial that
                 runs a TorchTrainer (1 worker) of the same loop, `ray.train.report`, and Ray's
                 TuneReportCallback; the trial's function holds no CPU (Tune wants a request: its memory),
                 its worker 1.
  --workers 2    (train only) each trial's TorchTrainer on 2 workers, global batch split between them.

Both: the same grid (lr 0.02 / 0.1 / 0.5 x global batch 32 / 64), 4 epochs, ASHA on val_accuracy (epoch rungs,
grace 1, reduction factor 2), 2 trials at once on a 2-core machine, Tune's checkpoints kept 2 per trial; and
the same job as behemoth's trials: behemoth's model builder (regnet_tiny_cifar, a transformers RegNet), the same
PNG folders decoded by a torch DataLoader with one loader process kept between epochs (persistent_workers:
the careful setting), pad-4 random crop and flip, mean 0.5 / std 0.25, one torch thread, SGD (momentum 0.9,
Nesterov, weight decay 5e-4 on the weights only, as behemoth's recipe), 20 warm-up steps then cosine to 0,
validation accuracy over the whole val set after every epoch.

    .venv/bin/python bench/plain_sweeps.py --host tune|train [--epochs 4] [--seed 0] [--workers 1]

Prints one JSON line: the best trial's lr, batch and val_accuracy, and the trials.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "platform"))

LRS, BATCHES = [0.02, 0.1, 0.5], [32, 64]


def train_loop(config: dict) -> None:
    """One trial's training: under Tune alone (config["host"] == "tune") or in a Ray Train worker."""
    import ray.train
    import torch
    from behemoth.models.registry import build_model
    from plain_ray_train import PngFolder
    from ray import tune

    in_train = config["host"] == "train"
    report, latest = (ray.train.report, ray.train.get_checkpoint) if in_train else (tune.report, tune.get_checkpoint)
    world = ray.train.get_context().get_world_size() if in_train else 1
    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])
    root = Path(config["root"])
    train_set, val_set = PngFolder(root / "train", train=True), PngFolder(root / "val", train=False)
    loader = {"num_workers": 1, "persistent_workers": True}
    train_loader = torch.utils.data.DataLoader(train_set, shuffle=True, drop_last=True,
                                               batch_size=config["batch"] // world, **loader)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=100, **loader)
    model = build_model("regnet_tiny_cifar", len(train_set.class_names))
    if in_train:
        train_loader = ray.train.torch.prepare_data_loader(train_loader)
        val_loader = ray.train.torch.prepare_data_loader(val_loader)
        model = ray.train.torch.prepare_model(model)
    decay = [p for p in model.parameters() if p.ndim > 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                                 {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}],
                                lr=config["lr"], momentum=0.9, nesterov=True)
    total, warmup = config["epochs"] * len(train_loader), 20
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup else
                                                  0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))
    start = 0
    if (ckpt := latest()) is not None:  # a restarted trial resumes from its last checkpoint
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = state["epoch"]
    for epoch in range(start, config["epochs"]):
        if in_train and world > 1:
            train_loader.sampler.set_epoch(epoch)
        model.train()
        for images, labels in train_loader:
            loss = torch.nn.functional.cross_entropy(model(images).logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        metrics = _evaluated(model, val_loader, world, epoch, loss)
        with tempfile.TemporaryDirectory() as folder:  # Tune / Ray Train copy it into the trial's storage
            rank0 = not in_train or ray.train.get_context().get_world_rank() == 0
            saved = _saved(folder, model, optimizer, scheduler, epoch, tune.Checkpoint if not in_train else None)
            report(metrics, checkpoint=saved if rank0 else None)


def _evaluated(model, val_loader, world: int, epoch: int, loss) -> dict:
    import torch

    model.eval()
    correct, count = torch.zeros(()), torch.zeros(())
    with torch.no_grad():
        for images, labels in val_loader:
            correct += (model(images).logits.argmax(1) == labels).sum()
            count += len(labels)
    if world > 1:
        torch.distributed.all_reduce(correct)
        torch.distributed.all_reduce(count)
    return {"epoch": epoch + 1, "loss": loss.item(), "val_accuracy": (correct / count).item()}


def _saved(folder: str, model, optimizer, scheduler, epoch: int, kind=None):
    """The trial's state in `folder`, as a checkpoint of `kind` (Tune's class for tune.report; Ray Train's)."""
    import ray.train
    import torch

    inner = getattr(model, "module", model)
    torch.save({"model": inner.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch + 1}, os.path.join(folder, "state.pt"))
    return (kind or ray.train.Checkpoint).from_directory(folder)


def train_driver(config: dict) -> None:
    """Tune + Train: the trial's function runs a TorchTrainer of the loop; Ray's callback reports to Tune."""
    from ray import tune
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    trainer = TorchTrainer(
        train_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=config["workers"], resources_per_worker={"CPU": 1 / config["workers"]}),
        run_config=RunConfig(name=tune.get_context().get_trial_id(), storage_path=config["storage"],
                             checkpoint_config=CheckpointConfig(num_to_keep=2), callbacks=[TuneReportCallback()]))
    trainer.fit()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", choices=["tune", "train"], required=True)
    p.add_argument("--root", default=str(REPO / "data" / "demo_images"))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="(--host train) workers per trial")
    args = p.parse_args()
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    ray.init(logging_level="warning")  # as users start it: with the dashboard (Ray Train's placement-group
    # cleaner needs its state API to free the workers of a trial that ASHA stops)
    with tempfile.TemporaryDirectory(prefix="plain-sweep-") as storage:
        space = {"lr": tune.grid_search(LRS), "batch": tune.grid_search(BATCHES), "host": args.host,
                 "root": str(Path(args.root).resolve()), "epochs": args.epochs, "seed": args.seed,
                 "workers": args.workers, "storage": storage}
        fn = tune.with_resources(train_loop if args.host == "tune" else train_driver,
                                 {"CPU": 1} if args.host == "tune" else {"CPU": 0, "memory": 512 * 2**20})
        tuner = tune.Tuner(
            fn, param_space=space,
            tune_config=tune.TuneConfig(metric="val_accuracy", mode="max", max_concurrent_trials=2,
                                        scheduler=ASHAScheduler(time_attr="epoch", max_t=args.epochs,
                                                                grace_period=1, reduction_factor=2)),
            run_config=tune.RunConfig(name="plain", storage_path=storage, verbose=0,
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=2)))
        grid = tuner.fit()
        best = grid.get_best_result()
        trials = [{"lr": r.config["lr"], "batch": r.config["batch"], "val_accuracy": r.metrics.get("val_accuracy"),
                   "epoch": r.metrics.get("epoch")} for r in grid]
    print(json.dumps({"best_lr": best.config["lr"], "best_batch": best.config["batch"],
                      "best_val_accuracy": best.metrics["val_accuracy"], "trials": trials}))


if __name__ == "__main__":
    main()
