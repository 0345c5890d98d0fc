"""The GPU tier: one prepared command for a machine with one CUDA GPU (`./run.sh test-gpu`, <= 11 minutes).

    ./run.sh test-gpu [--out gpu-tier.json]

Steps, each under its own time limit, one after the other:
  1. the GPU-marked tests (`pytest -m gpu`): none may be skipped;
  2. the image demo on the GPU: 1 worker, nccl, bf16 (`behemoth train jobs/configs/demo_images.yaml` with the
     GPU overrides): its accuracy, samples/s and wall time;
  3. the language-model demo on the GPU in bf16: its MFU against the GPU's data-sheet peak;
  4. the step-rate bench (`bench/step_overhead.py --gpu`) and the checkpoint-stall bench
     (`bench/checkpoint_blocking.py --gpu`), two repeats each;
  5. the image input pipeline's scaling with CPUs (`bench/data_scaling.py`: `behemoth data bench --cpus N` at
     2, 4, 8 and 16 CPUs; fails under 85 % per CPU at 16 of the rate at 2).
Each step's figures and the tail of its output go to the JSON file (default gpu-tier.json; `$OUT/gpu-tier.json`
when $OUT is set), written after every step, so a step that runs out of time keeps what came before it; each
step's whole output to a log beside it (gpu-tier-STEP.log).

Without a GPU it runs its CPU-side checks (every step's command line is valid: the demo configs with the GPU
overrides pass `behemoth check`, the benches parse their options), then refuses with one line and exit status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
GPU_SET = ["--set", "scaling.use_gpu=true", "--set", "scaling.num_workers=1", "--set", "scaling.cpus_per_worker=2",
           "--set", "train.precision=bf16"]
NO_GPU = 3  # exit status: the tier needs a GPU


def steps(storage: str) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in seconds); together within the tier's 11 minutes."""
    where = ["--set", f"checkpoint.storage_path={storage}"]
    return [
        ("gpu_tests", [PY, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests"], 55),
        ("demo_images", [PY, "-m", "behemoth", "train", "jobs/configs/demo_images.yaml", *GPU_SET, *where,
                         "--set", "checkpoint.run_name=gpu_demo_images"], 65),
        ("demo_lm", [PY, "-m", "behemoth", "train", "jobs/configs/demo_lm.yaml", *GPU_SET, *where,
                     "--set", "checkpoint.run_name=gpu_demo_lm"], 75),
        ("step_rate", [PY, "bench/step_overhead.py", "--gpu", "--repeats", "2"], 110),
        ("checkpoint_stall", [PY, "bench/checkpoint_blocking.py", "--gpu", "--repeats", "2"], 175),
        # the 224-px JPEG pipeline alone at 2-16 of the machine's CPUs (no GPU used; its floor: 85 % per CPU)
        ("data_scaling", [PY, "bench/data_scaling.py"], 170),
    ]


def figures(name: str, out: str) -> dict:
    """The numbers a step printed, for the results file (the output's tail is kept beside them)."""
    found = {}
    patterns = {
        "val_accuracy": r"val_acc(?:uracy)?[ =:]+([0-9.]+)", "samples_per_s": r"([0-9.]+) samples/s",
        "mfu": r"MFU ([0-9.]+)%", "peak": r"peak: ([^)]*)\)", "wall_s": r"wall time: +([0-9.]+) s",
        "ratio": r"ratio [^:]*: (?:median )?([0-9.]+)", "skipped": r"(\d+) skipped", "passed": r"(\d+) passed",
        "failed": r"(\d+) failed", "scaling_efficiency": r"scaling efficiency at \d+ CPUs: ([0-9.]+)"}
    for key, pattern in patterns.items():
        hits = re.findall(pattern, out)
        if hits:
            found[key] = hits[-1]
    return found


def _text(stream) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def run_step(name: str, command: list[str], limit_s: int, log: Path) -> dict:
    """Run one step; its whole output goes to `log`, its figures and the output's tail to the result."""
    started = time.time()
    try:
        done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=limit_s)
        out, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out, status = f"{_text(e.stdout)}{_text(e.stderr)}\n[gpu tier] {name}: over its {limit_s} s", "timeout"
    log.write_text(out)
    result = {"command": " ".join(command), "status": status, "seconds": round(time.time() - started, 1),
              **figures(name, out), "log": str(log), "tail": out[-3000:]}
    if name == "gpu_tests" and result.get("skipped", "0") != "0":
        result["status"] = f"{status} (tests skipped on a GPU machine: the tier expects none)"
    return result


def demo_data() -> None:
    """The demos' data, as ./run.sh demo and demo-lm make it (once; data/ is not in git)."""
    behemoth = [PY, "-m", "behemoth", "data"]
    made = [
        ("data/demo_images/train", [*behemoth, "synth-images", "--out", "data/demo_images"]),
        ("data/demo_text/train.jsonl", [*behemoth, "synth-text", "--out", "data/demo_text"]),
        ("data/demo_text/tokenizer/tokenizer.json", [*behemoth, "train-tokenizer", "data/demo_text/train.jsonl",
                                                     "--vocab-size", "1024", "--out", "data/demo_text/tokenizer"]),
    ]
    for path, command in made:
        if not (REPO / path).exists():
            subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=600)


def cpu_side_checks(storage: str) -> list[str]:
    """What can be checked without a GPU: every step's command line is one the tools accept."""
    problems = []
    for name, command, _ in steps(storage):
        if command[1:3] == ["-m", "behemoth"]:
            check = [PY, "-m", "behemoth", "check", *command[4:]]
        elif command[1].startswith("bench/"):
            check = [PY, command[1], "--help"]
        else:
            continue
        done = subprocess.run(check, check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            problems.append(f"{name}: `{' '.join(check)}` failed: {(done.stdout + done.stderr).strip()[-500:]}")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(os.environ["OUT"], "gpu-tier.json") if os.environ.get("OUT") else REPO / "gpu-tier.json"
    p.add_argument("--out", type=Path, default=default_out, help="the results file (JSON)")
    args = p.parse_args()
    import torch

    storage = tempfile.mkdtemp(prefix="gpu-tier-")
    demo_data()
    problems = cpu_side_checks(storage)
    for problem in problems:
        print(f"[gpu tier] CPU-side check failed: {problem}", flush=True)
    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU build (./run.sh installs BEHEMOTH_TORCH_SPEC: name a CUDA build)"
               if torch.version.cuda is None and Path("/dev/nvidiactl").exists() else "no CUDA GPU on this machine")
        print(f"[gpu tier] CPU-side checks {'failed' if problems else 'passed'}; {why}: "
              f"the GPU tier runs on a machine with one (./run.sh test-gpu there)", flush=True)
        return NO_GPU
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "started": time.time(), "steps": {}}
    for name, command, limit_s in steps(storage):
        print(f"[gpu tier] {name}: {' '.join(command)}", flush=True)
        results["steps"][name] = run_step(name, command, limit_s, args.out.with_name(f"{args.out.stem}-{name}.log"))
        args.out.write_text(json.dumps(results, indent=1))
        shown = {k: v for k, v in results["steps"][name].items() if k not in ("tail", "command")}
        print(f"[gpu tier] {name}: {shown}", flush=True)
    failed = [name for name, r in results["steps"].items() if r["status"] != 0]
    print(f"[gpu tier] figures in {args.out}; {'failed: ' + ', '.join(failed) if failed else 'every step passed'}")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
