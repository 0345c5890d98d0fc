"""The GPU kit stays buildable (full tier: it downloads ~80 MB from the package index and takes minutes): built
from this checkout, installed into a fresh Python 3.12 exactly as the lent GPU machine installs it (`--no-index
--no-deps --target`) beside the image's packages that Ray imports, Ray started there with a Ray Data pipeline;
and, beside them, the device script's dry run (its three real-shape benches at tiny sizes on this CPU), whose
figures file holds every step passed."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from gpu_tier import run_group  # noqa: E402  (its process group ended if the test outlives it)


# The dry run (~2.5 minutes on a 2-core machine, CPU-bound; torch.compile's compilation off, tests/gpu_tier.py)
# runs beside the build (~20 s, mostly downloads) and the 3.12 install with its Ray start (~85 s, ~55 of them
# CPU): the test costs little more than the dry run.
# Room for a 3x slower machine.
@pytest.mark.timeout(2400)
def test_the_gpu_kit_builds_installs_into_python_312_and_its_device_script_dry_runs(tmp_path):
    out = tmp_path / "figures" / "gpu-figures.json"
    dry: dict = {}

    def dry_run() -> None:
        try:
            dry["done"] = run_group(["bash", "tests/gpu_kit.sh", "--dry-run", "--out", str(out)], 1800)
        except BaseException as e:  # (said by the test's thread below)
            dry["error"] = e

    beside = threading.Thread(target=dry_run, name="gpu-kit-dry-run")
    beside.start()
    try:
        kit = tmp_path / "kit"
        built = run_group([sys.executable, "tests/gpu_kit.py", "build", "--out", str(kit)], 600)
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        made = json.loads((kit / "kit.json").read_text())
        assert {"ray", "simplejpeg", "pydantic", "jsonschema", "datasets"} <= set(made["wheels"])
        assert made["kit_bytes"] + made["tree_bytes"] <= 64 * 2**20
        assert made["ray_trimmed"]["bytes_after"] < 0.6 * made["ray_trimmed"]["bytes_before"]
        rehearsed = run_group([sys.executable, "tests/gpu_kit.py", "rehearse", "--kit", str(kit), "--no-dry-run"],
                              900)
        assert rehearsed.returncode == 0, rehearsed.stdout[-3000:] + rehearsed.stderr[-3000:]
        assert "rehearsal: Ray 2.60" in rehearsed.stdout and "summed 999000" in rehearsed.stdout
    finally:
        beside.join()  # (the dry run's processes end with it: nothing of the test outlives it)
    if "error" in dry:
        raise dry["error"]
    done = dry["done"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    assert list(steps) == ["llama_1b", "resnet50", "checkpoint_1b"]
    assert all(step["status"] == 0 for step in steps.values()), steps
    assert "ratio_so_far" in steps["llama_1b"] and "gpu_lost_per_checkpoint_s" in steps["checkpoint_1b"]
