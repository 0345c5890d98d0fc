"""An ImageNet-shaped folder of JPEG photographs, made here from real photos that ship inside Python packages.

The image benchmarks must decode what users decode: camera photos, ~500x375, ~110 KB each (ImageNet's mean),
not the project's own synthetic pictures. Nothing may be downloaded at run time, so the source photos are the
ones scikit-image (astronaut, chelsea, coffee, motorcycle, rocket, retina, hubble, ihc and, in grey, camera,
brick, grass, gravel), scikit-learn (china, flower) and matplotlib (grace_hopper) ship in their wheels: the
wheels are fetched from the package index with `pip download --no-deps` (pinned, ~23 MB, once, into
data/bench_photos/wheels) and only their image files are read; neither package is installed.

Each written image is a crop of one source photo at a random place and scale (landscape 500x375 for 72 %,
portrait 375x500 for 20 %, and 8 % at 1000x750 as ImageNet's larger ones), resized with Lanczos,
given a little colour shift and sensor noise, and written at JPEG quality 91-97: the pixel statistics, the
sizes and so the decoding cost of photographs. A grey source is written as a one-channel JPEG (ImageNet holds
~2 % of those). One class per colour source photo (so a model can learn them); the grey ones are spread over
the classes. Deterministic for a seed.

    .venv/bin/python bench/photos.py --out data/bench_photos/imagenet_shaped --train 1200 --val 200
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
WHEELS = {  # pinned: the same photos on every machine
    "scikit-image==0.26.0": ["astronaut.png", "chelsea.png", "coffee.png", "motorcycle_left.png", "rocket.jpg",
                             "retina.jpg", "hubble_deep_field.jpg", "ihc.png", "camera.png", "brick.png",
                             "grass.png", "gravel.png"],
    "scikit-learn==1.9.1": ["china.jpg", "flower.jpg"],
}
GREY = ("camera", "brick", "grass", "gravel")


def source_photos(cache: Path = REPO / "data" / "bench_photos" / "sources") -> dict[str, Image.Image]:
    """The source photos by name, extracted once into `cache` from the pinned wheels (and matplotlib's)."""
    import matplotlib

    wanted = [name for names in WHEELS.values() for name in names]
    if not all((cache / n).is_file() for n in wanted):
        wheels = cache.parent / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        for spec, names in WHEELS.items():
            dist = spec.split("==")[0].replace("-", "_")
            if not list(wheels.glob(f"{dist}-*.whl")):
                subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), spec],
                               check=True)
            with zipfile.ZipFile(next(wheels.glob(f"{dist}-*.whl"))) as z:
                for member in z.namelist():
                    if Path(member).name in names:
                        cache.mkdir(parents=True, exist_ok=True)
                        (cache / Path(member).name).write_bytes(z.read(member))
    mpl = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    photos = {Path(n).stem: Image.open(cache / n) for n in wanted}
    photos["grace_hopper"] = Image.open(mpl)
    return {name: img.convert("L" if name in GREY else "RGB") for name, img in photos.items()}


def photo_jpeg(src: Image.Image, rng: np.random.Generator) -> bytes:
    """One ImageNet-shaped JPEG cut from `src`."""
    r = rng.random()
    size = (500, 375) if r < 0.72 else (375, 500) if r < 0.92 else (1000, 750)
    aspect = size[0] / size[1]
    w, h = src.size
    cw = min(w, h * aspect) * rng.uniform(0.55, 1.0)  # a crop of the output's aspect, at a random scale
    ch = cw / aspect
    left, top = rng.uniform(0, w - cw), rng.uniform(0, h - ch)
    img = src.resize(size, Image.LANCZOS, box=(left, top, left + cw, top + ch))
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    pixels = np.asarray(img, dtype=np.float32)
    gain = rng.uniform(0.85, 1.15, size=(1, 1, 3) if pixels.ndim == 3 else ())
    pixels = pixels * gain + rng.normal(0, rng.uniform(3.0, 6.0), size=pixels.shape)  # colour shift, sensor noise
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=int(rng.integers(91, 98)))
    return out.getvalue()


def write_photo_folder(out: Path, train: int, val: int, seed: int = 0) -> dict:
    """out/{train,val}/<photo>/NNNNNN.jpg, made once (an existing folder with the same counts is kept)."""
    out = Path(out)
    done = out / f".complete-{train}-{val}-{seed}"
    if done.is_file():
        return {"train": train, "val": val, "folder": str(out)}
    photos = source_photos()
    classes = sorted(n for n in photos if n not in GREY)
    sizes = []
    for split_id, (split, n) in enumerate((("train", train), ("val", val))):
        for i in range(n):
            rng = np.random.default_rng([seed, split_id, i])
            # 1 in 50 from a grey photo, filed under a class by its number
            grey = rng.random() < 0.02
            name = GREY[i % len(GREY)] if grey else classes[i % len(classes)]
            folder = out / split / classes[i % len(classes)]
            folder.mkdir(parents=True, exist_ok=True)
            data = photo_jpeg(photos[name], rng)
            (folder / f"{i:06d}.jpg").write_bytes(data)
            sizes.append(len(data))
    done.write_text(f"mean jpeg bytes {np.mean(sizes):.0f}\n")
    return {"train": train, "val": val, "folder": str(out), "mean_bytes": float(np.mean(sizes))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "data" / "bench_photos" / "imagenet_shaped"))
    parser.add_argument("--train", type=int, default=1200)
    parser.add_argument("--val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(write_photo_folder(Path(a.out), a.train, a.val, a.seed))
