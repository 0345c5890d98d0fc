"""Worker side: train.micro_batch_size auto — the largest per-worker micro-batch whose training step fits.

Memory grows with the micro-batch, so a binary search over 1 .. the worker's share of the global batch
finds the largest that fits; the run then uses the largest divisor of the share at or under it, and
accumulation makes up the rest (the global batch never changes).

What "fits" means:
- GPU: a real forward + backward at that size does not raise CUDA's out-of-memory error and its peak
  allocation stays under the cap (default: 90% of the device's memory). The error is recovered from
  (gradients dropped, cache emptied) and the search goes on below.
- CPU: there is no allocator limit to hit, so the step's memory is measured and held against
  train.auto_batch_memory_mb: parameters + gradients + optimizer state + every activation the forward saves
  for the backward (counted with torch's saved-tensors hooks, each storage once).
"""

from __future__ import annotations

from typing import Callable

import torch

from behemoth.errors import ConfigError


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest m in [1, upper] with fits(m), for a monotone fits. 0 if even 1 does not fit."""
    lo, hi = 0, upper  # invariant: fits(lo) (or lo == 0), and nothing above hi fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def step_memory_bytes(model: torch.nn.Module, run_loss: Callable[[], torch.Tensor], optimizer_slots: int) -> int:
    """Bytes one training step holds at its peak (end of forward): weights, gradients, optimizer slots per
    weight (SGD momentum 1, AdamW 2) and the activations saved for the backward. Leaves no gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    param_ptrs = {p.data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run_loss()
    activation_bytes = sum(saved.values())
    del loss  # frees the graph without a backward
    return param_bytes * (2 + optimizer_slots) + activation_bytes


def cuda_step_fits(model: torch.nn.Module, run_loss: Callable[[], torch.Tensor], device, cap_bytes: int) -> bool:
    """A real forward + backward on the GPU: False on out-of-memory or a peak over the cap."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        run_loss().backward()
        ok = torch.cuda.max_memory_allocated(device) <= cap_bytes
    except torch.cuda.OutOfMemoryError:
        ok = False
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return ok


def find_micro_batch(model, loss_at: Callable[[int], torch.Tensor], share: int, device, cap_bytes: int,
                     optimizer_slots: int) -> tuple[int, int]:
    """(largest micro-batch that fits, the micro-batch to use: the largest divisor of `share` not above it).
    `loss_at(m)` runs the forward of a micro-batch of m samples and returns its loss. Raises ConfigError
    (not retried: a restart would search the same way) if one sample does not fit."""
    if device.type == "cuda":
        def fits(m):
            return cuda_step_fits(model, lambda: loss_at(m), device, cap_bytes)
    else:
        def fits(m):
            return step_memory_bytes(model, lambda: loss_at(m), optimizer_slots) <= cap_bytes
    largest = largest_fitting(fits, share)
    if largest == 0:
        raise ConfigError(f"train.micro_batch_size auto: even 1 sample per micro-batch does not fit in "
                          f"{cap_bytes / 2**20:.0f} MiB: raise train.auto_batch_memory_mb, use a smaller model "
                          f"or shard it (scaling.strategy fsdp_full)")
    return largest, largest_divisor_at_most(share, largest)
