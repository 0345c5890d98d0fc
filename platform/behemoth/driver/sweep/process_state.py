"""A lane's process as a fresh Ray Train worker would find it: the global state a trial may change, taken
before the lane's first trial and put back before every trial and every in-lane restart.

A trial through Ray Train starts in a new process; a lane's trials share one. Whatever a task or a model's
code sets process-wide (the default dtype, deterministic algorithms, anomaly mode, cuDNN and TF32 switches,
Python's, NumPy's and torch's global random state, torch's thread count) would otherwise reach the next trial
in that lane, whose result would then depend on the lane it landed in.
"""

from __future__ import annotations

import random

import numpy as np
import torch

# torch's default seed: what a fresh process's CUDA generators start from
_TORCH_DEFAULT_SEED = 67280421310721


class FreshState:
    """The process-wide state a trial may change, as it was when taken."""

    def __init__(self):
        self.default_dtype = torch.get_default_dtype()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        self.grad_enabled = torch.is_grad_enabled()
        self.matmul_precision = _matmul_precision()
        self.cuda_matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
        cudnn = torch.backends.cudnn
        self.cudnn = (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32)
        self.threads = torch.get_num_threads()
        self.python_random = random.getstate()
        self.numpy_random = np.random.get_state()
        self.torch_random = torch.get_rng_state()
        self.cuda_random = _cuda_rng_states()

    def restore(self) -> None:
        torch.set_default_dtype(self.default_dtype)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.autograd.set_detect_anomaly(*self.anomaly)
        torch.set_grad_enabled(self.grad_enabled)
        if self.matmul_precision is not None:
            torch.set_float32_matmul_precision(self.matmul_precision)
        torch.backends.cuda.matmul.allow_tf32 = self.cuda_matmul_tf32
        cudnn = torch.backends.cudnn
        cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = self.cudnn
        torch.set_num_threads(self.threads)
        random.setstate(self.python_random)
        np.random.set_state(self.numpy_random)
        torch.set_rng_state(self.torch_random)
        if _cuda_rng_states() is not None:  # CUDA in use now: as it was, or as a fresh process starts it
            if self.cuda_random is not None:
                torch.cuda.set_rng_state_all(self.cuda_random)
            else:
                torch.cuda.manual_seed_all(_TORCH_DEFAULT_SEED)

    def differences(self) -> list[str]:
        """What differs now from this state (the tests' check; not the random states, which any trial moves)."""
        now = FreshState()
        return [name for name in ("default_dtype", "deterministic", "anomaly", "grad_enabled", "matmul_precision",
                                  "cuda_matmul_tf32", "cudnn", "threads") if getattr(now, name) != getattr(self, name)]


def _matmul_precision() -> str | None:
    """torch's float32 matmul precision, None where torch will not say (it refuses once both its legacy and
    its new precision switches have been used; allow_tf32 is then taken alone)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def _cuda_rng_states():
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


_FRESH: list[FreshState] = []


def fresh_state() -> FreshState:
    """The lane process's state before its first trial (taken at the first call)."""
    if not _FRESH:
        _FRESH.append(FreshState())
    return _FRESH[0]
