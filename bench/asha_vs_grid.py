"""Benchmark: what ASHA saves over running the full grid, and how often it still finds the grid's best.

For each seed (train.seed: initial weights, sample order, augmentation), the demo sweep
(`jobs/configs/sweep_demo.yaml`: 3 learning rates x 2 batch sizes on the demo images, 1 worker per trial,
2 trials at once on 2 cores) runs twice through `behemoth.driver.sweep.tuner.sweep`: with `scheduler.kind: fifo` (every
trial trains all its epochs: the full grid) and with the file's ASHA (grace period 1 epoch, reduction
factor 2, max_t the trials' epochs: rungs at epochs 1 and 2 of 4, or at 1 of 2). Printed per seed and in total: trial-epochs trained (the sum over trials of the epochs
each reached), wall time, the best configuration of each, and whether ASHA's best is the grid's best.

    .venv/bin/python bench/asha_vs_grid.py [--seeds 0 1 2] [--epochs 4] [--per-class 200]
    (--per-class 200: the demo images in data/demo_images, made if missing; another N: the same generator
    with N training and N/4 validation images per class, in a temporary folder)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))


def run(kind: str, seed: int, epochs: int, storage: str, data: Path):
    from behemoth.driver.sweep.config import load_sweep
    from behemoth.driver.sweep.tuner import run_sweep

    sweep_cfg = load_sweep(REPO / "jobs/configs/sweep_demo.yaml", [
        f"name={kind}-seed{seed}", f"storage_path={storage}", f"scheduler.kind={kind}",
        f"train.seed={seed}", f"train.epochs={epochs}", f"data.root={data}",
        f"checkpoint.storage_path={storage}/jobs"])
    started = time.time()
    result = run_sweep(sweep_cfg)
    return float(result.table["epoch"].sum()), result, time.time() - started


def grid_value(grid_result, params: dict) -> float:
    """The grid's final metric for a configuration."""
    table = grid_result.table
    row = table[(table[list(params)] == list(params.values())).all(axis=1)]
    return float(row[grid_result.metric].iloc[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--per-class", type=int, default=200)
    args = p.parse_args()
    import ray

    from behemoth.data.image.synth import write_synth_images

    data = REPO / "data/demo_images"
    if args.per_class != 200:
        data = Path(tempfile.mkdtemp(prefix="bench-images-"))
    if not (data / "train").is_dir():
        write_synth_images(data, classes=10, per_class=args.per_class, val_per_class=args.per_class // 4,
                           size=32, seed=0)

    ray.init(include_dashboard=True, logging_level="warning", log_to_driver=False)
    storage = tempfile.mkdtemp(prefix="bench-sweeps-")
    rows = []
    try:
        for seed in args.seeds:
            (g_epochs, grid, g_wall), (a_epochs, asha, a_wall) = (run("fifo", seed, args.epochs, storage, data),
                                                                  run("asha", seed, args.epochs, storage, data))
            # Ties are common (several configurations reach the same accuracy): ASHA "found the best" when the
            # configuration it picks is, in the full grid, as good as the grid's best.
            same = grid_value(grid, asha.best_params) == grid.best_value
            rows.append((g_epochs, a_epochs, g_wall, a_wall, same))
            print(f"seed {seed}: grid {g_epochs:.0f} trial-epochs ({g_wall:.0f} s), best {grid.best_params} "
                  f"{grid.metric} {grid.best_value:.4f} | ASHA {a_epochs:.0f} trial-epochs ({a_wall:.0f} s), best "
                  f"{asha.best_params} {asha.metric} {asha.best_value:.4f} (in the grid: "
                  f"{grid_value(grid, asha.best_params):.4f}) | found the grid's best: {same}", flush=True)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    g_epochs, a_epochs, g_wall, a_wall, found = (sum(column) for column in zip(*rows))
    print(f"total over {len(rows)} seeds: grid {g_epochs:.0f} trial-epochs, ASHA {a_epochs:.0f} "
          f"(ratio {a_epochs / g_epochs:.2f}); wall {g_wall:.0f} s vs {a_wall:.0f} s (ratio {a_wall / g_wall:.2f}); "
          f"ASHA found the grid's best configuration in {found} of {len(rows)} seeds")


if __name__ == "__main__":
    main()
