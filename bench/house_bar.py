"""The bar-level figures of two checkouts of behemoth, alternating, in one sitting: a change to the house (a
rename, a new run sequence, a typed task spec) must leave every one of them within noise (issue 68).

For each round, each checkout in turn (the order alternates from round to round), through its own command line
(`python -m behemoth`, its own `platform/` first on PYTHONPATH, this venv's packages):

    start-up + step rate  `behemoth train` of the image demo, 2 epochs, 2 workers, into a new folder: the
                          process's wall time, the goodput account's start-up term, the steady samples/s
                          (median of the reports after the first)
    data bench            `behemoth data bench` of the same job (8 s window): samples/s
    sweep                 `behemoth tune` of the demo sweep cut to 2 one-worker trials of 2 epochs in warm lanes
                          (fifo): the process's wall time
    step rate             bench/step_overhead.py --fast --repeats 1 of that checkout: behemoth / the plain loop

    .venv/bin/python bench/house_bar.py --before /path/to/old/checkout --after . [--rounds 3]

A first training run, not counted, builds what every later run on the node shares (the images' decoded cache).
Prints each figure per round and the median ratio after / before (and its spread).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(tree: Path, args: list[str], timeout: int = 900) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'platform'}{os.pathsep}{tree}"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    return wall, done.stdout + done.stderr


def _train(tree: Path, work: Path, images: Path) -> dict:
    storage = Path(tempfile.mkdtemp(dir=work))
    wall, _ = _run(tree, ["-m", "behemoth", "train", str(REPO / "jobs/configs/demo_images.yaml"),
                          "--set", f"data.root={images}", "--set", "train.epochs=2",
                          "--set", f"checkpoint.storage_path={storage}", "--set", "checkpoint.run_name=bar"])
    run = storage / "bar"
    account = json.loads((run / "goodput.json").read_text())
    reports = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["samples_per_s"] for r in reports[1:] if "samples_per_s" in r]
    shutil.rmtree(storage, ignore_errors=True)
    return {"train_wall_s": wall, "startup_s": account["terms_s"]["startup"],
            "samples_per_s": statistics.median(rates)}


def _data_bench(tree: Path, images: Path) -> dict:
    _, out = _run(tree, ["-m", "behemoth", "data", "bench", str(REPO / "jobs/configs/demo_images.yaml"),
                         "--set", f"data.root={images}", "--seconds", "8"])
    found = re.search(r"data bench: ([\d,]+) samples/s", out)
    if not found:
        raise SystemExit(f"{tree}: no data bench figure in:\n{out[-2000:]}")
    return {"data_bench_samples_per_s": float(found.group(1).replace(",", ""))}


def _sweep(tree: Path, work: Path, images: Path) -> dict:
    folder = Path(tempfile.mkdtemp(dir=work))
    sweep = folder / "sweep.yaml"
    sweep.write_text(
        f"job: {REPO / 'jobs/configs/demo_images.yaml'}\n"
        f"set: [data.root={images}, train.epochs=2, scaling.num_workers=1, scaling.cpus_per_worker=0.75,\n"
        f"      checkpoint.every_n_steps=64, checkpoint.keep=2]\n"
        "space:\n  train.lr: {grid: [0.02, 0.1]}\n"
        "metric: val_accuracy\nscheduler:\n  kind: fifo\n"
        f"name: bar\nstorage_path: {folder / 'sweeps'}\n")
    wall, _ = _run(tree, ["-m", "behemoth", "tune", str(sweep)])
    shutil.rmtree(folder, ignore_errors=True)
    return {"sweep_wall_s": wall}


def _step_rate(tree: Path) -> dict:
    _, out = _run(tree, [str(tree / "bench/step_overhead.py"), "--fast", "--repeats", "1"])
    found = re.findall(r"ratio[^\d]*([\d.]+)", out)
    if not found:
        raise SystemExit(f"{tree}: no step-rate ratio in:\n{out[-2000:]}")
    return {"step_rate_ratio": float(found[-1])}


MEASURES = {"train": _train, "data": _data_bench, "sweep": _sweep, "step": _step_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the older checkout (a git worktree)")
    parser.add_argument("--after", type=Path, default=REPO, help="the newer checkout (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(MEASURES), help=f"comma-separated of {', '.join(MEASURES)}")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bh-bar-"))
    images = work / "images"
    _run(REPO, ["-m", "behemoth", "data", "synth-images", "--out", str(images)])
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    figures: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    try:
        # not counted: the first run on this node builds what every later one shares (the decoded cache)
        _train(sides["after"], work, images)
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
            for measure in args.only.split(","):
                for side in order:
                    fn = MEASURES[measure]
                    got = fn(sides[side]) if measure == "step" else (
                        fn(sides[side], images) if measure == "data" else fn(sides[side], work, images))
                    for key, value in got.items():
                        figures[side].setdefault(key, []).append(value)
                    print(f"round {rnd + 1} {side:6s} {measure}: " +
                          ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nfigure                      before (median)   after (median)   after/before per round (median)")
    for key in figures["after"]:
        b, a = figures["before"][key], figures["after"][key]
        ratios = [x / y for x, y in zip(a, b)]
        print(f"{key:27s} {statistics.median(b):14.3f} {statistics.median(a):16.3f}   "
              f"{statistics.median(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
