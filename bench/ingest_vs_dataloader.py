"""Benchmark P2: end-to-end images/s — behemoth (Ray Data decode + augment -> 1 Ray Train worker) vs
torch.utils.data.DataLoader(num_workers=2) feeding a plain loop.

Both decode the same PNGs with the same code (behemoth.data.images.transform_batch: decode, pad + random
crop + flip seeded per sample, normalise), train the same model (regnet_tiny_cifar) with SGD at the same
batch size and one torch thread. Both are timed as one continuous span over the same steps after the same
warm-up: behemoth from its first report to its last by rank 0's clock (every step, report and console line
in between; before the first report: worker start, first tasks), the plain loop from its first measured
step to its last. Also printed: behemoth's data-wait fraction (the share of step time spent waiting for a batch), and for both
the whole machine's CPU time per image over the same span (from /proc/stat: every process, Ray's included) and
the cores it kept busy: on a machine whose cores are all busy, images/s is cores / CPU per image, so the CPU per
image of each path is what more cores would scale. Runs alternate, --repeats of each.

    .venv/bin/python bench/ingest_vs_dataloader.py [--repeats 5] [--steps 60] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import REPO, MachineCpu, read_metrics, spread, steady_steps_per_s


class ImageRows:
    """A map-style torch Dataset over behemoth's image index: one transform_batch call per sample."""

    def __init__(self, table, cfg, epoch: int):
        self.rows, self.cfg, self.epoch = table.to_pydict(), cfg, epoch

    def __len__(self):
        return len(self.rows["path"])

    def __getitem__(self, i):
        import numpy as np

        from behemoth.data.images import transform_batch

        batch = {k: np.asarray([v[i]]) for k, v in self.rows.items()}
        out = transform_batch(batch, cfg=self.cfg, seed=0, epoch=self.epoch, train=True)
        return out["image"][0], int(out["label"][0])


def plain_images_per_s(index, cfg, batch: int, steps: int, warmup: int) -> tuple[float, float, float]:
    """(images/s, wall time of the first measured step, of the last) of the DataLoader loop."""
    import torch
    import torch.nn.functional as F

    from behemoth.models.registry import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("regnet_tiny_cifar", len(index.classes))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step, epoch = 0, 0
    while step < warmup + steps:
        loader = torch.utils.data.DataLoader(ImageRows(index.train, cfg, epoch), batch_size=batch, shuffle=True,
                                             num_workers=2, drop_last=True,
                                             generator=torch.Generator().manual_seed(epoch))
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


def behemoth_job(root: Path, storage: Path, run: str, batch: int, steps: int, log_every: int, cache: str) -> dict:
    return {
        "data": {"kind": "image_folder", "root": str(root), "image_size": 32, "cpus_per_task": 0.25,
                 "prefetch_batches": 2, "cache": cache},
        "model": {"name": "regnet_tiny_cifar"},
        "train": {"epochs": 100, "max_steps": steps, "global_batch_size": batch, "lr": 0.05, "log_every": log_every},
        "scaling": {"num_workers": 1, "cpus_per_worker": 1.0, "torch_threads": 1},
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
    p.add_argument("--data", default=str(REPO / "data" / "demo_images"), help="an ImageFolder (made if missing)")
    args = p.parse_args()

    from behemoth.job import config_from_dict
    from behemoth.data.images import ImageData
    from behemoth.data.images import build_index
    from behemoth.data.synth import write_synth_images
    from behemoth.driver.trainer import train

    root = Path(args.data)
    if not (root / "train").is_dir():
        write_synth_images(root, classes=10, per_class=200, val_per_class=50, size=32, seed=0)
    storage = Path(tempfile.mkdtemp(prefix="bench-p2-"))
    cfg = ImageData(kind="image_folder", root=str(root), image_size=32)
    index = build_index(cfg)
    ours, plain, waits, cpu = [], [], [], {"behemoth": [], "plain": []}
    cores = {"behemoth": [], "plain": []}
    meter = MachineCpu()
    if args.cache == "decoded":  # built once, outside every measured span (as a run after the first finds it)
        import dataclasses

        from behemoth.data import image_cache
        from behemoth.tasks.image import decide_cache

        plans, why = decide_cache(dataclasses.replace(cfg, cache="decoded"), index)
        for split, plan in plans.items():
            image_cache.open_or_build(plan, getattr(index, split), cfg.image_column, workers=False, log=print)
        print(f"data cache: {why}")

    def account(path: str, images: int, t0: float, t1: float) -> str:
        seconds = meter.seconds(t0, t1)
        cpu[path].append(seconds / images * 1e3)
        cores[path].append(seconds / (t1 - t0))
        return f"{cpu[path][-1]:.2f} ms CPU/image, {cores[path][-1]:.2f} cores busy"
    for r in range(args.repeats):
        job = behemoth_job(root, storage, f"p2_{r}", args.batch, args.steps, args.log_every, args.cache)
        summary = train(config_from_dict(job))
        reports = [m for m in read_metrics(Path(summary.run_dir)) if "samples_per_s" in m]
        ours.append(steady_steps_per_s(reports, args.batch) * args.batch)
        waits.append(statistics.mean(m["data_wait_frac"] for m in reports[1:]))
        ours_cpu = account("behemoth", (reports[-1]["step"] - reports[0]["step"]) * args.batch,
                           reports[0]["wall_time"], reports[-1]["wall_time"])
        rate, t0, t1 = plain_images_per_s(index, cfg, args.batch, args.steps - args.log_every, args.log_every)
        plain.append(rate)
        plain_cpu = account("plain", (args.steps - args.log_every) * args.batch, t0, t1)
        print(f"repeat {r}: behemoth {ours[-1]:.0f} images/s (data-wait {waits[-1]:.0%}; {ours_cpu}), "
              f"DataLoader {plain[-1]:.0f} images/s ({plain_cpu})", flush=True)
    meter.stop()
    ratios = [o / b for o, b in zip(ours, plain)]
    print(f"{index.train.num_rows} PNGs 32x32, regnet_tiny_cifar, batch {args.batch}, 1 torch thread, "
          f"{args.steps - args.log_every} measured steps, {args.repeats} repeats alternating")
    path = ("decoded cache: crop, flip, normalise" if args.cache == "decoded"
            else "Ray Data, 0.25-CPU tasks")
    print(f"  behemoth ({path} -> 1 worker): {spread(ours, '{:.0f}')} images/s, "
          f"data-wait {spread(waits, '{:.0%}')}")
    print(f"  DataLoader(num_workers=2) -> plain loop:        {spread(plain, '{:.0f}')} images/s")
    print(f"  ratio behemoth / DataLoader: {spread(ratios)}")
    for path, name in (("behemoth", "behemoth"), ("plain", "DataLoader")):
        print(f"  whole machine, {name}: {spread(cpu[path], '{:.2f}')} ms CPU per image, "
              f"{spread(cores[path], '{:.2f}')} cores busy")


if __name__ == "__main__":
    main()
