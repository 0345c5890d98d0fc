"""Pure functions and a tiny accumulator for what the loop reports. No Ray, no torch.distributed."""

from __future__ import annotations

import math
import sys
import os
import time
import uuid
from dataclasses import dataclass, field


@dataclass
class Window:
    """Accumulates loss and timing between two reports. The loss, the sample count and the unreadable samples
    stay what the step made them (tensors on the device, in a training run) until the report reads them: a step
    never waits for the device to hand a number to the host."""

    loss_sum: float = 0.0
    loss_count: int = 0
    steps: int = 0
    data_wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    bad_samples: list = field(default_factory=list)  # the tasks' bad_samples tensors (ids, -1 for readable)
    grad_norms: list = field(default_factory=list)  # each step's gradient norm (a 0-d tensor)

    def add(self, loss_sum: float, count: int, data_wait_s: float, bad_samples=(), grad_norm=None) -> None:
        self.loss_sum += loss_sum
        self.loss_count += count
        self.steps += 1
        self.data_wait_s += data_wait_s
        self.bad_samples.extend(b for b in bad_samples if b is not None)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)

    def grad_norm_stats(self) -> tuple[float | None, int, int | None]:
        """(the mean of the window's finite gradient norms or None, how many were not finite, the 0-based index
        in the window of the first that was not, or None); a copy to the host: report steps only."""
        if not self.grad_norms:
            return None, 0, None
        import torch

        norms = torch.stack([n.detach().float().reshape(()) for n in self.grad_norms])
        finite = torch.isfinite(norms)
        values, flags = norms[finite].tolist(), finite.tolist()
        bad = flags.count(False)
        return (sum(values) / len(values) if values else None), bad, (flags.index(False) if bad else None)

    def bad_sample_ids(self) -> set[int]:
        """The ids of the window's unreadable samples (a copy to the host: report steps only)."""
        return {i for b in self.bad_samples for i in b.reshape(-1).tolist() if i >= 0}

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.started, 1e-9)


# A sent report carries the logged steps held back since the previous one under this key (the worker's
# worker/report_sender.py); the run's records expand them (tracking/callbacks.py).
LOGGED = "logged_before"
# A checkpoint's report carries its score for retention under this key (Ray's CheckpointConfig
# checkpoint_score_attribute, and a lane's alike; driver/run/resume.py retention): the run's metric where the step
# evaluated it finite, else the worst finite number in its direction (not NaN or inf: Ray's checkpoint manager
# stores the scores as JSON through pydantic, which writes those as null, and a restarted controller's ranking
# would then fail on None). Not a metric of the run: the records leave it out.
CHECKPOINT_SCORE = "checkpoint_score"


def checkpoint_score(value, order: str) -> float:
    """A checkpoint's CHECKPOINT_SCORE: `value` (the run's metric, None where not evaluated) if finite, else
    the worst finite number for `order` ("max" or "min")."""
    worst = -sys.float_info.max if order == "max" else sys.float_info.max
    return float(value) if value is not None and math.isfinite(value) else worst


def logged_reports(report: dict) -> list[dict]:
    """A report as it reached Ray Train -> the logged steps it stands for, oldest first, itself last (without
    the checkpoint's retention score)."""
    last = {k: v for k, v in report.items() if k not in (LOGGED, CHECKPOINT_SCORE)}
    return [*report.get(LOGGED, []), last]


PHASES = ("step", "data_wait", "eval", "checkpoint", "report")


def proc_start_time() -> float | None:
    """When this process started, on the wall clock: Linux's /proc start time (None without /proc)."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces; fields from the 3rd on
        since_boot = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks after boot
        # Dated from now back, on the clock starttime counts on (CLOCK_BOOTTIME): /proc/stat's btime is whole
        # seconds, which would put the start up to 1 s early.
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _first_marks() -> dict:
    """The training function's start, and its process's (a restarted group's new processes: the restart's
    split between Ray starting them and their set-up)."""
    started = proc_start_time()
    return {"started": time.time(), **({"process": started} if started is not None else {})}


@dataclass
class PhaseClock:
    """Where one worker group's time goes, as rank 0 sees it: the goodput account (behemoth.tracking.goodput)
    is built from it. `marks`: wall-clock times (time.time) of the training function's milestones, from its
    start to the first step; `totals`: seconds per phase since the loop started, cumulative. Every report
    carries `snapshot()` taken as the report begins, so between two reports the phases' growth accounts for
    the wall time between them (what is left over is loop bookkeeping, shown as unaccounted)."""

    group_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    marks: dict = field(default_factory=_first_marks)
    totals: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def mark(self, name: str) -> None:
        self.marks[name] = time.time()

    def mark_once(self, name: str) -> None:
        if name not in self.marks:
            self.marks[name] = time.time()

    def add(self, phase: str, seconds: float) -> float:
        self.totals[phase] += seconds
        return seconds

    def snapshot(self) -> dict:
        return {"group_id": self.group_id, "wall_time": time.time(),
                **{f"mark_{k}": v for k, v in self.marks.items()},
                **{f"time_{k}_s": v for k, v in self.totals.items()}}


def throughput(samples: int, seconds: float) -> float:
    return samples / max(seconds, 1e-9)


def data_wait_fraction(wait_s: float, total_s: float) -> float:
    """Share of step time spent waiting for the next batch: near 1 means add CPUs, near 0 means add GPUs."""
    return min(max(wait_s / max(total_s, 1e-9), 0.0), 1.0)


def format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_line(m: dict, total_steps: int, epochs: float, task_fields: list[str] = ()) -> str:
    """One concise console line per report; `epochs`: those the run trains (fewer than train.epochs where
    train.max_steps ends it first); `task_fields`: the task's own (its validation metrics)."""
    parts = [f"epoch {m['epoch']:.2f}/{epochs:g}" if epochs == int(epochs) else f"epoch {m['epoch']:.2f}/{epochs:.2f}",
             f"step {m['step']}/{total_steps}"]
    if "loss" in m:
        parts += [f"loss {m['loss']:.4f}", f"lr {m['lr']:.3g}"]
        if "grad_norm" in m:
            parts.append(f"grad-norm {m['grad_norm']:.3g}")
        if m.get("skipped_steps"):
            parts.append(f"skipped {m['skipped_steps']}")
        parts.append(f"{m['samples_per_s']:.0f} samples/s")
        if "tokens_per_s" in m:
            parts.append(f"{m['tokens_per_s']:.0f} tokens/s")
        parts.append(f"data-wait {m['data_wait_frac']:.0%}")
        if "mfu" in m:
            parts.append(f"MFU {m['mfu']:.1%}")
        elif "tflops_per_worker" in m:
            parts.append(f"{m['tflops_per_worker']:.3g} TFLOP/s/worker")
        if "peak_mem_gb" in m:
            parts.append(f"mem {m['peak_mem_gb']:.2f} GB")
        parts.append(f"eta {format_eta(m['eta_s'])}")
    return " | ".join([*parts, *task_fields])


# ---------------------------------------------------------------------------------------------------------
# Model FLOPs utilisation and memory. torch only (imported lazily: the pure functions above stay light).

# Dense peak TFLOP/s per GPU from the vendors' data sheets (no sparsity), by precision. fp32 means TF32
# tensor cores where the card has them (what fp32 matmuls run on with train.tf32, the default), else plain
# fp32; fp32_no_tf32: the plain fp32 units (train.tf32: false).
# A key is matched to the device's name word by word ("NVIDIA H100 80GB HBM3" is H100; "NVIDIA L40" is not
# L4): its longest matching key; a name with a variant word no matching key has (PCIe, NVL: other clocks and
# power) matches none, and MFU then waits for train.peak_tflops.
GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0, "fp32_no_tf32": 67.0},  # SXM
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0, "fp32_no_tf32": 67.0},  # SXM
    "GH200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0, "fp32_no_tf32": 67.0},
    "H100 PCIE": {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0, "fp32_no_tf32": 51.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0, "fp32_no_tf32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0, "fp32_no_tf32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5, "fp32_no_tf32": 90.5},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0, "fp32_no_tf32": 31.2},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0, "fp32_no_tf32": 30.3},
    "V100": {"bf16": 15.7, "fp16": 125.0, "fp32": 15.7, "fp32_no_tf32": 15.7},  # no bf16 or TF32 tensor cores
    "T4": {"bf16": 8.1, "fp16": 65.0, "fp32": 8.1, "fp32_no_tf32": 8.1},
}


def training_flops_per_sample(forward_fn, batch_size: int, device=None) -> float:
    """Model FLOPs of one training sample: the forward's matmul/conv/attention FLOPs (counted by torch's
    FlopCounterMode on a real forward) times 3 (the backward costs about twice the forward). On a CPU `device`
    the forward's attention runs on SDPA's math kernel: the CPU's fused one has no formula in torch's counter
    (a causal LM's attention counted nothing: 3.7x too few FLOPs at 1,024 tokens); the GPU kernels have theirs."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    on_cpu = device is not None and torch.device(device).type == "cpu"
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH) if on_cpu else contextlib.nullcontext(), counter:
        forward_fn()
    return 3.0 * counter.get_total_flops() / batch_size


def peak_flops(device, precision: str, override_tflops: float | None = None,
               tf32: bool = True) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the figure comes from), or (None, why not).

    Only a peak the device cannot beat makes MFU meaningful: the user's `train.peak_tflops`, or a known GPU's
    data sheet. A CPU has no such figure here (a matmul timed on cores that other processes share is no
    ceiling: the model itself can beat it), nor has a GPU missing from the table: for those the
    reports carry the achieved TFLOP/s instead, and MFU only once train.peak_tflops is set."""
    import torch

    if override_tflops:
        return override_tflops * 1e12, f"train.peak_tflops {override_tflops:g}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        column = "fp32_no_tf32" if precision == "fp32" and not tf32 else precision
        table = gpu_peak_table(name)
        if table is not None:
            return table[column] * 1e12, f"data sheet for {name}, {column.replace('fp32_no_tf32', 'fp32 without TF32')}"
        return None, f"{name} is not in behemoth's data-sheet table: set train.peak_tflops for MFU"
    return None, "no data-sheet peak for a CPU: set train.peak_tflops for MFU"


GPU_VARIANT_WORDS = {"PCIE", "NVL"}


def gpu_peak_table(name: str) -> dict[str, float] | None:
    """GPU_PEAK_TFLOPS's row for a device name (torch.cuda.get_device_name), or None: see the table."""
    import re

    words = set(re.split(r"[\s_-]+", name.upper()))
    matching = [key for key in GPU_PEAK_TFLOPS if set(key.split()) <= words]
    if not matching:
        return None
    key = max(matching, key=lambda k: len(k.split()))
    return None if (words & GPU_VARIANT_WORDS) - set(key.split()) else GPU_PEAK_TFLOPS[key]


def mfu(flops_per_sample: float, samples_per_s: float, devices: int, device_peak_flops: float) -> float:
    """Model FLOPs utilisation: the model's useful FLOP/s over the devices' combined peak."""
    return flops_per_sample * samples_per_s / max(devices * device_peak_flops, 1e-9)


def peak_memory_bytes(device) -> int:
    """The most memory this worker has held: CUDA's max allocated on GPU, the process's peak RSS on CPU."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
