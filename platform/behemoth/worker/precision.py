"""Mixed precision: one autocast context and one gradient scaler, chosen by train.precision.

- fp32: no autocast; the scaler is disabled (its calls pass straight through).
- bf16: autocast to bfloat16 on CPU or GPU. bf16 keeps fp32's exponent range, so no loss scaling is needed.
- fp16: autocast to float16 on GPU with a GradScaler (dynamic loss scaling against fp16 underflow); its
  state travels in the checkpoint. The config refuses fp16 without a GPU.
Weights and optimizer state stay fp32 in every mode (`master_weights`: a model built or loaded in another
dtype, e.g. a pretrained checkpoint stored in bf16, is made fp32 before training), unless the job asks for pure
bf16 training (model.dtype: bfloat16).
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


def master_weights(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The model in model.dtype (models/wrappers.in_model_dtype): AdamW's state takes its parameters' dtype."""
    from behemoth.models.wrappers import in_model_dtype

    return in_model_dtype(model, dtype)


def device_settings(model: torch.nn.Module, device: torch.device, tf32: bool, channels_last: bool) -> torch.nn.Module:
    """What a GPU run sets before training (nothing on a CPU), every run alike (a sweep's lane trains trial
    after trial in one process: each sets them again from its own job):
    - TF32 for fp32 matmuls and convolutions (train.tf32; Ampere and newer);
    - cuDNN's benchmark mode: the built-in tasks' batches have one shape, so the fastest convolution algorithm
      is searched once, at the first step;
    - channels_last weights for convolutional models (`channels_last`: the task's say): the tensor cores'
      layout; the image task's input arrives NHWC already (pixel_values permutes a uint8 NHWC batch)."""
    if device.type != "cuda":
        return model
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True
    return model.to(memory_format=torch.channels_last) if channels_last else model
