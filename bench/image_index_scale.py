"""How the driver's index of an image set grows with the number of images (issue 35 item 6): the time to list
and index it, the driver's memory for it, and the time when the listing is kept (data.cache_dir/index/: a
rerun, a driver restart or a sweep's trial stats the class folders, or the shards, instead of listing every
file or reading every tar header).

Synthetic data: N train images and N/10 val images in 100 classes, each a copy of one tiny PNG (the index reads
names, not pixels): an ImageFolder (100 class folders), or WebDataset tar shards of 10,000 images (`--layout
shards`: an image and a .cls member per image). Each figure is measured in a fresh process (peak RSS from
getrusage, less the same process's RSS after its imports).

    .venv/bin/python bench/image_index_scale.py                    # 10,000 and 100,000 files
    .venv/bin/python bench/image_index_scale.py --sizes 1000000    # (writes ~1.1M files; minutes)
    .venv/bin/python bench/image_index_scale.py --layout shards --sizes 10000 100000 1000000
    .venv/bin/python bench/image_index_scale.py --layout shards --sizes 10000 1000000 --first-step

--first-step also trains on each set (`behemoth train`, 2 workers, 2 steps of 64 images, data.cache none, the
index kept by the probes before it) and prints the run's own account of its time to first step: what a rerun
or a restart waits through at that size, index build excluded (it is the column before).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from _common import REPO
from PIL import Image

PROBE = """
import json, resource, sys, time
from pathlib import Path
from behemoth.data.image.images import index_image_folder, index_webdataset
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
root, cache = Path(sys.argv[1]), Path(sys.argv[2]) if sys.argv[2] else None
if (root / "train").is_dir():
    index = index_image_folder(root, cache)
else:
    index = index_webdataset([f"{root}/train-*.tar"], [f"{root}/val-*.tar"], cache)
took = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"s": took, "mb": (peak - base) / 1024, "rows": index.train.num_rows + index.val.num_rows}))
"""


def write_folder(root: Path, n: int, classes: int = 100) -> None:
    png = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(png, format="PNG")
    data = png.getvalue()
    for split, count in (("train", n), ("val", n // 10)):
        for c in range(classes):
            folder = root / split / f"class_{c:03d}"
            folder.mkdir(parents=True)
            for i in range(count // classes):
                (folder / f"{i:07d}.png").write_bytes(data)


def write_shards(root: Path, n: int, classes: int = 100, per_shard: int = 10_000) -> None:
    png = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(png, format="PNG")
    data = png.getvalue()
    root.mkdir(parents=True)
    for split, count in (("train", n), ("val", n // 10)):
        for shard, start in enumerate(range(0, count, per_shard)):
            with tarfile.open(root / f"{split}-{shard:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
                for i in range(start, min(start + per_shard, count)):
                    for name, body in ((f"{i:08d}.png", data), (f"{i:08d}.cls", str(i % classes).encode())):
                        info = tarfile.TarInfo(name)
                        info.size = len(body)
                        tar.addfile(info, io.BytesIO(body))


def probe(root: Path, cache: Path | None) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(root), str(cache or "")], check=True,
                         capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "platform")})
    return json.loads(out.stdout.strip().splitlines()[-1])


FIRST_STEP = re.compile(r"first step: +([\d.]+) s from process start[^(]*\((.*?) s; then the first batch")


def first_step(root: Path, cache: Path, tmp: Path) -> dict:
    """A 2-step run on the set; its account of the time to its first step (s)."""
    import yaml

    data = {"kind": "image_folder", "root": str(root)} if (root / "train").is_dir() else \
        {"kind": "image_webdataset", "train_files": [f"{root}/train-*.tar"], "val_files": [f"{root}/val-*.tar"]}
    job = {"data": {**data, "image_size": 8, "crop_padding": 1, "cache": "none", "cache_dir": str(cache),
                    "cpus_per_task": 0.25},
           "model": {"name": "regnet_tiny_cifar"},
           "train": {"epochs": 1, "max_steps": 2, "global_batch_size": 64, "log_every": 1},
           "scaling": {"num_workers": 2, "cpus_per_worker": 0.5, "torch_threads": 1},
           "checkpoint": {"every_n_steps": 1000, "storage_path": str(tmp / "runs"), "run_name": "first_step"},
           "eval": {"per_epoch": False}, "tracking": {"report": False}}
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    out = subprocess.run([sys.executable, "-m", "behemoth", "train", str(tmp / "job.yaml")], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "platform")})
    found = FIRST_STEP.search(out.stdout)
    if out.returncode or not found:
        raise SystemExit(f"the run failed or printed no first-step line:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    total = float(found.group(1))
    parts = {k: float(v) for k, v in (part.rsplit(" ", 1) for part in found.group(2).split(", "))}
    workers = parts.pop("workers", 0.0) + parts.pop("model and restore", 0.0)
    return {"total": total, "workers": workers, "before": sum(parts.values()),
            "after": total - workers - sum(parts.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--layout", choices=["folder", "shards"], default="folder")
    p.add_argument("--first-step", action="store_true", help="also train 2 steps on each set (see above)")
    args = p.parse_args()
    print(f"{args.layout}: {'train images':>12} {'indexed rows':>12} {'listing s':>10} {'driver MB':>10} {'kept listing s':>15} "
          f"{'MB':>6}")
    for n in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
            root, cache = Path(tmp) / "images", Path(tmp) / "cache"
            (write_folder if args.layout == "folder" else write_shards)(root, n)
            cold = probe(root, None)
            probe(root, cache)  # lists and keeps the listing
            kept = probe(root, cache)
            print(f"{args.layout}: {n:>12,} {cold['rows']:>12,} {cold['s']:>10.2f} {cold['mb']:>10.0f} {kept['s']:>15.2f} "
                  f"{kept['mb']:>6.0f}", flush=True)
            if args.first_step:
                f = first_step(root, cache, Path(tmp))
                print(f"{args.layout}: {n:>12,} first step {f['total']:.1f} s from process start (imports, ray and the "
                      f"kept index {f['before']:.1f}, workers and model {f['workers']:.1f}, then the rank's dataset, first batch "
                      f"and step {f['after']:.1f})", flush=True)


if __name__ == "__main__":
    main()
