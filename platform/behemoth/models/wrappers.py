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
