"""Benchmark P2: end-to-end images/s — behemoth (decoded cache, or Ray Data decode + augment -> 1 Ray Train
worker) vs torch.utils.data.DataLoader(num_workers=2, persistent_workers=True) feeding a plain loop.

Both use the same augmentation code (behemoth.data.image.image_batches: pad + random crop + flip seeded per sample,
normalise; the DataLoader's processes decode every PNG with transform_batch, as a user's script does), train
the same model (regnet_tiny_cifar) with the same optimizer (behemoth's SGD recipe: momentum 0.9, Nesterov, weight
decay 5e-4 on the weights; the plain loop's learning rate constant, behemoth's on its schedule) at the same
batch size. Both are timed as one continuous span over the same steps
after the same warm-up: behemoth from its first report to its last by rank 0's clock (every step, report and
console line in between; before the first report: worker start, first tasks), the plain loop from its first
measured step to its last. Also printed: behemoth's data-wait fraction (the share of step time spent waiting for
a batch), and for both the whole machine's CPU time per image over the same span (from /proc/stat: every process,
Ray's included) and the cores it kept busy.

Torch threads (--threads): `1` (the default): one torch thread on both sides. `best` gives each side the machine
as its user would: behemoth with the decoded cache runs no decode process, so its one worker takes every core
(scaling.cpus_per_worker and torch_threads = the machine's CPUs; with --cache none its worker keeps 1 CPU and 1
thread, the rest going to Ray Data's decode tasks); the plain loop is run with 1 torch thread and with one per
core (its two loader processes decode beside it either way), and the faster of the two in each repeat is the
baseline. Runs alternate, --repeats of each.

    .venv/bin/python bench/ingest_vs_dataloader.py [--repeats 5] [--threads 1|best] [--cache decoded|none]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import REPO, MachineCpu, read_metrics, spread, steady_steps_per_s


class ImageRows:
    """A map-style torch Dataset over behemoth's image index: one transform_batch call per sample. Its keys are
    (epoch, sample) pairs, so that one DataLoader with persistent loader processes serves every epoch."""

    def __init__(self, table, cfg):
        self.rows, self.cfg = table.to_pydict(), cfg

    def __len__(self):
        return len(self.rows["path"])

    def __getitem__(self, key):
        import numpy as np

        from behemoth.data.image.image_batches import transform_batch

        epoch, i = key
        batch = {k: np.asarray([v[i]]) for k, v in self.rows.items()}
        out = transform_batch(batch, cfg=self.cfg, seed=0, epoch=epoch, train=True)
        return out["image"][0], int(out["label"][0])


class EpochShuffle:
    """A new permutation each epoch (set_epoch), yielding (epoch, sample) keys."""

    def __init__(self, n: int):
        self.n, self.epoch = n, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        import torch

        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        return iter([(self.epoch, int(i)) for i in order])


def plain_images_per_s(index, cfg, batch: int, steps: int, warmup: int,
                       threads: int) -> tuple[float, float, float]:
    """(images/s, wall time of the first measured step, of the last) of the DataLoader loop."""
    import torch
    import torch.nn.functional as F

    from behemoth.config import TrainConfig
    from behemoth.models.registry import build_model
    from behemoth.worker.optim import build_optimizer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model("regnet_tiny_cifar", len(index.classes))
    opt = build_optimizer(model, TrainConfig(lr=0.05))  # the job's recipe (behemoth_job: train.lr 0.05)
    step, epoch = 0, 0
    # persistent_workers: the loader processes (and their imports) stay from one epoch to the next, as a careful
    # user's script keeps them (issue 37's careful baseline)
    sampler = EpochShuffle(len(index.train))
    loader = torch.utils.data.DataLoader(ImageRows(index.train, cfg), batch_size=batch, sampler=sampler,
                                         num_workers=2, drop_last=True, persistent_workers=True)
    while step < warmup + steps:
        sampler.epoch = epoch
        for images, labels in loader:
            if step == warmup:
                started, started_at = time.perf_counter(), time.time()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(pixel_values=images).logits, labels).backward()
            opt.step()
            step += 1
            if step == warmup + steps:
                break
        epoch += 1
    return steps * batch / (time.perf_counter() - started), started_at, time.time()


def behemoth_job(root: Path, storage: Path, run: str, batch: int, steps: int, log_every: int, cache: str,
                 cpus: int = 1) -> dict:
    return {
        "data": {"kind": "image_folder", "root": str(root), "image_size": 32, "cpus_per_task": 0.25,
                 "prefetch_batches": 2, "cache": cache},
        "model": {"name": "regnet_tiny_cifar"},
        "train": {"epochs": 100, "max_steps": steps, "global_batch_size": batch, "lr": 0.05, "log_every": log_every},
        "scaling": {"num_workers": 1, "cpus_per_worker": float(cpus), "torch_threads": cpus},
        "checkpoint": {"every_n_steps": 10_000, "storage_path": str(storage), "run_name": run},
        "eval": {"per_epoch": False},
        "failure": {"max_failures": 0},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--cache", choices=["decoded", "none"], default="decoded",
                   help="behemoth's data.cache: decoded (built once before the repeats: the epochs after a data "
                        "set's first use) or none (Ray Data decodes every epoch)")
    p.add_argument("--threads", choices=["1", "best"], default="1",
                   help="1: one torch thread both sides; best: each side uses the machine as its user would (see above)")
    p.add_argument("--data", default=str(REPO / "data" / "demo_images"), help="an ImageFolder (made if missing)")
    args = p.parse_args()
    machine = os.cpu_count() or 1
    ours_cpus = machine if args.threads == "best" and args.cache == "decoded" else 1
    plain_threads = sorted({1, machine}) if args.threads == "best" else [1]

    from behemoth.job import config_from_dict
    from behemoth.data.image.images import ImageData
    from behemoth.data.image.images import build_index
    from behemoth.data.image.synth import write_synth_images
    from behemoth.driver.run.trainer import train

    root = Path(args.data)
    if not (root / "train").is_dir():
        write_synth_images(root, classes=10, per_class=200, val_per_class=50, size=32, seed=0)
    storage = Path(tempfile.mkdtemp(prefix="bench-p2-"))
    cfg = ImageData(kind="image_folder", root=str(root), image_size=32)
    index = build_index(cfg)
    ours, plain, waits, cpu = [], [], [], {"behemoth": [], "plain": []}
    cores, by_threads = {"behemoth": [], "plain": []}, {t: [] for t in plain_threads}
    meter = MachineCpu()
    if args.cache == "decoded":  # built once, outside every measured span (as a run after the first finds it)
        import dataclasses

        from behemoth.data.image import image_cache_build
        from behemoth.data.image.image_cache import decide_cache

        plans, why = decide_cache(dataclasses.replace(cfg, cache="decoded"), index)
        for split, plan in plans.items():
            image_cache_build.open_or_build(plan, getattr(index, split), workers=False, log=print)
        print(f"data cache: {why}")

    def account(path: str, images: int, t0: float, t1: float) -> str:
        seconds = meter.seconds(t0, t1)
        cpu[path].append(seconds / images * 1e3)
        cores[path].append(seconds / (t1 - t0))
        return f"{cpu[path][-1]:.2f} ms CPU/image, {cores[path][-1]:.2f} cores busy"
    for r in range(args.repeats):
        job = behemoth_job(root, storage, f"p2_{r}", args.batch, args.steps, args.log_every, args.cache, ours_cpus)
        summary = train(config_from_dict(job))
        reports = [m for m in read_metrics(Path(summary.run_dir)) if "samples_per_s" in m]
        ours.append(steady_steps_per_s(reports, args.batch) * args.batch)
        waits.append(statistics.mean(m["data_wait_frac"] for m in reports[1:]))
        ours_cpu = account("behemoth", (reports[-1]["step"] - reports[0]["step"]) * args.batch,
                           reports[0]["wall_time"], reports[-1]["wall_time"])
        runs = {}
        for threads in plain_threads:
            runs[threads] = plain_images_per_s(index, cfg, args.batch, args.steps - args.log_every, args.log_every,
                                               threads)
            by_threads[threads].append(runs[threads][0])
        best = max(runs, key=lambda t: runs[t][0])
        rate, t0, t1 = runs[best]
        plain.append(rate)
        plain_cpu = account("plain", (args.steps - args.log_every) * args.batch, t0, t1)
        others = "".join(f", {t} thread(s) {runs[t][0]:.0f}" for t in plain_threads if t != best)
        print(f"repeat {r}: behemoth {ours[-1]:.0f} images/s (data-wait {waits[-1]:.0%}; {ours_cpu}), "
              f"DataLoader {plain[-1]:.0f} images/s with {best} torch thread(s) ({plain_cpu}{others})", flush=True)
    meter.stop()
    ratios = [o / b for o, b in zip(ours, plain)]
    print(f"{index.train.num_rows} PNGs 32x32, regnet_tiny_cifar, batch {args.batch}, "
          f"{args.steps - args.log_every} measured steps, {args.repeats} repeats alternating, {machine} CPUs")
    path = ("decoded cache: crop, flip, normalise" if args.cache == "decoded"
            else "Ray Data, 0.25-CPU tasks")
    print(f"  behemoth ({path} -> 1 worker of {ours_cpus} CPU(s), {ours_cpus} torch thread(s)): "
          f"{spread(ours, '{:.0f}')} images/s, data-wait {spread(waits, '{:.0%}')}")
    for threads, rates in by_threads.items():
        print(f"  DataLoader(num_workers=2) -> plain loop, {threads} torch thread(s): {spread(rates, '{:.0f}')} "
              f"images/s")
    print(f"  the baseline (the faster plain loop of each repeat): {spread(plain, '{:.0f}')} images/s")
    print(f"  ratio behemoth / DataLoader: {spread(ratios)}")
    for path, name in (("behemoth", "behemoth"), ("plain", "DataLoader")):
        print(f"  whole machine, {name}: {spread(cpu[path], '{:.2f}')} ms CPU per image, "
              f"{spread(cores[path], '{:.2f}')} cores busy")


if __name__ == "__main__":
    main()
