"""The GPU tier: one prepared command for a machine with one CUDA GPU (`./run.sh test-gpu`).

    ./run.sh test-gpu [--part loop|data|all] [--out gpu-tier.json]
    ./run.sh test-gpu --dry-run      # no GPU needed: the real-shape benches at toy sizes on the CPU

Steps, each under its own time limit, one after the other, in two parts of under 10 minutes each (a lent GPU
machine runs one command for at most 10 minutes; `all`, the default, runs both):
  loop: 1. the GPU-marked tests (`pytest -m gpu`), none may be skipped (among them: a step of every built-in
           task under torch.cuda.set_sync_debug_mode);
        2. the step-rate bench at the demo LM's step (`bench/step_overhead.py --gpu`), floor 0.97 of a plain loop;
        3. a TinyLlama-1.1B-shaped Llama, bf16, each layer compiled, fused AdamW (`bench/step_overhead.py
           --tinyllama`): floors MFU >= 40 % and tokens/s >= 0.97 of the plain script;
        4. its asynchronous checkpoint (`bench/checkpoint_blocking.py --tinyllama`, ~13 GB of weights and AdamW
           state): floor blocked <= 1/10 of torch.save's;
  data: 5. the image demo on the GPU (1 worker, nccl, bf16): its accuracy, samples/s and wall time;
        6. the language-model demo on the GPU in bf16: its MFU against the GPU's data-sheet peak;
        7. ResNet-50 at 224 from ImageNet-shaped JPEGs through behemoth's pipeline (`bench/resnet50_feed.py`):
           floors >= 0.9 of GPU-resident synthetic batches and >= a plain DataLoader script;
        8. the image input pipeline's scaling with CPUs (`bench/data_scaling.py`: `behemoth data bench --cpus N`
           at 2, 4, 8 and 16 CPUs; fails under 85 % per CPU at 16 of the rate at 2).
A bench under its floor exits 1 and the tier fails, with the figure. Each step's figures and the tail of its
output go to the JSON file (default gpu-tier.json; `$OUT/gpu-tier.json` when $OUT is set), written after every
step, so a step that runs out of time keeps what came before it; each step's whole output to a log beside it
(gpu-tier-STEP.log).

Without a GPU it runs its CPU-side checks (every step's command line is valid: the demo configs with the GPU
overrides pass `behemoth check`, the benches parse their options), then refuses with one line and exit status 3;
with --dry-run it runs the three real-shape benches with --tiny on the CPU (their code paths, no floors).
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


def steps(storage: str, part: str = "all", dry_run: bool = False) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in seconds) of a part; each part within 10 minutes."""
    where = ["--set", f"checkpoint.storage_path={storage}"]
    tiny = ["--tiny"] if dry_run else []
    loop = [
        ("gpu_tests", [PY, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests"], 60),
        ("step_rate", [PY, "bench/step_overhead.py", "--gpu", "--repeats", "2", "--floor", "0.97"], 100),
        ("llama_1b", [PY, "bench/step_overhead.py", "--tinyllama", "--repeats", "1", *tiny], 230),
        ("checkpoint_1b", [PY, "bench/checkpoint_blocking.py", "--tinyllama", *tiny], 170),
    ]
    data = [
        ("demo_images", [PY, "-m", "behemoth", "train", "jobs/configs/demo_images.yaml", *GPU_SET, *where,
                         "--set", "checkpoint.run_name=gpu_demo_images"], 65),
        ("demo_lm", [PY, "-m", "behemoth", "train", "jobs/configs/demo_lm.yaml", *GPU_SET, *where,
                     "--set", "checkpoint.run_name=gpu_demo_lm"], 75),
        ("resnet50", [PY, "bench/resnet50_feed.py", *tiny], 220),
        # the 224-px JPEG pipeline alone at 2-16 of the machine's CPUs (no GPU used; its floor: 85 % per CPU)
        ("data_scaling", [PY, "bench/data_scaling.py"], 170),
    ]
    chosen = {"loop": loop, "data": data, "all": loop + data}[part]
    if dry_run:  # the real-shape benches at toy sizes, on the CPU
        return [step for step in chosen if step[0] in ("llama_1b", "checkpoint_1b", "resnet50")]
    return chosen


def figures(name: str, out: str) -> dict:
    """The numbers a step printed, for the results file (the output's tail is kept beside them)."""
    found = {}
    patterns = {
        "val_accuracy": r"val_acc(?:uracy)?[ =:]+([0-9.]+)", "samples_per_s": r"([0-9.]+) samples/s",
        "mfu": r"MFU ([0-9.]+)%", "peak": r"peak: ([^)]*)\)", "wall_s": r"wall time: +([0-9.]+) s",
        "ratio": r"ratio [^:]*: (?:median )?([0-9.]+)", "skipped": r"(\d+) skipped", "passed": r"(\d+) passed",
        "failed": r"(\d+) failed", "scaling_efficiency": r"scaling efficiency at \d+ CPUs: ([0-9.]+)",
        "vs_synthetic": r"behemoth / synthetic: ([0-9.]+)", "vs_dataloader": r"behemoth / dataloader: ([0-9.]+)",
        "save_over_blocked": r"torch.save / behemoth async ([0-9.]+)x", "floors": r"floors?: ([^\n]+)"}
    for key, pattern in patterns.items():
        hits = re.findall(pattern, out)
        if hits:
            found[key] = hits[-1]
    return found


def _text(stream) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def run_step(name: str, command: list[str], limit_s: int, log: Path, tmp: str | None = None) -> dict:
    """Run one step; its whole output goes to `log`, its figures and the output's tail to the result. `tmp`:
    its TMPDIR (Ray's sessions follow it: a local instance of the tier's own, never a user's cluster found in
    Ray's default temp dir; removed with the tier's folder)."""
    started = time.time()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if tmp is not None:
        os.makedirs(tmp, exist_ok=True)
        env["TMPDIR"] = tmp
    try:
        done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=limit_s,
                              env=env)
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
    p.add_argument("--part", choices=["loop", "data", "all"], default="all",
                   help="loop: tests, step rate, the 1B model and its checkpoint; data: demos, ResNet-50 fed from "
                        "JPEGs, the pipeline's scaling (each under 10 minutes)")
    p.add_argument("--dry-run", action="store_true", help="the real-shape benches at toy sizes on the CPU")
    args = p.parse_args()
    import torch

    storage = tempfile.mkdtemp(prefix="gpu-tier-")
    demo_data()
    problems = cpu_side_checks(storage)
    for problem in problems:
        print(f"[gpu tier] CPU-side check failed: {problem}", flush=True)
    if args.dry_run:
        return _cleaned(storage, run_steps(steps(storage, args.part, dry_run=True), args.out, "cpu (dry run)",
                                           problems, storage))
    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU build (./run.sh installs BEHEMOTH_TORCH_SPEC: name a CUDA build)"
               if torch.version.cuda is None and Path("/dev/nvidiactl").exists() else "no CUDA GPU on this machine")
        print(f"[gpu tier] CPU-side checks {'failed' if problems else 'passed'}; {why}: "
              f"the GPU tier runs on a machine with one (./run.sh test-gpu there)", flush=True)
        return NO_GPU
    return _cleaned(storage, run_steps(steps(storage, args.part), args.out, torch.cuda.get_device_name(0), problems,
                                       storage))


def _cleaned(storage: str, status: int) -> int:
    """The tier's folder (run folders, Ray's sessions) removed when every step passed; kept, and named, when not."""
    import shutil

    if status == 0:
        shutil.rmtree(storage, ignore_errors=True)
    else:
        print(f"[gpu tier] its folder is kept for inspection (run folders, Ray's logs): {storage}", flush=True)
    return status


def run_steps(chosen: list, out: Path, device: str, problems: list[str], storage: str | None = None) -> int:
    import torch

    results = {"gpu": device, "torch": torch.__version__, "started": time.time(), "steps": {}}
    for name, command, limit_s in chosen:
        print(f"[gpu tier] {name}: {' '.join(command)}", flush=True)
        results["steps"][name] = run_step(name, command, limit_s, out.with_name(f"{out.stem}-{name}.log"),
                                          tmp=os.path.join(storage, "tmp") if storage else None)
        out.write_text(json.dumps(results, indent=1))
        shown = {k: v for k, v in results["steps"][name].items() if k not in ("tail", "command")}
        print(f"[gpu tier] {name}: {shown}", flush=True)
    failed = [name for name, r in results["steps"].items() if r["status"] != 0]
    print(f"[gpu tier] figures in {out}; {'failed: ' + ', '.join(failed) if failed else 'every step passed'}")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
