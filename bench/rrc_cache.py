"""Benchmark: random_resized_crop decoded once (data.cache_side: whole-image views kept in the decoded cache)
against decoding every epoch: speed and accuracy at demo scale.

The data: `behemoth data synth-images --format jpeg --size 256x192` (10 classes, photograph-like JPEGs,
landscape, portrait and larger ones), made once. The job: the demo's tiny RegNet on 1 worker, 64-px
random-resized crops, SGD, batch 64, --epochs epochs; the two sides differ only in `data.cache` /
`data.cache_side`. For each seed both sides run (alternating), whole `behemoth.train` calls on one local Ray;
printed per run: steady samples/s (rank 0's reports, first to last), wall time, final val_accuracy. The views'
cache is built by the first run that uses it (its build is in that run's wall time, and in no other).

    .venv/bin/python bench/rrc_cache.py [--seeds 0,1] [--epochs 6] [--cache-side 128]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, read_metrics, steady_steps_per_s


def job(root: Path, storage: Path, name: str, seed: int, epochs: int, cache_side: int | None) -> dict:
    data = {"kind": "image_folder", "root": str(root), "image_size": 64, "augment": "random_resized_crop",
            "cache_dir": str(storage / "cache"), "cpus_per_task": 0.5, "prefetch_batches": 2}
    data.update({"cache": "decoded", "cache_side": cache_side} if cache_side else {"cache": "none"})
    return {"data": data, "model": {"name": "regnet_tiny_cifar"},
            "train": {"epochs": epochs, "global_batch_size": 64, "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
                      "warmup_steps": 20, "seed": seed, "log_every": 5},
            "scaling": {"num_workers": 1, "cpus_per_worker": 0.5, "torch_threads": 1},
            "checkpoint": {"every_n_steps": 10_000, "storage_path": str(storage), "run_name": name},
            "eval": {"per_epoch": False}, "tracking": {"report": False}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--cache-side", type=int, default=128)
    a = p.parse_args()
    root = REPO / "data" / "bench_synth_jpeg"
    if not (root / "val").is_dir():
        subprocess.run([sys.executable, "-m", "behemoth", "data", "synth-images", "--out", str(root), "--format",
                        "jpeg", "--size", "256x192", "--per-class", "150", "--val-per-class", "30"], check=True)
    from behemoth.driver.run.trainer import train
    from behemoth.job import config_from_dict

    storage = Path(tempfile.mkdtemp(prefix="bh-rrc-"))
    results = {"every epoch": [], "views": []}
    for seed in [int(s) for s in a.seeds.split(",")]:
        for side, cache_side in (("every epoch", None), ("views", a.cache_side))[::1 if seed % 2 == 0 else -1]:
            name = f"{side.replace(' ', '_')}_{seed}"
            summary = train(config_from_dict(job(root, storage, name, seed, a.epochs, cache_side)))
            reports = read_metrics(Path(summary.run_dir))
            rate = steady_steps_per_s(reports, 64) * 64
            acc = summary.metrics["val_accuracy"]
            results[side].append((rate, summary.wall_s, acc))
            print(f"seed {seed}: {side:12s} {rate:7.0f} samples/s steady, wall {summary.wall_s:5.1f} s, "
                  f"val_accuracy {acc:.4f}", flush=True)
    for side, rs in results.items():
        print(f"{side:12s} median {statistics.median(r for r, _, _ in rs):.0f} samples/s, wall "
              f"{statistics.median(w for _, w, _ in rs):.1f} s, val_accuracy {[round(x, 4) for _, _, x in rs]}")
    ratio = statistics.median(r for r, _, _ in results["views"]) / statistics.median(r for r, _, _ in results["every epoch"])
    print(f"views / every epoch, steady samples/s: {ratio:.2f}")


if __name__ == "__main__":
    main()
