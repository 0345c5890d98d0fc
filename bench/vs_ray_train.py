"""Overhead against a plain Ray Train script (issue 17): the demo image job as `python -m behemoth train
jobs/configs/demo_images.yaml` against the same job written as a careful user writes it with Ray's docs
(bench/plain_ray_train.py: loader processes kept between epochs, validation batches of 100; `--baseline simple`:
the guide's script as written), each a whole process (Python start, imports and a fresh local Ray included),
alternating who goes first, --repeats pairs. `--set KEY=VALUE` goes to behemoth (e.g. data.cache=none).

    .venv/bin/python bench/vs_ray_train.py                  # 5 pairs of the 8-epoch demo (~15 min here)
    .venv/bin/python bench/vs_ray_train.py --epochs 2 --repeats 3

Prints, per run: wall time, time from launch to the end of the first training step, final validation accuracy;
then the medians and the ratio of wall times behemoth / plain (target <= 1.0). behemoth's time to first step is
rank 0's `mark_first_step` in its metrics.jsonl; behemoth checkpoints every 40 steps (the demo's setting, 6 in
the run), the plain script every epoch (8).
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

REPO = Path(__file__).resolve().parents[1]


def run_behemoth(epochs: int, storage: str, name: str, entry: tuple[str, ...] = ("-m", "behemoth"),
                 overrides: tuple[str, ...] = ()) -> dict:
    """`python -m behemoth train` of the demo job as a whole process (`entry`: what follows the interpreter)."""
    cmd = [sys.executable, *entry, "train", "jobs/configs/demo_images.yaml", f"--set=train.epochs={epochs}",
           f"--set=checkpoint.storage_path={storage}", f"--set=checkpoint.run_name={name}",
           *(f"--set={o}" for o in overrides)]
    launched = time.time()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    wall = time.time() - launched
    for line in out.splitlines():  # where behemoth's time went, for each run
        if line.strip().startswith(("goodput:", "first step:")):
            print("   ", line.strip())
    reports = [json.loads(line) for line in (Path(storage) / name / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in reports if "val_accuracy" in r][-1]
    return {"wall": wall, "first_step": reports[0]["mark_first_step"] - launched,
            "val_accuracy": last_eval["val_accuracy"]}


def run_plain(epochs: int, storage: str, baseline: str = "careful") -> dict:
    cmd = [sys.executable, "bench/plain_ray_train.py", f"--epochs={epochs}", f"--storage={storage}",
           *(["--simple"] if baseline == "simple" else [])]
    launched = time.time()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    wall = time.time() - launched
    result = json.loads(out.strip().splitlines()[-1])
    return {"wall": wall, "first_step": result["first_step_at"] - launched, "val_accuracy": result["val_accuracy"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline", choices=["careful", "simple"], default="careful")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for behemoth's run (repeatable)")
    args = p.parse_args()
    if not (REPO / "data" / "demo_images" / "train").is_dir():
        subprocess.run([sys.executable, "-m", "behemoth", "data", "synth-images", "--out", "data/demo_images"],
                       cwd=REPO, check=True)
    runs = {"behemoth": [], "plain": []}
    with tempfile.TemporaryDirectory(prefix="bench-vs-ray-train-") as storage:
        for i in range(args.repeats):
            for who in (("behemoth", "plain") if i % 2 == 0 else ("plain", "behemoth")):
                r = run_behemoth(args.epochs, storage, f"b{i}", overrides=tuple(args.overrides)) \
                    if who == "behemoth" else run_plain(args.epochs, f"{storage}/plain{i}", args.baseline)
                runs[who].append(r)
                print(f"{who:8s} run {i}: wall {r['wall']:.1f} s, first step after {r['first_step']:.1f} s, "
                      f"val_accuracy {r['val_accuracy']:.4f}", flush=True)
    med = {who: {k: statistics.median(r[k] for r in rs) for k in ("wall", "first_step", "val_accuracy")}
           for who, rs in runs.items()}
    pairs = [b["wall"] / p["wall"] for b, p in zip(runs["behemoth"], runs["plain"])]
    for who, m in med.items():
        print(f"median {who:8s}: wall {m['wall']:.1f} s, first step after {m['first_step']:.1f} s, "
              f"val_accuracy {m['val_accuracy']:.4f}")
    print(f"ratio of wall times behemoth / plain ({args.baseline}): "
          f"{med['behemoth']['wall'] / med['plain']['wall']:.3f} (medians); "
          f"paired {statistics.median(pairs):.3f} ({min(pairs):.3f}, {max(pairs):.3f}); target <= 0.85")


if __name__ == "__main__":
    main()
