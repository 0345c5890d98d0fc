"""Benchmark: what exact resume costs the image input pipeline.

Exact resume needs each rank's samples to arrive in the order behemoth's permutation gives
(`behemoth/data/order.py`), so behemoth's per-rank Ray Dataset runs with `preserve_order=True`: a decode
task that finishes early waits for the ones before it. Without exactness a user would take Ray Data's
default, `preserve_order=False` (batches in completion order), over the same samples. This benchmark runs
the identical pipeline (`behemoth.data.image.image_batches.rank_windows`: index slices -> map_batches decode +
augment -> iter_torch_batches with prefetch, window after window) both ways over one epoch of the demo images, with a consumer
that does nothing — the worst case for ordering, since nothing hides a straggling task — alternating, after
a warm-up of each, and prints images/s and the ratio exact / default (median of --repeats).

    .venv/bin/python bench/exact_order.py [--repeats 5] [--cpus 2] [--batch 32] [--cpus-per-task 0.25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


def one_epoch(index, cfg, batch: int, ordered: bool) -> float:
    """Images/s of one epoch through the rank pipeline."""
    from behemoth.data.image.image_batches import rank_windows
    from behemoth.data.order import rank_train_indices

    indices = rank_train_indices(index.train.num_rows, batch, seed=0, epoch=0, rank=0, world_size=1)
    windows = rank_windows(index.train, indices, cfg, seed=0, epoch=0, train=True, batch_size=batch)
    started, delivered = time.perf_counter(), []
    for ds in windows:
        ds.context.execution_options.preserve_order = ordered  # the dataset's own copy; rank_windows sets True
        for b in ds.iter_torch_batches(batch_size=batch, prefetch_batches=cfg.prefetch_batches):
            delivered += b["sample_id"].tolist()
    seconds = time.perf_counter() - started
    assert sorted(delivered) == sorted(indices.tolist())  # the same samples either way
    out_of_order = sum(a != b for a, b in zip(delivered, indices.tolist()))
    if ordered:
        assert out_of_order == 0  # the setting took effect: exactly the planned order
    else:
        print(f"    completion order: {out_of_order} of {len(indices)} samples away from the planned position")
    return len(delivered) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cpus-per-task", type=float, default=0.25)
    p.add_argument("--data", default="data/demo_images", help="an ImageFolder (made if missing)")
    args = p.parse_args()

    import ray

    from behemoth.data.image.images import ImageData
    from behemoth.data.image.images import build_index
    from behemoth.data.image.synth import write_synth_images

    root = Path(args.data)
    if not (root / "train").is_dir():
        root = Path(tempfile.mkdtemp(prefix="bench-images-"))
        write_synth_images(root, classes=10, per_class=200, val_per_class=50, size=32, seed=0)
    cfg = ImageData(kind="image_folder", root=str(root), cpus_per_task=args.cpus_per_task, prefetch_batches=2)
    index = build_index(cfg)
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="warning")
    for ordered in (True, False):  # warm-up: worker processes, imports
        one_epoch(index, cfg, args.batch, ordered)
    exact, default = [], []
    for _ in range(args.repeats):
        exact.append(one_epoch(index, cfg, args.batch, ordered=True))
        default.append(one_epoch(index, cfg, args.batch, ordered=False))
    ratios = [e / d for e, d in zip(exact, default)]
    print(f"{index.train.num_rows} images, batch {args.batch}, {args.cpus} CPUs, decode tasks of "
          f"{args.cpus_per_task} CPU, {args.repeats} repeats alternating")
    print(f"  exact order (preserve_order=True):    {statistics.median(exact):8.0f} images/s "
          f"(min {min(exact):.0f}, max {max(exact):.0f})")
    print(f"  Ray Data default (completion order):  {statistics.median(default):8.0f} images/s "
          f"(min {min(default):.0f}, max {max(default):.0f})")
    print(f"  ratio exact / default: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
