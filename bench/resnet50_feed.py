"""Benchmark P6 (the GPU tier's ResNet-50 figure): does behemoth's input pipeline keep a GPU training ResNet-50
at 224 px busy, fed from ImageNet-shaped JPEGs on the machine's CPUs?

Three sides, one after the other, each trained for --steps steps of --batch images (bf16 autocast over fp32
weights, SGD with momentum; on a GPU channels_last and cuDNN's benchmark mode, as behemoth sets them) and timed
from step --warmup on:

- synthetic: the model alone on one uint8 batch resident on the GPU, normalised in the step as behemoth does:
  the ceiling, with no input pipeline at all;
- behemoth: `behemoth train` of a job on the JPEG folder (random_resized_crop at 224, decoded every epoch, one
  GPU worker, Ray Data decode tasks on the other CPUs): its steady images/s from its reports;
- dataloader: the plain script a careful user writes: torch's DataLoader (a worker per remaining CPU,
  pin_memory, persistent workers) with PIL's random-resized-crop per image (bench/image_pipeline.py's plain
  transform), copied non-blocking, normalised on the GPU, the same model and optimizer.

Floors: behemoth >= 0.9 x synthetic (the pipeline keeps up) and behemoth >= 0.95 x dataloader (when the GPU
bounds both, the two are equal within run-to-run noise: a floor of 1.0 would be a coin toss; 5 % is the
tolerance); a figure under one exits 1, naming it.

    .venv/bin/python bench/resnet50_feed.py [--steps 120] [--batch 256]
    .venv/bin/python bench/resnet50_feed.py --tiny     # a dry run on a CPU: 64 px, a few steps, no floors

The images: bench/data_scaling.py's folder (600 synthetic 500x375 JPEGs of ~119 KB, each listed 20 times).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, run_behemoth, steady_steps_per_s  # noqa: F401  (puts platform/ on sys.path)
from data_scaling import photo_folder
from image_pipeline import Files, plain_transform
from ingest_vs_dataloader import EpochShuffle

DATALOADER_FLOOR = 0.95  # behemoth / the plain DataLoader script, with 5 % for noise (see the docstring)


def tiny_folder(root: Path) -> Path:
    if not (root / "val").is_dir():
        subprocess.run([sys.executable, "-m", "behemoth", "data", "synth-images", "--out", str(root), "--format",
                        "jpeg", "--size", "96x72", "--per-class", "8", "--val-per-class", "1"], cwd=REPO, check=True)
    return root


def plain_model(device, classes: int):
    """ResNet-50 as behemoth builds it, with the settings behemoth gives a GPU run, and its optimizer."""
    import torch

    from behemoth.models.resnet import resnet50

    torch.manual_seed(0)
    model = resnet50(classes).to(device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        model = model.to(memory_format=torch.channels_last)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def train_rate(device, classes: int, batches, steps: int, warmup: int, batch: int) -> float:
    """Images/s of `steps` steps after `warmup`, over uint8 NHWC batches (on the host or the device)."""
    import torch

    from behemoth.data.image.image_batches import normalise

    model, opt = plain_model(device, classes)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)
    half = torch.autocast(device.type, dtype=torch.bfloat16)
    it = iter(batches)
    for step in range(warmup + steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        images, labels = next(it)
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        x = normalise(images, torch.ones(len(images), dtype=torch.bool, device=device), mean, std,
                      channels_last=device.type == "cuda")
        opt.zero_grad(set_to_none=True)
        with half:
            loss = torch.nn.functional.cross_entropy(model(pixel_values=x).logits, labels)
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = steps * batch / (time.perf_counter() - started)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def synthetic_batches(device, batch: int, size: int, classes: int):
    import torch

    images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device=device)
    labels = torch.randint(0, classes, (batch,), device=device)
    while True:
        yield images, labels


def dataloader_batches(root: Path, batch: int, workers: int):
    import torch
    from torch.utils.data import DataLoader

    paths = sorted(str(p) for p in (root / "train").rglob("*.jpg"))
    names = sorted({Path(p).parent.name for p in paths})
    labels = [names.index(Path(p).parent.name) for p in paths]
    keys = EpochShuffle(len(paths))
    loader = DataLoader(Files(paths, labels, plain_transform), batch_size=batch, sampler=keys, drop_last=True,
                        num_workers=workers, persistent_workers=True, pin_memory=torch.cuda.is_available())
    while True:
        for images, labels_ in loader:
            yield images, torch.as_tensor(labels_)
        keys.epoch += 1


def behemoth_job(root: Path, storage: Path, size: int, batch: int, steps: int, gpu: bool) -> dict:
    # the worker's 2 CPUs and a decode task per remaining CPU (on a 2-CPU machine: half a CPU each, or the decode
    # tasks would never find one)
    worker_cpus, task_cpus = (2, 1.0) if (os.cpu_count() or 2) > 4 else (0.5, 0.5)
    return {
        "data": {"kind": "image_folder", "root": str(root), "image_size": size, "augment": "random_resized_crop",
                 "cache": "none", "cache_dir": str(storage / "cache"), "cpus_per_task": task_cpus,
                 "prefetch_batches": 4},
        "model": {"name": "resnet50"},
        "train": {"epochs": 1000, "max_steps": steps, "global_batch_size": batch, "optimizer": "sgd", "lr": 0.1,
                  "momentum": 0.9, "weight_decay": 1e-4, "precision": "bf16", "log_every": min(10, max(steps // 10, 1))},
        "scaling": {"num_workers": 1, "use_gpu": gpu, "cpus_per_worker": worker_cpus},
        "checkpoint": {"every_n_steps": 100_000, "keep": 1, "storage_path": str(storage), "run_name": "p6"},
        "eval": {"every_n_steps": None, "per_epoch": False},
        "failure": {"max_failures": 0},
        "tracking": {"report": False},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--tiny", action="store_true", help="a dry run on a CPU at toy sizes; floors not checked")
    args = p.parse_args()
    import torch

    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    # --tiny: ResNet-50's code paths at a size 2 CPU cores step through in about a second (64 px and batch 8 took
    # ~8 s a step there: the dry run ran for minutes)
    size = 32 if args.tiny else 224
    if args.tiny:
        args.steps, args.warmup, args.batch = 2, 1, 4
        root = tiny_folder(REPO / "data" / "bench_tiny_jpeg")
    else:
        root = photo_folder(REPO / "data" / "bench_scaling")
    classes = len([d for d in (root / "train").iterdir() if d.is_dir()])
    workers = max((os.cpu_count() or 2) - 2, 1)  # the training process and its copies keep two

    synthetic = train_rate(device, classes, synthetic_batches(device, args.batch, size, classes), args.steps,
                           args.warmup, args.batch)
    print(f"synthetic (GPU-resident batches, the ceiling): {synthetic:,.0f} images/s", flush=True)
    storage = Path(tempfile.mkdtemp(prefix="bench-p6-"))
    reports = run_behemoth(behemoth_job(root, storage, size, args.batch, args.warmup + args.steps, gpu))
    shutil.rmtree(storage, ignore_errors=True)
    ours = steady_steps_per_s([r for r in reports if r.get("step", 0) >= args.warmup], args.batch) * args.batch
    print(f"behemoth (1 GPU worker, Ray Data decode): {ours:,.0f} images/s; behemoth / synthetic: "
          f"{ours / synthetic:.3f}", flush=True)  # (the first ratio the moment it exists)
    plain = train_rate(device, classes, dataloader_batches(root, args.batch, workers), args.steps, args.warmup,
                       args.batch) if not args.tiny else train_rate(
        device, classes, dataloader_batches(root, args.batch, 1), args.steps, args.warmup, args.batch)
    print(f"plain DataLoader script ({workers if not args.tiny else 1} workers): {plain:,.0f} images/s", flush=True)
    print(f"ResNet-50 at {size} px, batch {args.batch}, bf16, {args.steps} timed steps, {os.cpu_count()} CPUs"
          f"{' (tiny: a dry run on a CPU)' if args.tiny else ''}")
    print(f"  behemoth / synthetic: {ours / synthetic:.3f} (floor 0.9); behemoth / dataloader: {ours / plain:.3f} "
          f"(floor {DATALOADER_FLOOR})")
    if args.tiny:
        print("  floors not checked: a dry run on a CPU at a toy size")
        return 0
    failed = [f"behemoth / synthetic {ours / synthetic:.3f} < 0.9"] if ours < 0.9 * synthetic else []
    failed += [f"behemoth / dataloader {ours / plain:.3f} < {DATALOADER_FLOOR}"] if ours < DATALOADER_FLOOR * plain else []
    print(f"  floors: {'FAILED: ' + '; '.join(failed) if failed else 'met'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
