"""Benchmark P5: the 224-px JPEG input pipeline alone (ImageNet's training transform), behemoth against what a
careful user would otherwise run, on ImageNet-shaped JPEG photographs (bench/photos.py), in one sitting.

Sides, in rotating order, --rounds of each, every one measured for --seconds after its first batch, batches of
--batch, consumers that touch every batch (one value per 4 KiB page) and drop it, no model:

- plain: the one-core loop a user writes: PIL open, EXIF transpose, RGB, random-resized-crop (torchvision's
  draws: area 8-100 %, ratio 3/4-4/3) + bilinear resize to 224, flip; uint8 HWC; in this process, one thread.
- fast (not in the default sides): the same one-core loop with behemoth's per-image transform (data/image/decode.py):
  the per-core figure of the work alone.
- dataloader: torch's DataLoader over the same files with the plain loop's transform per sample:
  num_workers = the machine's CPUs, persistent_workers, uint8 batches, pin_memory where CUDA is (never here),
  default prefetch; the consumer is this process.
- dataloader+fast: the same DataLoader with behemoth's per-image transform (data/image/decode.py): what a user gets
  who copies behemoth's decode into their own loader (isolates the pipeline from the per-image work).
- raytasks (not in the default sides): behemoth's decode task (`transform_batch`, BLOCK_ROWS images a task,
  --cpus-per-task each) as plain Ray tasks, twice as many in flight as the CPUs run, this process taking each
  output from the object store in order: Ray's core alone, without Ray Data or the worker's feed (on a local Ray
  instance this side starts and stops).
- behemoth: `behemoth data bench JOB` in a process of its own (its own local Ray instance, one consumer
  actor as a training worker, Ray Data decode tasks, the worker's feed); its printed samples/s.

Printed: images/s per side (median, min, max), the machine's busy CPUs over each window (/proc/stat), and the
ratios the issue asks for: behemoth / dataloader and behemoth / (plain x CPUs).

    .venv/bin/python bench/image_pipeline.py [--rounds 3] [--seconds 20] [--cpus-per-task 0.5]
"""

from __future__ import annotations

import argparse
import io
import itertools
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from _common import REPO, spread  # noqa: F401  (puts platform/ on sys.path)
from ingest_vs_dataloader import EpochShuffle  # (epoch, index) keys, a new shuffle per epoch
from photos import write_photo_folder

import numpy as np

from behemoth.driver.commands.data_bench import MachineCpu

SIZE = 224


def rrc_box(w: int, h: int, rnd: random.Random):
    """torchvision's RandomResizedCrop.get_params, with Python's random (as a user's script has it)."""
    area = w * h
    for _ in range(10):
        target = area * rnd.uniform(0.08, 1.0)
        ratio = math.exp(rnd.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            left, top = rnd.randint(0, w - cw), rnd.randint(0, h - ch)
            return left, top, left + cw, top + ch
    return 0, 0, w, h


def plain_transform(path: str, rnd: random.Random) -> np.ndarray:
    from PIL import Image, ImageOps

    with open(path, "rb") as f:
        img = Image.open(io.BytesIO(f.read()))
    img = ImageOps.exif_transpose(img).convert("RGB")
    img = img.resize((SIZE, SIZE), Image.BILINEAR, box=rrc_box(*img.size, rnd))
    pixels = np.asarray(img)
    return pixels[:, ::-1] if rnd.random() < 0.5 else pixels


def fast_transform(path: str, rnd: random.Random, out: np.ndarray | None = None) -> np.ndarray:
    from behemoth.data.image.decode import random_resized_crop
    from behemoth.data.image.image_batches import decode_rgb

    with open(path, "rb") as f:
        data = f.read()
    return random_resized_crop(data, SIZE, np.random.default_rng(rnd.getrandbits(64)), decode_rgb, out=out)


class Files:
    """A map-style dataset of (epoch, index) keys -> uint8 HWC image, label."""

    def __init__(self, paths, labels, transform):
        self.paths, self.labels, self.transform = paths, labels, transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, key):
        import torch

        epoch, i = key
        pixels = self.transform(self.paths[i], random.Random(epoch * 1_000_003 + i))
        return torch.from_numpy(np.require(pixels, requirements=["C", "W"])), self.labels[i]


def touch(t) -> None:
    flat = t.reshape(-1)
    flat[:: max(4096 // t.element_size(), 1)].sum()


def timed(batches, seconds: float, meter: MachineCpu) -> tuple[float, float]:
    """(images/s, busy CPUs) from the first batch on for `seconds`."""
    t0 = n = None
    for images, labels in batches:
        touch(images), touch(labels)
        if t0 is None:
            t0, n = time.time(), 0
            continue
        n += len(images)
        if time.time() - t0 >= seconds:
            break
    t1 = time.time()
    return n / (t1 - t0), meter.seconds(t0, t1) / (t1 - t0)


def one_core_side(paths, labels, seconds, batch, meter, transform):
    """The one-core loop: `transform` per image, in this process, one torch thread."""
    import torch

    torch.set_num_threads(1)

    def batches():
        rnd, epoch = random.Random(0), 0
        while True:
            perm = np.random.default_rng(epoch).permutation(len(paths))
            for start in range(0, len(paths) - batch + 1, batch):
                order = perm[start:start + batch]
                images = np.empty((batch, SIZE, SIZE, 3), dtype=np.uint8)
                for row, i in zip(images, order):  # behemoth's transform writes into the batch's row itself
                    pixels = transform(paths[i], rnd, row) if transform is fast_transform else transform(paths[i], rnd)
                    if pixels is not row:
                        row[:] = pixels
                yield torch.from_numpy(images), torch.as_tensor([labels[i] for i in order])
            epoch += 1

    return timed(batches(), seconds, meter)


def dataloader_side(paths, labels, seconds, batch, meter, transform):
    import torch
    from torch.utils.data import DataLoader

    keys = EpochShuffle(len(paths))
    loader = DataLoader(Files(paths, labels, transform), batch_size=batch, sampler=keys, drop_last=True,
                        num_workers=os.cpu_count(), persistent_workers=True, pin_memory=torch.cuda.is_available())

    def batches(loader):
        while True:
            yield from loader
            keys.epoch += 1

    try:
        return timed(batches(loader), seconds, meter)
    finally:
        if loader._iterator is not None:  # persistent workers end now, not when collected
            loader._iterator._shutdown_workers()


def ray_tasks_side(paths, labels, seconds, batch, meter, cpus_per_task):
    import ray
    import torch

    from behemoth.data.image.image_batches import BLOCK_ROWS, transform_batch
    from behemoth.data.image.images import ImageData

    cfg = ImageData(root="unused", image_size=SIZE, augment="random_resized_crop")
    decode = ray.remote(num_cpus=cpus_per_task)(transform_batch)

    def rows(epoch, start):
        ids = np.random.default_rng(epoch).permutation(len(paths))[start:start + BLOCK_ROWS]
        return {"sample_id": ids, "path": np.asarray([paths[i] for i in ids]), "row": np.full(len(ids), -1),
                "label": np.asarray([labels[i] for i in ids]), "size": np.full(len(ids), -1)}

    def batches():
        starts = ((e, s) for e in itertools.count() for s in range(0, len(paths) - BLOCK_ROWS + 1, BLOCK_ROWS))
        submit = lambda k: decode.remote(rows(*k), cfg=cfg, seed=0, epoch=k[0], train=True)  # noqa: E731
        refs = [submit(next(starts)) for _ in range(2 * int(os.cpu_count() / cpus_per_task))]
        while True:
            out = ray.get(refs.pop(0))
            refs.append(submit(next(starts)))
            for s in range(0, BLOCK_ROWS - batch + 1, batch):  # read-only in the object store: read, not written
                yield torch.from_numpy(out["image"][s:s + batch]), torch.from_numpy(out["label"][s:s + batch])
            del out

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    try:
        return timed(batches(), seconds, meter)
    finally:
        ray.shutdown()


def behemoth_side(job: Path, seconds: float) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-m", "behemoth", "data", "bench", str(job), "--seconds", str(seconds)],
                         cwd=REPO, capture_output=True, text=True)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    m = re.match(r"data bench: ([\d,]+) samples/s \(([\d,]+) per CPU, ([\d.]+) CPUs\)", last)
    if out.returncode or not m:
        raise RuntimeError(f"behemoth data bench failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return float(m.group(1).replace(",", "")), float(m.group(3))


def write_job(folder: Path, root: Path, batch: int, cpus_per_task: float, cpus_per_worker: float) -> Path:
    job = folder / "job.yaml"
    job.write_text(f"""data:
  kind: image_folder
  root: {root}
  image_size: {SIZE}
  augment: random_resized_crop
  cache: none
  cache_dir: {folder / 'cache'}
  prefetch_batches: 2
  cpus_per_task: {cpus_per_task}
model:
  name: resnet50
train:
  global_batch_size: {batch}
scaling:
  num_workers: 1
  cpus_per_worker: {cpus_per_worker}
checkpoint:
  storage_path: {folder / 'runs'}
""")
    return job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--images", type=int, default=2400, help="training images in the photo folder")
    parser.add_argument("--cpus-per-task", type=float, default=0.5, help="behemoth's data.cpus_per_task")
    parser.add_argument("--cpus-per-worker", type=float, default=0.25, help="behemoth's scaling.cpus_per_worker "
                        "(the consumer's reservation)")
    parser.add_argument("--sides", default="plain,dataloader,dataloader+fast,behemoth")
    a = parser.parse_args()
    root = REPO / "data" / "bench_photos" / "imagenet_shaped"
    made = write_photo_folder(root, a.images, 200)
    files = sorted((root / "train").rglob("*.jpg"))
    classes = sorted({p.parent.name for p in files})
    paths, labels = [str(p) for p in files], [classes.index(p.parent.name) for p in files]
    sizes = [p.stat().st_size for p in files]
    print(f"{len(paths)} JPEGs in {root}: mean {np.mean(sizes) / 1e3:.0f} KB; {os.cpu_count()} CPUs; "
          f"{a.rounds} rounds x {a.seconds:.0f} s, batch {a.batch}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="bh-pipeline-"))
    job = write_job(folder, root, a.batch, a.cpus_per_task, a.cpus_per_worker)
    sides = a.sides.split(",")
    results = {s: [] for s in sides}
    meter = MachineCpu()
    for r in range(a.rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:  # rotating order
            if side in ("plain", "fast"):
                transform = fast_transform if side == "fast" else plain_transform
                rate, cpus = one_core_side(paths, labels, a.seconds, a.batch, meter, transform)
            elif side.startswith("dataloader"):
                transform = fast_transform if side.endswith("fast") else plain_transform
                rate, cpus = dataloader_side(paths, labels, a.seconds, a.batch, meter, transform)
            elif side == "raytasks":
                rate, cpus = ray_tasks_side(paths, labels, a.seconds, a.batch, meter, a.cpus_per_task)
            else:
                rate, cpus = behemoth_side(job, a.seconds)
            results[side].append((rate, cpus))
            print(f"round {r}: {side:16s} {rate:7.0f} images/s, {cpus:.2f} CPUs busy", flush=True)
    meter.stop()
    print(f"\nimages/s (median, min, max over {a.rounds} rounds); busy CPUs (median)")
    for side, rs in results.items():
        print(f"  {side:16s} {spread([x for x, _ in rs], '{:.0f}')}; {statistics.median(c for _, c in rs):.2f} CPUs")
    med = {s: statistics.median(x for x, _ in rs) for s, rs in results.items()}
    cpus = os.cpu_count()
    if "behemoth" in med:
        if "dataloader" in med:
            print(f"behemoth / dataloader:             {med['behemoth'] / med['dataloader']:.2f} (floor 1.2)")
        if "dataloader+fast" in med:
            print(f"behemoth / dataloader+fast:        {med['behemoth'] / med['dataloader+fast']:.2f}")
        if "raytasks" in med:
            print(f"behemoth / raytasks:               {med['behemoth'] / med['raytasks']:.2f}")
        if "fast" in med:
            print(f"behemoth / (fast x {cpus} CPUs):       {med['behemoth'] / (med['fast'] * cpus):.2f} (goal 0.85)")
        if "plain" in med:
            print(f"behemoth / (plain x {cpus} CPUs):      {med['behemoth'] / (med['plain'] * cpus):.2f} (floor 0.8)")
    print(f"bytes per image delivered: {SIZE * SIZE * 3:,} (uint8); photo folder: {made}")


if __name__ == "__main__":
    main()
