"""Worker side: how the model is spread over the workers, and what travels between them.

- `wrap(model, cfg)`: DDP (the host's prepare_model: gloo on CPU, nccl on GPU) or FSDP2 (`fully_shard`:
  gradients and optimizer state sharded with parameters kept whole between forward and backward, the
  ZeRO-2 analogue, or parameters sharded too, ZeRO-3), then an optional gradient-compression hook (DDP) and
  torch.compile.
- Gradient compression: DDP communication hooks. fp16 and bf16 cast each gradient bucket before the
  all-reduce (half the bytes on the wire); PowerSGD sends low-rank factors, with error feedback that each
  rank keeps for itself (its state is saved per rank in the checkpoint: see PowerSGD.to_bytes / load_bytes).
- `no_grad_sync(model)`: the context for the micro-batches of an accumulation that must not all-reduce.

Nothing here knows about Ray: `wrap` asks the worker's host (hosts/) for the device; the tests
drive the rest with plain torch.distributed over gloo.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import time

import torch
import torch.distributed as dist

from behemoth.config import TrainConfig
from behemoth.hosts import collectives
from behemoth.models.wrappers import is_sharded, unwrap
from behemoth.worker import block_transforms as blocks
log = logging.getLogger(__name__)


def wrap(model: torch.nn.Module, cfg, console=print) -> tuple[torch.nn.Module, object]:
    """The model ready for training: (model, compression hook state or None). In torchtitan's order:
    activation checkpointing and compile per block (worker/block_transforms.py), then DDP or FSDP around them."""
    from behemoth import hosts

    checkpointed = blocks.checkpoint_activations(model, cfg.train.activation_checkpointing)
    if checkpointed:
        console(f"activation checkpointing: {checkpointed} of {len(blocks.blocks(model))} blocks")
    compiled = blocks.compile_blocks(model, cfg.train.compile_mode) if cfg.train.compile else []
    # on the device; DDP-wrapped where several workers train it (FSDP shards it below instead)
    model = hosts.current().prepare_model(model, wrap_ddp=cfg.scaling.strategy == "ddp")
    if cfg.scaling.strategy != "ddp":
        shard(model, reshard_after_forward=cfg.scaling.strategy == "fsdp_full", precision=cfg.train.precision)
    hook_state = register_compression(model, cfg.train)
    if compiled:  # compiled in place: the first step checks that compilation works
        model = _CompileOrEager(model, model, cfg.train.compile_mode, console, f"{len(compiled)} blocks",
                                undo=lambda: blocks.uncompile_blocks(compiled))
    elif cfg.train.compile:  # no blocks: the whole model
        model = compile_model(model, cfg.train.compile_mode, console)
    return model, hook_state


# ---------------------------------------------------------------------------------------------------------
# FSDP2


def shard(model: torch.nn.Module, reshard_after_forward: bool, precision: str = "fp32") -> torch.nn.Module:
    """fully_shard each transformer block / residual unit (the classes transformers marks as
    _no_split_modules), then the root. Without such classes only the root is sharded (one all-gather for
    the whole model: correct, less memory saved).

    Under precision bf16/fp16 the sharded parameters stay what they are (fp32 master weights, and so the
    optimizer state), and FSDP's mixed-precision policy gathers them in the low precision for the forward and
    backward (half the bytes on the wire, and the compute's dtype) while gradients are reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    names = set(getattr(model, "_no_split_modules", None) or [])
    if low is not None:  # BatchNorm in fp32 (its running statistics are): a bf16 weight beside them fails
        for module in list(model.modules())[1:]:
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                            mp_policy=MixedPrecisionPolicy())
    for module in list(model.modules())[1:]:
        if type(module).__name__ in names:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def sync_buffers(model) -> None:
    """Give every rank rank 0's buffers (BatchNorm running stats).

    DDP broadcasts buffers at the start of each forward, so after a step every rank holds running stats
    updated with its own micro-batch. Before evaluating or checkpointing, all ranks adopt rank 0's: the same
    values DDP would broadcast at the next step, so evaluation is consistent and the checkpoint is the state.
    """
    if collectives.distributed():
        for buffer in unwrap(model).buffers():
            dist.broadcast(buffer, src=0)


def no_grad_sync(model):
    """Skip the gradient exchange for this backward (all but the last micro-batch of an accumulation)."""
    inner = getattr(model, "_orig_mod", model)
    if is_sharded(inner):
        return _fsdp_no_sync(inner)
    if hasattr(inner, "no_sync"):
        return inner.no_sync()
    return contextlib.nullcontext()  # one worker: nothing to skip


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---------------------------------------------------------------------------------------------------------
# Gradient compression (DDP communication hooks)


def register_compression(model, cfg: TrainConfig):
    """Register train.grad_compression on a DDP model. Returns the hook's state (PowerSGD) or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    kind = cfg.grad_compression
    if kind == "none" or not hasattr(model, "register_comm_hook"):
        return None  # one worker (nothing exchanged) or FSDP (the config refuses compression with it)
    if kind == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if kind == "bf16":
        # torch's bf16_compress_hook insists on NCCL; this is the same cast-all-reduce-decompress on any
        # backend whose all-reduce takes bfloat16 (gloo and nccl do).
        model.register_comm_hook(None, bf16_cast_hook)
        return None
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
        start_powerSGD_iter=cfg.powersgd_warmup_steps, min_compression_rate=2, random_seed=cfg.seed)
    compression = PowerSGD(state, unwrap(model), in_order=dist.get_backend() == "gloo")
    model.register_comm_hook(state, compression.hook)
    return compression


class PowerSGD:
    """torch's PowerSGD hook, with its state kept per parameter across bucket layouts and checkpoints.

    torch keys PowerSGD's state (each rank's error feedback, the warm-start Q factors) by DDP's gradient
    bucket index. DDP builds its buckets in parameter order at start and rebuilds them once, after the first
    step, in the order gradients became ready: so a run restored from a checkpoint starts on another layout
    than the one the state was saved under, and torch's hook would fail on the sizes (or, worse, add one
    parameter's error to another's gradient). The math is per tensor, though: each bucket's error is the
    concatenation of its parameters' errors, and its Q the concatenation of its compressed tensors' Qs (in
    torch's order: grouped by shape). So this class splits the state into per-parameter pieces whenever
    the layout changes and when saving, and reassembles a bucket's entries from them at its next exchange.
    A restored run therefore continues with exactly the state it saved.

    On gloo each bucket's exchange completes before the next starts: PowerSGD all-reduces P, then Q from P's
    completion callback, and with several buckets in flight those second all-reduces can be issued in an
    order that differs between ranks, which gloo aborts on ("op.preamble.length <= op.nbytes"). On CPU
    there is little communication to overlap anyway; NCCL keeps torch's asynchronous exchange.
    """

    def __init__(self, state, module, in_order: bool):
        self.state, self.in_order = state, in_order
        self.names = {p.data_ptr(): name for name, p in module.named_parameters()}
        self.shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
        self.layout: dict[int, list[str]] = {}  # bucket index -> its parameters, in bucket order
        self.pieces: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}  # per parameter

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        index, names = bucket.index(), [self.names[p.data_ptr()] for p in bucket.parameters()]
        if self.layout.get(index, names) != names:  # DDP rebuilt its buckets: move the state over
            self._split_all(clear=True)
        self.layout[index] = names
        if index not in state.error_dict:
            self._assemble(index, names)
        fut = powerSGD_hook.powerSGD_hook(state, bucket)
        if self.in_order:
            fut.wait()
        return fut

    def _compressed(self, names):
        """(name, n, m, rank) of the tensors torch's hook compresses in a bucket, in its Q-memory order."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        by_shape: dict[tuple, list] = {}
        for name in names:
            shape = self.shapes[name]
            n = shape[0]
            m = math.prod(shape) // n
            r = min(n, m, self.state.matrix_approximation_rank)
            if _should_compress(n, m, r, self.state.min_compression_rate)[0]:
                by_shape.setdefault((n, m), []).append((name, n, m, r))
        return [t for group in by_shape.values() for t in group]

    def _split_all(self, clear: bool) -> None:
        state = self.state
        for index, names in self.layout.items():
            if index in state.error_dict:
                sizes = [math.prod(self.shapes[n]) for n in names]
                self.pieces["error"].update(zip(names, state.error_dict[index].split(sizes)))
            if index in state.q_memory_dict and index in state.p_memory_dict:
                compressed = self._compressed(names)
                qs = state.q_memory_dict[index].split([m * r for _, _, m, r in compressed])
                self.pieces["q"].update((name, q) for (name, *_), q in zip(compressed, qs))
        if clear:
            for key in ("error_dict", "p_memory_dict", "q_memory_dict"):
                getattr(state, key).clear()
            self.layout = {}

    def _assemble(self, index: int, names: list[str]) -> None:
        state, errors, qs = self.state, self.pieces["error"], self.pieces["q"]
        if names and all(n in errors for n in names):
            state.error_dict[index] = torch.cat([errors[n].reshape(-1) for n in names])
        compressed = self._compressed(names)
        if compressed and all(name in qs for name, *_ in compressed):
            state.q_memory_dict[index] = torch.cat([qs[name].reshape(-1) for name, *_ in compressed])
            ref = state.q_memory_dict[index]  # P is recomputed every step: only its buffer is needed
            state.p_memory_dict[index] = torch.empty(sum(n * r for _, n, _, r in compressed), dtype=ref.dtype,
                                                     device=ref.device)

    def to_bytes(self) -> bytes:
        self._split_all(clear=False)
        with _quiet_powersgd():
            values = {k: v for k, v in self.state.__getstate__().items()
                      if k not in ("error_dict", "p_memory_dict", "q_memory_dict")}
        # PowerSGD's numpy RandomState as plain numbers, so that loading needs no pickle (weights_only=True)
        _, keys, pos, has_gauss, cached_gaussian = values.pop("rng").get_state()
        values["rng_state"] = {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                               "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
        buf = io.BytesIO()
        torch.save({"state": values, "pieces": {k: {n: t.clone() for n, t in d.items()}
                                                for k, d in self.pieces.items()}}, buf)
        return buf.getvalue()

    def load_bytes(self, saved: bytes, device) -> None:
        # weights_only: tensors and plain values only, never a pickle (a checksum proves integrity, not who
        # wrote the file: whoever can write the bucket must not get code run on every worker).
        import numpy as np

        saved = torch.load(io.BytesIO(saved), map_location=device, weights_only=True)
        rng_state = saved["state"].pop("rng_state")
        rng = np.random.RandomState()
        rng.set_state(("MT19937", rng_state["keys"].cpu().numpy().astype(np.uint32), rng_state["pos"],
                       rng_state["has_gauss"], rng_state["cached_gaussian"]))
        empty = {"error_dict": {}, "p_memory_dict": {}, "q_memory_dict": {}}
        with _quiet_powersgd():
            self.state.__setstate__({**saved["state"], "rng": rng, **empty})
        self.pieces, self.layout = saved["pieces"], {}


def bf16_cast_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(world)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


@contextlib.contextmanager
def _quiet_powersgd():
    """PowerSGDState warns on every pickle that its process group is not saved: we know, and reset it."""
    logger = logging.getLogger("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------------------------------------------------
# torch.compile


def compile_model(model, mode: str, console=print):
    """torch.compile of the whole model with a first-call check: compilation happens lazily at the first
    forward, so the returned wrapper falls back to the eager model (and says so) if that first compilation
    fails."""
    return _CompileOrEager(torch.compile(model, mode=mode), model, mode, console, "the whole model")


class _CompileOrEager(torch.nn.Module):
    """`compiled` until its first call fails, then `eager` (after `undo`: blocks compiled in place)."""

    def __init__(self, compiled, eager, mode, console, what: str, undo=None):
        super().__init__()
        self._orig_mod = eager  # the same attribute name torch's OptimizedModule uses
        self._compiled, self._mode, self._console, self._checked = compiled, mode, console, False
        self._what, self._undo = what, undo

    def forward(self, *args, **kwargs):
        if self._checked:
            return self._compiled(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            out = self._compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compiler failure: train eagerly rather than not at all
            self._console(f"torch.compile (mode {self._mode}, {self._what}) failed, training eagerly: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            if self._undo is not None:
                self._undo()
            self._compiled = self._orig_mod
            out = self._orig_mod(*args, **kwargs)
        else:
            self._console(f"torch.compile (mode {self._mode}, {self._what}): first step compiled in "
                          f"{time.perf_counter() - t0:.1f} s")
        self._checked = True
        return out

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)


def grad_norm(model: torch.nn.Module, clip: float | None = None) -> torch.Tensor:
    """The L2 norm of all the model's gradients, a device tensor (no host sync); clipped to `clip` first where
    given (the norm returned is the one before clipping). Under FSDP the gradients are shards (DTensors): their
    norm is reduced over the ranks, so every rank holds the same value."""
    params = [p for p in model.parameters() if p.grad is not None]
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
