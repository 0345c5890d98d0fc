"""A model inside the wrappers training puts around it (torch.compile, DDP, FSDP2): the module a state dict is
taken of, and whether its parameters are sharded. Both the worker (worker/parallel.py wraps) and the checkpoints
room (which reads and loads the state) ask.
"""

from __future__ import annotations

import torch


def unwrap(model):
    """The model inside a torch.compile wrapper and/or a DDP wrapper (or the model itself; FSDP2 modules
    are the model)."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


def in_model_dtype(model, dtype: str):
    """The model with every floating-point parameter and buffer in `dtype` (model.dtype: float32 or bfloat16),
    whatever dtype it was built or loaded in: transformers' from_pretrained keeps a checkpoint's stored dtype.
    The workers train in it (worker/precision.master_weights), and export builds in it: a float32 run from a
    bf16 pretrained model was exported into bf16 parameters, a third of its fine-tuning rounded away.
    Non-persistent float32 buffers stay float32, as transformers' from_pretrained(dtype=...) keeps them: a rotary
    embedding's inv_freq in bf16 moved the angles (cos off by 0.1 at position 1,024, 0.4 at 4,096) from the ones
    the model was pretrained with and its export uses."""
    kept = [(module, name, getattr(module, name)) for module in model.modules()
            for name in getattr(module, "_non_persistent_buffers_set", ())
            if getattr(module, name, None) is not None and getattr(module, name).dtype == torch.float32]
    model = model.to(torch.float32 if dtype == "float32" else torch.bfloat16)
    for module, name, buffer in kept:
        setattr(module, name, buffer)
    return model
