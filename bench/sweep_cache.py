"""The demo sweep with the decoded image cache against the same sweep decoding every epoch (issue 37): each a
whole `python -m behemoth tune jobs/configs/sweep_demo.yaml` process with its own local Ray, alternating which
goes first, --repeats pairs. The cache is built before the timed runs (a sweep's trials share one; its first
build, once per machine, is in BENCHMARKS.md's P9 section), so the figure is what every later sweep costs.

    .venv/bin/python bench/sweep_cache.py                       # the demo sweep as shipped (~20 min a pair here)
    .venv/bin/python bench/sweep_cache.py --set train.epochs=2 --repeats 1

Prints each run's wall time and best val_accuracy, then the medians and the ratio cached / uncached
(target <= 0.7).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import demo_images_cached

REPO = Path(__file__).resolve().parents[1]


def run_sweep(storage: str, name: str, cache: str, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "behemoth", "tune", "jobs/configs/sweep_demo.yaml", f"--set=name={name}",
           f"--set=storage_path={storage}", f"--set=data.cache={cache}", *(f"--set={o}" for o in overrides)]
    launched = time.time()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    wall = time.time() - launched
    import pandas as pd

    table = pd.read_csv(Path(storage) / name / "results.csv")
    return {"wall": wall, "best": float(table["val_accuracy"].max()), "trials": len(table),
            "lines": [line for line in out.splitlines() if line.startswith("[behemoth] data cache")][:1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a job key for every trial, both sides (e.g. train.epochs=2)")
    args = p.parse_args()
    demo_images_cached()
    runs = {"decoded": [], "none": []}
    with tempfile.TemporaryDirectory(prefix="bench-sweep-cache-") as storage:
        for i in range(args.repeats):
            for cache in (("decoded", "none") if i % 2 == 0 else ("none", "decoded")):
                r = run_sweep(storage, f"{cache}{i}", cache, args.overrides)
                runs[cache].append(r)
                print(f"{cache:8s} run {i}: wall {r['wall']:.1f} s, {r['trials']} trials, best val_accuracy "
                      f"{r['best']:.4f} {r['lines']}", flush=True)
    med = {cache: statistics.median(r["wall"] for r in rs) for cache, rs in runs.items()}
    pairs = [a["wall"] / b["wall"] for a, b in zip(runs["decoded"], runs["none"])]
    print(f"median wall: decoded {med['decoded']:.1f} s, none {med['none']:.1f} s; ratio decoded / none "
          f"{med['decoded'] / med['none']:.3f} (medians), paired {statistics.median(pairs):.3f} "
          f"({min(pairs):.3f}, {max(pairs):.3f}); target <= 0.7")


if __name__ == "__main__":
    main()
