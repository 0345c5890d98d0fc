"""What tracking costs: the demo job as a whole `behemoth train` process with tracking on (the defaults:
TensorBoard event files, metrics.jsonl, the goodput account and the end-of-run report) against tracking off
(tracking.tensorboard=false, tracking.report=false), alternating, each a fresh run in a temporary folder.

    .venv/bin/python bench/tracking_overhead.py                 # the demo (8 epochs), 5 pairs
    .venv/bin/python bench/tracking_overhead.py --epochs 2 --repeats 3

Prints every wall time, the medians and their ratio (on / off), and the goodput line of each run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEHEMOTH = [sys.executable, "-m", "behemoth"]


def run(on: bool, epochs: int, storage: str, name: str) -> tuple[float, str]:
    sets = [f"train.epochs={epochs}", f"checkpoint.storage_path={storage}", f"checkpoint.run_name={name}"]
    if not on:
        sets += ["tracking.tensorboard=false", "tracking.report=false"]
    cmd = [*BEHEMOTH, "train", "jobs/configs/demo_images.yaml", *(f"--set={s}" for s in sets)]
    started = time.time()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    wall = time.time() - started
    goodput = next((line.strip() for line in out.splitlines() if line.strip().startswith("goodput:")), "")
    return wall, goodput


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not (REPO / "data" / "demo_images" / "train").is_dir():
        subprocess.run([*BEHEMOTH, "data", "synth-images", "--out", "data/demo_images"], cwd=REPO, check=True)
    walls = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as storage:
        for i in range(args.repeats):
            for on in ((True, False) if i % 2 == 0 else (False, True)):  # alternate who goes first
                wall, goodput = run(on, args.epochs, storage, f"{'on' if on else 'off'}{i}")
                walls[on].append(wall)
                print(f"tracking {'on ' if on else 'off'} run {i}: {wall:.1f} s  {goodput}", flush=True)
    on, off = statistics.median(walls[True]), statistics.median(walls[False])
    print(f"median wall time: tracking on {on:.1f} s, off {off:.1f} s; ratio on/off {on / off:.3f} "
          f"(on: {sorted(round(w, 1) for w in walls[True])}, off: {sorted(round(w, 1) for w in walls[False])})")


if __name__ == "__main__":
    main()
