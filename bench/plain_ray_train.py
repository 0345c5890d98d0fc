"""The baseline of bench/vs_ray_train.py: the demo image job written as a plain Ray Train script, the way
Ray's "Get started with PyTorch" guide teaches it — a torch Dataset and DataLoader (with loader worker
processes) inside each Ray Train worker, `prepare_data_loader`, `prepare_model`, and `ray.train.report` with a
`torch.save` checkpoint every epoch — with the two settings a careful user adds (the default, "careful"): the
loader's worker processes kept between epochs (`persistent_workers=True`: no new process and no re-import
per epoch) and validation batches of 100. `--simple` runs the guide's version as written (new loader
processes every epoch, validation batches as large as the training ones).

Same job as jobs/configs/demo_images.yaml: the same model builder (behemoth's regnet_tiny_cifar, a plain torch
module), the same PNG folders, the same preprocessing (fit to 32 px, pad-4 random crop, flip, normalise with
mean 0.5 / std 0.25), 2 workers over gloo, one torch thread each, global batch 64, SGD (momentum 0.9,
Nesterov, weight decay 5e-4, lr 0.1, 20 warm-up steps then cosine to 0), 8 epochs, validation accuracy after
every epoch.

    .venv/bin/python bench/plain_ray_train.py [--root data/demo_images] [--epochs 8] [--loader-workers 1] [--simple]

Prints one JSON line: val_accuracy, the end of the first training step (time.time(), and in seconds from
this process's start) and the steps run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path


def process_start() -> float:
    """This process's start (Linux /proc), so the time to the first step includes the interpreter and imports."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # starttime counts ticks on CLOCK_BOOTTIME (/proc/stat's btime is whole seconds: up to 1 s off)
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK"))


STARTED = process_start()

import numpy as np
import ray.train
import ray.train.torch
import torch
from PIL import Image
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))


class PngFolder(torch.utils.data.Dataset):
    """ROOT/<class>/<image>.png, classes in sorted order (torchvision's ImageFolder layout)."""

    def __init__(self, root: Path, train: bool, size: int = 32, pad: int = 4):
        # (not `classes`: cloudpickle would then ship the `torch.classes` module with train_func, and fail)
        self.class_names = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [(str(f), i) for i, c in enumerate(self.class_names) for f in sorted((root / c).iterdir())]
        self.train, self.size, self.pad = train, size, pad

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        img = Image.open(path).convert("RGB")
        if img.size != (self.size, self.size):
            img = img.resize((self.size, self.size), Image.BILINEAR)
        pixels = np.asarray(img, dtype=np.uint8)
        if self.train:
            p = self.pad
            padded = np.pad(pixels, ((p, p), (p, p), (0, 0)))
            top, left = np.random.randint(0, 2 * p + 1, size=2)
            pixels = padded[top:top + self.size, left:left + self.size]
            if np.random.rand() < 0.5:
                pixels = pixels[:, ::-1]
        x = (pixels.transpose(2, 0, 1).astype(np.float32) / 255.0 - 0.5) / 0.25
        return torch.from_numpy(x), label


def train_func(config: dict) -> None:
    from behemoth.models.registry import build_model

    torch.set_num_threads(1)
    root = Path(config["root"])
    train_set, val_set = PngFolder(root / "train", train=True), PngFolder(root / "val", train=False)
    per_worker = config["global_batch"] // ray.train.get_context().get_world_size()
    careful = not config["simple"]
    loader_args = {"num_workers": config["loader_workers"],
                   "persistent_workers": careful and config["loader_workers"] > 0}
    train_loader = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(train_set, shuffle=True, drop_last=True, batch_size=per_worker, **loader_args))
    val_loader = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(val_set, batch_size=100 if careful else per_worker, **loader_args))

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(build_model("regnet_tiny_cifar", len(train_set.class_names)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    total, warmup = config["epochs"] * len(train_loader), 20
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup else
                                                  0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))
    rank0 = ray.train.get_context().get_world_rank() == 0
    first_step_at, steps = None, 0
    for epoch in range(config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        model.train()
        for images, labels in train_loader:
            loss = torch.nn.functional.cross_entropy(model(images).logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            steps += 1
            if first_step_at is None:
                first_step_at = time.time()
        model.eval()
        correct, count = torch.zeros(()), torch.zeros(())
        with torch.no_grad():
            for images, labels in val_loader:
                correct += (model(images).logits.argmax(1) == labels).sum()
                count += len(labels)
        torch.distributed.all_reduce(correct)
        torch.distributed.all_reduce(count)
        metrics = {"epoch": epoch + 1, "loss": loss.item(), "val_accuracy": (correct / count).item(),
                   "first_step_at": first_step_at, "steps": steps}
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if rank0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, os.path.join(tmp, "checkpoint.pt"))
                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=str(REPO / "data" / "demo_images"))
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--loader-workers", type=int, default=1, help="DataLoader worker processes per Ray worker")
    p.add_argument("--storage", default=None, help="Ray Train storage path (default: a temporary folder)")
    p.add_argument("--simple", action="store_true", help="the guide's loaders as written: new loader processes "
                   "every epoch, validation batches of the training batch size")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="plain-ray-train-") as tmp:
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"root": str(Path(args.root).resolve()), "epochs": args.epochs, "global_batch": 64,
                               "loader_workers": args.loader_workers, "simple": args.simple},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(name="plain", storage_path=args.storage or tmp,
                                 checkpoint_config=CheckpointConfig(num_to_keep=3)),
        )
        result = trainer.fit()
    m = result.metrics
    print(json.dumps({"val_accuracy": m["val_accuracy"], "first_step_s": m["first_step_at"] - STARTED,
                      "first_step_at": m["first_step_at"], "steps": m["steps"]}))


if __name__ == "__main__":
    main()
