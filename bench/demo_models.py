"""Issue 15's condition on the demo's model: the new one (regnet_tiny_cifar, 8 epochs: what `./run.sh demo`
trains) must reach >= 0.90 validation accuracy within the time of the old one (the CIFAR-stem ResNet it
replaced, 6 epochs: bench/old_demo_model.py) under equal conditions: the same behemoth, data, recipe and
machine, each a whole `behemoth train` process, alternating who goes first. The old model runs as a model of one's
own (model.name: bench.old_demo_model:resnet_tiny_cifar).

    .venv/bin/python bench/demo_models.py                 # 3 pairs
    .venv/bin/python bench/demo_models.py --repeats 5

Prints each run's wall time and final val_acc, the medians and their ratio (new / old).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEHEMOTH = [sys.executable, "-m", "behemoth"]
MODELS = {"new": ["model.name=regnet_tiny_cifar", "train.epochs=8"],
          "old": ["model.name=bench.old_demo_model:resnet_tiny_cifar", "train.epochs=6"]}


def run(which: str, storage: str, name: str) -> tuple[float, float]:
    sets = [*MODELS[which], f"checkpoint.storage_path={storage}", f"checkpoint.run_name={name}"]
    cmd = [*BEHEMOTH, "train", "jobs/configs/demo_images.yaml", *(f"--set={s}" for s in sets)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.time()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    wall = time.time() - started
    return wall, float(re.search(r"final val_acc:\s+([0-9.]+)", out).group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if not (REPO / "data" / "demo_images" / "train").is_dir():
        subprocess.run([*BEHEMOTH, "data", "synth-images", "--out", "data/demo_images"], cwd=REPO, check=True)
    walls, accs = {"new": [], "old": []}, {"new": [], "old": []}
    with tempfile.TemporaryDirectory(prefix="bench-demo-models-") as storage:
        for i in range(args.repeats):
            for which in (("new", "old") if i % 2 == 0 else ("old", "new")):
                wall, acc = run(which, storage, f"{which}{i}")
                walls[which].append(wall)
                accs[which].append(acc)
                print(f"{which} model run {i}: {wall:.1f} s, val_acc {acc:.4f}", flush=True)
    new, old = statistics.median(walls["new"]), statistics.median(walls["old"])
    print(f"median wall time: new (regnet_tiny_cifar, 8 epochs) {new:.1f} s, val_acc {statistics.median(accs['new']):.4f}; "
          f"old (resnet_tiny_cifar, 6 epochs) {old:.1f} s, val_acc {statistics.median(accs['old']):.4f}; "
          f"ratio new/old {new / old:.3f}")


if __name__ == "__main__":
    main()
