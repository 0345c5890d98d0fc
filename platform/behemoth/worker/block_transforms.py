"""Worker side: a model's repeated blocks (transformer layers, residual units), and what is applied block by
block: activation checkpointing (train.activation_checkpointing) and torch.compile (train.compile). The loop
applies them in torchtitan's order: checkpointing, then compile, then FSDP or DDP (worker/parallel.py).

Per block rather than the whole model: a model's N identical blocks compile once and are reused (a 22-layer
Llama compiles one layer), the graph breaks of the model's glue code (masks, position ids, heads) stay outside
the compiled code, and FSDP's per-block communication stays between compiled regions. Checkpointing a block
keeps only its input for the backward and recomputes its inside: the activation memory of a deep model drops to
about a block's worth, for about one more forward's compute.
"""

from __future__ import annotations

import functools

import torch

# The residual units of the image models behemoth builds: transformers' ResNet marks its conv layers as
# _no_split_modules (FSDP's unit), too small for checkpointing or compiling; the built-in RegNet marks none.
_RESIDUAL_UNITS = frozenset({"ResNetBasicLayer", "ResNetBottleNeckLayer", "XLayer"})


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, in order: residual units of the image models above, else the classes the
    model marks as _no_split_modules (a transformers decoder's layers), outermost only; [] if it marks none."""
    found = [m for m in model.modules() if type(m).__name__ in _RESIDUAL_UNITS]
    if not found:
        names = set(getattr(model, "_no_split_modules", None) or [])
        found = [m for m in list(model.modules())[1:] if type(m).__name__ in names]
    inner = {id(sub) for block in found for sub in list(block.modules())[1:]}
    return [block for block in found if id(block) not in inner]


def checkpoint_activations(model: torch.nn.Module, policy) -> int:
    """train.activation_checkpointing: "none", "full" (every block) or n (every n-th block, from the first).
    Each chosen block's forward runs under torch.utils.checkpoint (non-reentrant): the same gradients, its
    inner activations recomputed in the backward. Returns the number of blocks checkpointed."""
    every = {"none": 0, "full": 1}.get(policy, policy)
    if not every:
        return 0
    chosen = blocks(model)[::every]
    for block in chosen:
        block.forward = functools.partial(_checkpointed, block, block.forward)
    return len(chosen)


def _checkpointed(block: torch.nn.Module, forward, *args, **kwargs):
    norms = [m for m in block.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.training and m.track_running_stats]
    if not norms:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    calls = []

    def run(*a, **k):
        # The recomputation in the backward runs the block's forward a second time: its batch-norm layers
        # would update their running statistics twice. The second run puts them back as they were.
        calls.append(None)
        if len(calls) == 1:
            return forward(*a, **k)
        saved = [(m, [b.clone() for b in _stats(m)]) for m in norms]
        try:
            return forward(*a, **k)
        finally:
            with torch.no_grad():
                for m, values in saved:
                    for buffer, value in zip(_stats(m), values):
                        buffer.copy_(value)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


def _stats(norm) -> list[torch.Tensor]:
    return [b for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked) if b is not None]


def compile_blocks(model: torch.nn.Module, mode: str) -> list[torch.nn.Module]:
    """torch.compile each block in place (nn.Module.compile: the module, its parameters and state-dict keys
    stay as they are). Returns the blocks compiled ([]: the model has none; compile it whole)."""
    chosen = blocks(model)
    for block in chosen:
        block.compile(mode=mode)
    return chosen


def uncompile_blocks(chosen: list[torch.nn.Module]) -> None:
    """Back to eager (a compilation that failed at the first step)."""
    for block in chosen:
        block._compiled_call_impl = None
