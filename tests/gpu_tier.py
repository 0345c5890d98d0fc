"""The GPU tier: one prepared command for a machine with one CUDA GPU (`./run.sh test-gpu`, or on the lent GPU
machine through the GPU kit: `bash tests/gpu_kit.sh`, docs/testing.md).

    ./run.sh test-gpu [--part first|second|all] [--only STEP,STEP] [--budget SECONDS]
    ./run.sh test-gpu --dry-run      # no GPU needed: the real-shape benches at toy sizes on the CPU

Steps in priority order (a lending is 15 minutes and one command 10: the figures that matter first, each step
under its own time limit and the part under --budget), in two parts:
  first: a. llama_1b: a TinyLlama-1.1B-shaped Llama, seq 2048, bf16 autocast over fp32 masters, each layer
            compiled, fused AdamW (`bench/step_overhead.py --tinyllama`): floors MFU >= 40 % and tokens/s >= 0.97
            of the plain script with the same model, compile and optimizer;
         b. resnet50: ResNet-50 at 224 from JPEGs through behemoth's pipeline on the machine's CPUs
            (`bench/resnet50_feed.py`): floors >= 0.9 of GPU-resident synthetic batches and >= 0.95 of a plain
            DataLoader script (5 %: both GPU-bound, they are equal within noise);
         c. checkpoint_1b: the 1.1B model's asynchronous checkpoint (`bench/checkpoint_blocking.py --tinyllama`):
            the GPU time a step loses per checkpoint <= 1/10 of torch.save's;
  second: d. gpu_tests: the GPU-marked tests (none may be skipped; among them a step of every built-in task under
            torch.cuda.set_sync_debug_mode);
         e. data_scaling: the 224-px JPEG pipeline at 2, 8 and 16 CPUs (`bench/data_scaling.py`, floor 85 % per CPU;
            each count also against N x the one-core limit);
         f. the demos on one GPU (image: nccl, bf16; language model: bf16, its MFU) and the step rate at the demo
            LM's step (`bench/step_overhead.py --gpu`, floor 0.97 of a plain loop);
         g. document_attention: packed documents' attention at TinyLlama's width, FlexAttention's block mask against
            the dense mask and the unmasked step (`bench/document_attention.py --device cuda`).
A bench under its floor exits 1 and the tier fails, with the figure. The figures go to gpu-figures.json
(`$OUT/gpu-figures.json` when $OUT is set), rewritten after every step, with the machine (GPU, CPUs, torch and
CUDA versions) and the MFU convention; every step's whole output to one log beside it (gpu-tier.log): two files,
whatever the part (a device call returns at most 8).

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
# The first part must leave a rerun room in a 15-minute lending whose machine takes 1-2 minutes to start: the
# kit's install and import checks (~30-45 s) plus these steps stay under the call's 600 s.
FIRST_BUDGET_S = 520
MFU_CONVENTION = ("model FLOPs per sample = 3 x the forward's FLOPs counted by torch.utils.flop_counter on a real "
                  "forward (matmuls, attention; no recomputation counted), over the GPU's dense bf16 data-sheet peak "
                  "(behemoth.metrics.GPU_PEAK_TFLOPS: H100 SXM and H200 989 TFLOP/s)")


def steps(storage: str, part: str = "all", dry_run: bool = False) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in seconds) of a part, in priority order."""
    where = ["--set", f"checkpoint.storage_path={storage}"]
    first = [
        ("llama_1b", [PY, "bench/step_overhead.py", "--tinyllama", "--repeats", "1", "--steps", "80",
                      "--log-every", "20"], 210),
        ("resnet50", [PY, "bench/resnet50_feed.py", "--steps", "60", "--warmup", "15"], 130),
        ("checkpoint_1b", [PY, "bench/checkpoint_blocking.py", "--tinyllama", "--every", "200"], 180),
    ]
    second = [
        ("gpu_tests", [PY, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests"], 90),
        # the 224-px JPEG pipeline alone (no GPU used; its floor: 85 % per CPU at 16 of the rate at 2)
        ("data_scaling", [PY, "bench/data_scaling.py", "--cpus", "2,8,16", "--seconds", "8"], 130),
        ("demo_images", [PY, "-m", "behemoth", "train", "jobs/configs/demo_images.yaml", *GPU_SET, *where,
                         "--set", "checkpoint.run_name=gpu_demo_images"], 70),
        ("demo_lm", [PY, "-m", "behemoth", "train", "jobs/configs/demo_lm.yaml", *GPU_SET, *where,
                     "--set", "checkpoint.run_name=gpu_demo_lm"], 80),
        ("step_rate", [PY, "bench/step_overhead.py", "--gpu", "--repeats", "2", "--floor", "0.97"], 100),
        # packed documents' attention at TinyLlama's width (4 of its 22 layers): FlexAttention's block mask against
        # the dense mask and the unmasked step, at 2,048 and 8,192 tokens (issue 74 item 2)
        ("document_attention", [PY, "bench/document_attention.py", "--device", "cuda", "--hidden", "2048", "--heads",
                                "32", "--kv-heads", "4", "--layers", "4", "--vocab", "32000", "--seq", "2048", "8192",
                                "--repeats", "1", "--steps", "5"], 150),
    ]
    chosen = {"first": first, "second": second, "all": first + second}[part]
    if dry_run:  # the real-shape benches' code paths at their toy sizes on the CPU, no tight limits: the step's own
        # options where they hold at a toy size (llama_1b's one repeat: the bench's default of 5 was most of the
        # dry run's time), the toy size's own where they are the GPU's (resnet50's steps, checkpoint_1b's interval)
        kept = {"llama_1b": None, "resnet50": 2, "checkpoint_1b": 3}
        return [(name, [*command[:kept[name]], "--tiny"], 900) for name, command, _ in chosen if name in kept]
    return chosen


def socket_root(base: str | None = None) -> str:
    """A short folder for the tier's TMPDIR: Ray's session sockets go 3 levels under it (and the GPU tests' suite
    folder adds one), and a Unix socket's path may hold at most 107 bytes (tests/unit/test_gpu_kit.py)."""
    return tempfile.mkdtemp(prefix="bg", dir=base or "/tmp")


def figures(name: str, out: str) -> dict:
    """The numbers a step printed, for the results file (the output's tail is kept beside them). A figure may be
    negative: the GPU time lost per checkpoint is measured against the median step, so noise gives -0.1 s."""
    found = {}
    patterns = {
        "val_accuracy": r"val_acc(?:uracy)?[ =:]+([0-9.]+)", "samples_per_s": r"([0-9.]+) samples/s",
        "mfu": r"MFU ([0-9.]+)%", "peak": r"peak: ([^)]*)\)", "wall_s": r"wall time: +([0-9.]+) s",
        "ratio": r"ratio [^:]*: (?:median )?([0-9.]+)", "skipped": r"(\d+) skipped", "passed": r"(\d+) passed",
        "failed": r"(\d+) failed", "scaling_efficiency": r"scaling efficiency at \d+ CPUs: ([0-9.]+)",
        "vs_synthetic": r"behemoth / synthetic: ([0-9.]+)", "vs_dataloader": r"behemoth / dataloader: ([0-9.]+)",
        "save_over_blocked": r"torch.save / behemoth async ([0-9.]+)x", "floors": r"floors?: ([^\n]+)",
        "ratio_so_far": r"repeat \d+: .*ratio ([0-9.]+)",
        "tokens_per_s": r"behemoth \(1 Ray Train worker\).*\(([0-9,]+) tokens/s",
        "gpu_lost_per_checkpoint_s": r"GPU time lost per checkpoint: median (-?[0-9.]+) s",
        "torch_save_s": r"synchronous torch.save: +blocked median ([0-9.]+)",
        "save_over_lost": r"torch.save / GPU time lost ([0-9.]+)x",
        "flex_vs_unmasked": r"flex time ([0-9.]+)x, memory [0-9.]+x", "dense_vs_unmasked": r"dense time ([0-9.]+)x"}
    for key, pattern in patterns.items():
        hits = re.findall(pattern, out)
        if hits:
            found[key] = hits[-1]
    return found


def _text(stream) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def run_group(command: list[str], limit_s: float, env: dict | None = None,
              log: Path | None = None) -> subprocess.CompletedProcess:
    """`command` in a process group of its own; where it outlives `limit_s` (TimeoutExpired, with its output) or
    the caller is stopped, the whole group is ended: SIGINT first, so that a bench's Python exits through its
    atexit and its local Ray instance with it (a killed driver's Ray would hold the GPU for the next step), then
    SIGKILL after 30 s. `log`: the output (stdout and stderr, interleaved) is appended to it line by line as
    it is printed, each line after the seconds since the step began, so a call killed from outside keeps what
    the running step printed; the result's stdout is that output."""
    import signal

    # SIGINT at its default in the step's process: a shell without job control starts its background commands
    # with SIGINT ignored, and a child inherits that (Python then installs no KeyboardInterrupt handler), so the
    # SIGINT below ended nothing and every step over its limit waited 30 s for its SIGKILL (the unit test's
    # step did, under CI), its Ray left behind
    argv = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
            "os.execvp(sys.argv[1], sys.argv[1:])", *command]
    if log is not None:
        import threading

        child = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, text=True, errors="replace")
        lines: list[str] = []
        began = time.monotonic()

        def copy() -> None:  # each line into the log at once, with the step's seconds (where its time went)
            with log.open("a") as sink:
                for line in child.stdout:
                    lines.append(line)
                    sink.write(f"{time.monotonic() - began:7.1f} {line}")
                    sink.flush()

        copier = threading.Thread(target=copy, daemon=True)
        copier.start()

        def communicate(timeout=None):
            child.wait(timeout)
            copier.join(10)
            return "".join(lines), ""
    else:
        child = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env, start_new_session=True)
        communicate = child.communicate
    try:
        out, err = communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        _end_group(child, signal)
        out, err = communicate()
        raise subprocess.TimeoutExpired(command, limit_s, out, err) from None
    finally:
        _end_group(child, signal)
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def _end_group(child: subprocess.Popen, signal) -> None:
    if child.poll() is not None:
        return
    os.killpg(child.pid, signal.SIGINT)
    try:
        child.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def run_step(name: str, command: list[str], limit_s: int, log: Path, tmp: str | None = None) -> dict:
    """Run one step; its whole output is appended to `log` (one log for the tier) as it is printed, its figures
    and the output's tail go to the result. `tmp`: its TMPDIR (Ray's sessions follow it: a local instance of the tier's own, never
    a user's cluster found in Ray's default temp dir; removed with the tier's folder)."""
    started = time.time()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if tmp is not None:
        os.makedirs(tmp, exist_ok=True)
        env["TMPDIR"] = tmp
    with log.open("a") as f:
        f.write(f"\n===== {name}: {' '.join(command)} (limit {limit_s} s) =====\n")
    try:
        done = run_group(command, limit_s, env, log=log)
        out, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out, status = f"{_text(e.stdout)}{_text(e.stderr)}\n[gpu tier] {name}: over its {limit_s} s", "timeout"
    with log.open("a") as f:
        f.write(f"===== {name}: status {status} after {time.time() - started:.0f} s =====\n")
    result = {"command": " ".join(command), "status": status, "seconds": round(time.time() - started, 1),
              "limit_s": limit_s, **figures(name, out), "tail": out[-3000:]}
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


def cpu_side_checks(chosen: list) -> list[str]:
    """What can be checked without a GPU: every chosen step's command line is one the tools accept."""
    problems = []
    for name, command, _ in chosen:
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


def machine() -> dict:
    """What the figures were measured on."""
    import torch

    gpu = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name(0) if gpu else "none (cpu)", "cpus": os.cpu_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if gpu else None,
            "mfu_convention": MFU_CONVENTION}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(os.environ["OUT"] if os.environ.get("OUT") else REPO, "gpu-figures.json")
    p.add_argument("--out", type=Path, default=default_out, help="the results file (JSON); the log goes beside it")
    p.add_argument("--part", choices=["first", "second", "all"], default="all",
                   help="first: the 1.1B step, ResNet-50 fed from JPEGs, the 1.1B checkpoint; second: the GPU-marked "
                        "tests, the pipeline's scaling, the demos, the demo LM's step rate")
    p.add_argument("--only", help="these steps of the part, comma-separated (a rerun of what a lending missed)")
    p.add_argument("--budget", type=float, help="seconds for the part's steps: a step gets at most what is left "
                                                f"(default {FIRST_BUDGET_S} for --part first)")
    p.add_argument("--dry-run", action="store_true", help="the real-shape benches at toy sizes on the CPU")
    args = p.parse_args()
    import torch

    if args.dry_run:
        # torch.compile's calls made, its compilation not: on a GPU it generates Triton kernels, which a CPU cannot
        # rehearse, and its CPU code generation (~45 s of the dry run's ~175 s on 2 cores) is tested where it
        # matters here (tests/unit/test_blocks.py, tests/integration/test_speed_switches.py). The steps' processes
        # and the Ray instances they start inherit it.
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
    root = socket_root()
    storage = os.path.join(root, "s")
    chosen = steps(storage, args.part, dry_run=args.dry_run)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {name for name, _, _ in steps(storage, "all")}
        if unknown:
            p.error(f"--only names no step: {', '.join(sorted(unknown))}")
        chosen = [step for step in chosen if step[0] in wanted]
    budget = args.budget or (FIRST_BUDGET_S if args.part == "first" else None)
    if not torch.cuda.is_available() and not args.dry_run:
        demo_data()
        problems = cpu_side_checks(chosen)
        for problem in problems:
            print(f"[gpu tier] CPU-side check failed: {problem}", flush=True)
        why = (f"torch {torch.__version__} is a CPU build (./run.sh installs BEHEMOTH_TORCH_SPEC: name a CUDA build)"
               if torch.version.cuda is None and Path("/dev/nvidiactl").exists() else "no CUDA GPU on this machine")
        print(f"[gpu tier] CPU-side checks {'failed' if problems else 'passed'}; {why}: "
              f"the GPU tier runs on a machine with one (./run.sh test-gpu there)", flush=True)
        _cleaned(root, 1)
        return NO_GPU
    if any(name.startswith("demo") for name, _, _ in chosen):
        demo_data()
    return _cleaned(root, run_steps(chosen, args.out, root, budget))


def _cleaned(root: str, status: int) -> int:
    """The tier's folder (run folders, Ray's sessions) removed when every step passed; kept, and named, when not."""
    import shutil

    if status == 0:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"[gpu tier] its folder is kept for inspection (run folders, Ray's logs): {root}", flush=True)
    return status


def run_steps(chosen: list, out: Path, root: str, budget: float | None = None) -> int:
    """Each step in order under its own limit and what is left of `budget`; the figures rewritten after each."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_name("gpu-tier.log")
    log.write_text("")
    results = {**machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": {}}
    began = time.monotonic()
    for name, command, limit_s in chosen:
        left = None if budget is None else int(budget - (time.monotonic() - began))
        if left is not None and left < 20:
            results["steps"][name] = {"status": "not run: the part's budget is spent", "budget_s": budget}
            out.write_text(json.dumps(results, indent=1))
            continue
        limit = limit_s if left is None else min(limit_s, left)
        print(f"[gpu tier] {name} (limit {limit} s): {' '.join(command)}", flush=True)
        results["steps"][name] = run_step(name, command, limit, log, tmp=os.path.join(root, "t"))
        out.write_text(json.dumps(results, indent=1))
        shown = {k: v for k, v in results["steps"][name].items() if k not in ("tail", "command")}
        print(f"[gpu tier] {name}: {shown}", flush=True)
    failed = [name for name, r in results["steps"].items() if r["status"] != 0]
    print(f"[gpu tier] figures in {out}, output in {log}; "
          f"{'failed: ' + ', '.join(failed) if failed else 'every step passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
