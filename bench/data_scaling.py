"""Benchmark: how the 224-px JPEG input pipeline scales with the CPUs it is given (the GPU tier's 16-core
machine; issue 54's target: >= 85 % per CPU at 16 of the rate per CPU at 2).

The data: 600 photograph-like JPEGs (`behemoth data synth-images --format jpeg`, 500x375 and the other shapes;
made here: the GPU machine reaches no package index, so bench/photos.py's photographs cannot be fetched there),
listed 20 times over through symbolic links (12,000 files an epoch: an epoch boundary every ~1.5 s at 8,000
images/s would otherwise be what is measured). For each CPU count, `behemoth data bench --cpus N` in a process
of its own (a local Ray instance of N CPUs; one consumer reserving 0.25 CPU, decode tasks of 0.5 CPU, batch 64,
224-px random-resized-crop); its samples/s divided by N, against the same at the smallest count, and against N
times the one-core limit: the one-core loop with behemoth's per-image transform (bench/image_pipeline.py's "fast"
side) on the same files, in this process, first (issue 74 item 4's goal: >= 0.85 of N x that).

    .venv/bin/python bench/data_scaling.py [--cpus 2,4,8,16] [--seconds 10] [--floor 0.85]

Exit status 1 where the efficiency at the largest count is under --floor (the figure is printed either way).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def photo_folder(root: Path, copies: int = 20) -> Path:
    """`root`/src: the JPEGs (made once); `root`/listed: every one `copies` times, by symbolic links."""
    src, listed = root / "src", root / "listed"
    if not (src / "val").is_dir():
        subprocess.run([sys.executable, "-m", "behemoth", "data", "synth-images", "--out", str(src), "--format",
                        "jpeg", "--per-class", "60", "--val-per-class", "2"], cwd=REPO, check=True)
    if not (listed / "val").is_dir():
        for path in sorted(src.rglob("*.jpg")):
            rel = path.relative_to(src)
            for k in range(copies if rel.parts[0] == "train" else 1):
                link = listed / rel.parent / f"{k}_{rel.name}"
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(path.resolve())
    return listed


def bench(job: Path, cpus: int, seconds: float) -> tuple[float, str]:
    done = subprocess.run([sys.executable, "-m", "behemoth", "data", "bench", str(job), "--cpus", str(cpus),
                           "--seconds", str(seconds)], cwd=REPO, capture_output=True, text=True)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    m = re.match(r"data bench: ([\d,]+) samples/s", last)
    if done.returncode or not m:
        raise RuntimeError(f"behemoth data bench --cpus {cpus} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return float(m.group(1).replace(",", "")), last


def one_core_limit(root: Path, seconds: float) -> float:
    """images/s of the one-core loop with behemoth's transform over the folder's training images."""
    from image_pipeline import fast_transform, one_core_side  # (this folder's: puts platform/ on sys.path)

    from behemoth.driver.commands.data_bench import MachineCpu

    paths = sorted(str(p) for p in (root / "train").rglob("*.jpg"))
    meter = MachineCpu()
    try:
        rate, _ = one_core_side(paths, [0] * len(paths), seconds, 64, meter, fast_transform)
    finally:
        meter.stop()
    return rate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpus", default="2,4,8,16", help="CPU counts (those over the machine's are skipped)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--floor", type=float, default=0.85)
    a = p.parse_args()
    counts = [n for n in (int(c) for c in a.cpus.split(",")) if n <= (os.cpu_count() or 1)]
    root = photo_folder(REPO / "data" / "bench_scaling")
    work = Path(tempfile.mkdtemp(prefix="bh-scaling-"))
    job = work / "job.yaml"
    job.write_text(f"""data: {{kind: image_folder, root: {root}, image_size: 224, augment: random_resized_crop,
  cache: none, cache_dir: {work / 'cache'}, cpus_per_task: 0.5}}
model: {{name: resnet50}}
train: {{global_batch_size: 64}}
scaling: {{num_workers: 1, cpus_per_worker: 0.25}}
checkpoint: {{storage_path: {work / 'runs'}}}
""")
    one_core = one_core_limit(root, a.seconds)
    print(f"one core, behemoth's transform: {one_core:,.0f} images/s", flush=True)
    rates = {}
    for n in counts:
        rates[n], line = bench(job, n, a.seconds)
        print(f"{n:3d} CPUs: {line}", flush=True)
    base = counts[0]
    for n in counts:
        print(f"{n:3d} CPUs: {rates[n]:8,.0f} images/s, {rates[n] / n:6,.0f} per CPU, efficiency "
              f"{rates[n] / n / (rates[base] / base):.2f} of {base} CPUs, {rates[n] / (n * one_core):.2f} of {n} x "
              f"the one-core limit")
    top = counts[-1]
    efficiency = rates[top] / top / (rates[base] / base)
    print(f"scaling efficiency at {top} CPUs: {efficiency:.2f} (floor {a.floor})")
    return 0 if efficiency >= a.floor else 1


if __name__ == "__main__":
    sys.exit(main())
