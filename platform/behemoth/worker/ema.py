"""Worker side: train.ema_decay, an exponential moving average of the model's weights (and of its float
buffers, BatchNorm's running statistics), updated after every optimizer step on the device with one foreach
lerp per kind (no host sync). When on, evaluation, the best checkpoint's metric, `behemoth eval` and `export`
use the averaged weights; training goes on with the raw ones. Kept in every checkpoint (ema.pt), so a resumed
run averages on exactly where it was.

The average is a plain copy of the model, taken before DDP, activation checkpointing or compile wrap it (so
evaluated eagerly); it follows the model's own parameter and buffer tensors, which those wrappers keep.
"""

from __future__ import annotations

import copy

import torch

from behemoth.models.lora import is_adapted
from behemoth.worker.step_callbacks import Callback


class WeightAverage(Callback):
    """The average, and the loop's callback that updates it after every optimizer step (a skipped non-finite
    step's too: the weights it averages did not change)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        # A LoRA model's frozen base is shared, not copied: it never changes, so it is its own average (a copy
        # doubled the base's memory, and every update and every ema.pt went over all of it)
        self._shared = {id(p): p for p in model.parameters() if not p.requires_grad} if is_adapted(model) else {}
        self.module = copy.deepcopy(model, memo=dict(self._shared)).requires_grad_(False)
        pairs = [(e, p) for e, p in zip(self.module.parameters(), model.parameters()) if id(p) not in self._shared]
        self._ema_params, self._params = [e for e, _ in pairs], [p for _, p in pairs]
        self._buffers = list(model.buffers())
        self._ema_buffers = list(self.module.buffers())
        # A half-precision model's average in fp32: each update's (1 - decay) x the change is below bf16's
        # resolution, so a bf16 average barely moved (2,000 updates at 0.999: 4 % of the way)
        if any(p.dtype in (torch.bfloat16, torch.float16) for p in self._params):
            for tensor in self._ema_params + [b for b in self._ema_buffers if b.is_floating_point()]:
                tensor.data = tensor.data.float()

    @torch.no_grad()
    def update(self) -> None:
        """One step: average <- decay * average + (1 - decay) * weights; integer buffers (counts) copied."""
        floats = list(zip(self._ema_params, self._params))
        floats += [(e, b) for e, b in zip(self._ema_buffers, self._buffers) if e.is_floating_point()]
        same = [(e, w) for e, w in floats if e.dtype == w.dtype]
        if same:
            torch._foreach_lerp_([e for e, _ in same], [w for _, w in same], 1 - self.decay)
        wider = [(e, w) for e, w in floats if e.dtype != w.dtype]  # (an fp32 average of bf16 weights)
        if wider:
            torch._foreach_mul_([e for e, _ in wider], self.decay)
            torch._foreach_add_([e for e, _ in wider], [w for _, w in wider], alpha=1 - self.decay)
        for e, b in zip(self._ema_buffers, self._buffers):
            if not e.is_floating_point():
                e.copy_(b)

    def after_update(self, ctx, state, micro_batches, loss_sum, n_valid) -> None:
        self.update()

    @torch.no_grad()
    def reset(self) -> None:
        """The average set to the model's weights (a run resumed from a checkpoint written without one)."""
        for e, w in zip(self._ema_params + self._ema_buffers, self._params + self._buffers):
            e.copy_(w)

    def state_dict(self) -> dict:
        """The average: of a LoRA model, its adapters (and buffers), as the checkpoint keeps the model's."""
        shared = self._shared_names()
        return {k: v for k, v in self.module.state_dict().items() if k not in shared}

    def load_state_dict(self, state: dict) -> None:
        missing, unexpected = self.module.load_state_dict(state, strict=False)
        missing = [k for k in missing if k not in self._shared_names()]
        if missing or unexpected:
            raise RuntimeError(f"the weight average's state does not fit the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")

    def _shared_names(self) -> set[str]:
        return {name for name, p in self.module.named_parameters(remove_duplicate=False) if id(p) in self._shared}
