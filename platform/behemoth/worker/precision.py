"""Mixed precision: one autocast context and one gradient scaler, chosen by train.precision.

- fp32: no autocast; the scaler is disabled (its calls pass straight through).
- bf16: autocast to bfloat16 on CPU or GPU. bf16 keeps fp32's exponent range, so no loss scaling is needed.
- fp16: autocast to float16 on GPU with a GradScaler (dynamic loss scaling against fp16 underflow); its
  state travels in the checkpoint. The config refuses fp16 without a GPU.
Weights and optimizer state stay fp32 in every mode.
"""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16" and device.type == "cuda")
