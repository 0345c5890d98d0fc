"""Pure functions and a tiny accumulator for what the loop reports. No Ray, no torch.distributed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Window:
    """Accumulates loss and timing between two reports."""

    loss_sum: float = 0.0
    loss_count: int = 0
    steps: int = 0
    data_wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, loss_sum: float, count: int, data_wait_s: float) -> None:
        self.loss_sum += loss_sum
        self.loss_count += count
        self.steps += 1
        self.data_wait_s += data_wait_s

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.started, 1e-9)


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


def progress_line(m: dict, total_steps: int, epochs: int) -> str:
    """One concise console line per report."""
    parts = [f"epoch {m['epoch']:.2f}/{epochs}", f"step {m['step']}/{total_steps}"]
    if "loss" in m:
        parts += [f"loss {m['loss']:.4f}", f"lr {m['lr']:.3g}", f"{m['samples_per_s']:.0f} samples/s"]
        if "tokens_per_s" in m:
            parts.append(f"{m['tokens_per_s']:.0f} tokens/s")
        parts += [f"data-wait {m['data_wait_frac']:.0%}", f"eta {format_eta(m['eta_s'])}"]
    if "val_accuracy" in m:
        parts += [f"val_loss {m['val_loss']:.4f}", f"val_acc {m['val_accuracy']:.4f}"]
    if "val_perplexity" in m:
        parts += [f"val_loss {m['val_loss']:.4f}", f"val_ppl {m['val_perplexity']:.3f}"]
    return " | ".join(parts)
