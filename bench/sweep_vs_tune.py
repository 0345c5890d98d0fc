"""Issue 49's sweep benchmark: behemoth's demo sweep against the two plain scripts a careful user would write
instead (bench/plain_sweeps.py: Ray Tune alone, Tune's PyTorch tutorial pattern; Ray Tune + Ray Train, a
TorchTrainer per trial). Each is a whole process with its own local Ray, run in turn (the order rotates each
repeat), --repeats rounds; the same grid (lr 0.02 / 0.1 / 0.5 x batch 32 / 64), epochs, ASHA, 2 trials at once,
one worker per trial (--workers 2: two, and behemoth's trials then go through Ray Train too).

behemoth's decoded image cache is built once before the timed runs, as every sweep after a data set's first use
finds it (its first build: BENCHMARKS.md). Seeds: --seeds runs each round with each seed (the best accuracy's
spread across seeds is the noise the comparison is read against).

    .venv/bin/python bench/sweep_vs_tune.py [--repeats 3] [--seeds 0] [--epochs 4] [--workers 1]

Prints each run's wall time and best (lr, batch, val_accuracy), then the medians and the ratios
behemoth / plain (targets: <= 0.85 against Tune alone, <= 0.45 against Tune + Train; with --workers 2,
<= 1.0 against Tune + Train).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import demo_images_cached

REPO = Path(__file__).resolve().parents[1]


def behemoth_sweep(storage: str, name: str, seed: int, epochs: int, workers: int) -> dict:
    sets = [f"name={name}", f"storage_path={storage}", f"train.seed={seed}", f"train.epochs={epochs}",
            f"scaling.num_workers={workers}"]
    if workers > 1:  # 1 CPU a trial, as its one worker has: the two workers share it
        sets.append(f"scaling.cpus_per_worker={0.75 / workers}")
    cmd = [sys.executable, "-m", "behemoth", "tune", "jobs/configs/sweep_demo.yaml", *(f"--set={s}" for s in sets)]
    launched = time.time()
    subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    wall = time.time() - launched
    import pandas as pd

    best = pd.read_csv(Path(storage) / name / "results.csv").iloc[0]
    return {"wall": wall, "lr": float(best["train.lr"]), "batch": int(best["train.global_batch_size"]),
            "val_accuracy": float(best["val_accuracy"])}


def plain_sweep(host: str, seed: int, epochs: int, workers: int) -> dict:
    cmd = [sys.executable, "bench/plain_sweeps.py", "--host", host, "--seed", str(seed), "--epochs", str(epochs),
           "--workers", str(workers)]
    launched = time.time()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    wall = time.time() - launched
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{\"best_lr\"")))
    return {"wall": wall, "lr": result["best_lr"], "batch": result["best_batch"],
            "val_accuracy": result["best_val_accuracy"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--workers", type=int, default=1, help="workers per trial")
    args = p.parse_args()
    demo_images_cached()
    sides = ["behemoth", "train"] if args.workers > 1 else ["behemoth", "tune", "train"]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as storage:
        rounds = [(i, seed) for i in range(args.repeats) for seed in args.seeds]
        for n, (i, seed) in enumerate(rounds):  # a round: each side once, the order rotating round to round
            for side in sides[n % len(sides):] + sides[:n % len(sides)]:
                r = (behemoth_sweep(storage, f"s{i}_{seed}", seed, args.epochs, args.workers) if side == "behemoth"
                     else plain_sweep(side, seed, args.epochs, args.workers))
                runs[side].append({**r, "seed": seed})
                print(f"round {n} seed {seed} {side:8s}: wall {r['wall']:6.1f} s, best lr {r['lr']:g} batch "
                      f"{r['batch']} val_accuracy {r['val_accuracy']:.4f}", flush=True)
    med = {side: statistics.median(r["wall"] for r in rs) for side, rs in runs.items()}
    names = {"behemoth": "behemoth", "tune": "Ray Tune alone", "train": "Ray Tune + Ray Train"}
    print(f"\n{args.workers} worker(s) per trial, {args.epochs} epochs, {len(rounds)} rounds ({args.repeats} x seeds "
          f"{args.seeds}):")
    for side, rs in runs.items():
        accs = [r["val_accuracy"] for r in rs]
        print(f"  {names[side]:22s} median wall {med[side]:6.1f} s (min {min(r['wall'] for r in rs):.1f}, max "
              f"{max(r['wall'] for r in rs):.1f}); best val_accuracy {statistics.median(accs):.4f} (min "
              f"{min(accs):.4f}, max {max(accs):.4f}); best (lr, batch) "
              f"{sorted({(r['lr'], r['batch']) for r in rs})}")
    for side in sides[1:]:
        pairs = [b["wall"] / o["wall"] for b, o in zip(runs["behemoth"], runs[side])]  # round by round
        print(f"  ratio behemoth / {names[side]}: {med['behemoth'] / med[side]:.3f} (medians); per round "
              f"{', '.join(f'{x:.3f}' for x in pairs)}")


if __name__ == "__main__":
    main()
