"""Worker side: a run's live objects (model, optimizer, schedule, scaler, compression state) -> a host-memory
snapshot -> a checkpoint directory (behemoth.storage.checkpoint's format), and back into the objects on restore."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from behemoth.storage.checkpoint import (EMA_FILE, MODEL_FILE, Snapshot, TrainState, is_sharded_format,
                                         verify, write)
from behemoth.storage.run_store import RunStore
from behemoth.errors import CheckpointError
from behemoth.storage.weights import frozen_names
from behemoth.models.lora import is_adapted
from behemoth.hosts import collectives
from behemoth.checkpoints import sharded
from behemoth.models.wrappers import is_sharded, unwrap


class Copies:
    """Host copies of device or host tensors, some of them possibly still in flight.

    On CPU the copies deferred by snapshot(overlap=True) run in a thread (torch's copy releases the GIL).
    On GPU every copy is queued non-blocking on a side stream (one per device, after what the compute stream
    has queued so far: the step's update), into pinned buffers, so the next step's kernels do not queue behind
    them (DCP's DefaultStager does the same for sharded checkpoints). The compute stream waits, on the GPU and
    not the host, for the immediate copies (buffers such as BatchNorm statistics, which the next forward
    changes) at once and for the deferred ones before the next optimizer update (`wait_sources_free`); the
    writer waits on the host for all of them (`wait_done`).
    """

    def __init__(self, now: list, later: list):
        self.thread = self.event = None
        self.errors: list[BaseException] = []  # a failed background copy must fail the checkpoint, not vanish
        cuda = [src for _, src in now + later if src.is_cuda]
        if cuda:
            self._on_side_stream(now, later, cuda[0].device)
            return
        for dst, src in now:
            dst.copy_(src)
        if later:
            self.thread = threading.Thread(target=self._copy_all, args=(later,), name="behemoth-snapshot",
                                           daemon=True)
            self.thread.start()

    def _on_side_stream(self, now: list, later: list, device) -> None:
        compute, side = torch.cuda.current_stream(device), _side_stream(device)
        side.wait_stream(compute)  # the copies read the state as the step left it
        with torch.cuda.stream(side):
            for dst, src in now:
                dst.copy_(src, non_blocking=True)
            now_done = torch.cuda.Event()
            now_done.record(side)
            for dst, src in later:
                dst.copy_(src, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(side)
        for _, src in now + later:
            if src.is_cuda:
                src.record_stream(side)  # the allocator keeps a source alive until the side stream is past it
        compute.wait_event(now_done)

    def _copy_all(self, pairs: list) -> None:
        try:
            for dst, src in pairs:
                dst.copy_(src)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait_sources_free in the caller's thread
            self.errors.append(e)

    def wait_sources_free(self) -> None:
        """Before the next optimizer update: once it returns, the live tensors may change again (on a GPU the
        compute stream is told to wait for the copies: the host goes on at once)."""
        if self.thread is not None:
            self.thread.join()
        if self.event is not None:
            torch.cuda.current_stream(self.event.device).wait_event(self.event)
        if self.errors:
            raise CheckpointError(f"copying the training state for a checkpoint failed: {self.errors[0]!r}")

    def wait_done(self) -> None:
        """Return once every copy has landed in host memory (before writing the files)."""
        if self.thread is not None:
            self.thread.join()
        if self.errors:
            raise CheckpointError(f"copying the training state for a checkpoint failed: {self.errors[0]!r}")
        if self.event is not None:
            self.event.synchronize()


_SIDE_STREAMS: dict = {}


def _side_stream(device) -> "torch.cuda.Stream":
    """One copy stream per device for the process's snapshots (streams are few: never one per checkpoint)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def snapshot(*, model, optimizer, scheduler, state: TrainState, task_files: dict[str, str | bytes], job_yaml: str,
             scaler=None, hook_states: list | None = None, buffers: dict | None = None,
             overlap: bool = False, metrics: dict | None = None, ema=None) -> Snapshot | None:
    """Copy the state to host memory. Under FSDP every rank must call it (the full state is gathered) and
    only rank 0 gets the snapshot; under DDP call it on rank 0 only (the ranks are identical).

    `buffers`: host tensors from an earlier snapshot to copy into (same shapes), filled in as needed. Reusing
    them saves allocating and page-faulting the whole state again at every checkpoint, which costs as much
    as the copy itself. The caller must not pass buffers a snapshot still being written uses.

    `overlap` (DDP or one process): the model's buffers (BatchNorm statistics: the next forward updates them)
    are copied before returning; parameters and optimizer state, which only the optimizer update changes,
    are copied while the next step's forward and backward run. The caller must call
    `snap.wait_sources_free()` before that update; `write` waits for the copies itself.
    """
    copies = None
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(unwrap(model), optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if torch.distributed.get_rank() != 0:
            return None
    else:
        pool, pairs = ({} if buffers is None else buffers), []
        model_sd = _host_buffers(trained_state(unwrap(model)), pool, "model", pairs)
        optim_sd = _host_buffers(optimizer.state_dict(), pool, "optimizer", pairs)
        # the names of the numbered parameters: a load matches the moments to parameters by name, not place
        optim_sd["param_names"] = param_names(optimizer, model)
        # (the weight average changes only after the optimizer's update, as the parameters do)
        ema_sd = None if ema is None else _host_buffers(ema.state_dict(), pool, "ema", pairs)
        volatile = {b.data_ptr() for b in unwrap(model).buffers()}
        deferred = [overlap and src.data_ptr() not in volatile for _, src in pairs]
        copies = Copies([p for p, d in zip(pairs, deferred) if not d], [p for p, d in zip(pairs, deferred) if d])
        if not overlap:
            copies.wait_done()
    dicts, texts = extras(scheduler=scheduler, state=state, task_files=task_files, job_yaml=job_yaml, scaler=scaler,
                          hook_states=hook_states, metrics=metrics)
    dicts = {MODEL_FILE: model_sd, "optimizer.pt": optim_sd, **dicts}
    if ema is not None and not is_sharded(model):
        dicts[EMA_FILE] = ema_sd
    return Snapshot(dicts, texts, state.step, copies)


def extras(*, scheduler, state: TrainState, task_files: dict[str, str | bytes], job_yaml: str, scaler=None,
           hook_states: list | None = None, metrics: dict | None = None) -> tuple[dict, dict]:
    """(state dicts, texts) of a checkpoint's files besides the model and optimizer state: the schedule,
    scaler, compression state, train state, the task's own files, metrics and job, taken on rank 0."""
    dicts = {"scheduler.pt": scheduler.state_dict()}
    if scaler is not None and scaler.is_enabled():
        dicts["scaler.pt"] = scaler.state_dict()
    if hook_states is not None:  # per-rank gradient-compression state (PowerSGD error feedback)
        dicts["comm_hook.pt"] = {"world_size": len(hook_states), "ranks": hook_states}
    texts = {"train_state.json": json.dumps(asdict(state), indent=1), "job.yaml": job_yaml}
    ours = {*texts, *dicts, "metrics.json", "model.pt", "optimizer.pt", EMA_FILE, "manifest.json",
            "state_values.json"}
    if any(name in ours or name.startswith("state/") for name in task_files):
        raise ValueError(f"the task's checkpoint files {sorted(task_files)} would replace behemoth's own")
    texts.update(task_files)
    if metrics is not None:  # what the run reported with this checkpoint: picks a run's best, fills a model card
        texts["metrics.json"] = json.dumps(metrics, indent=1)
    return dicts, texts


def save(directory: str | Path, **state) -> Path:
    """Snapshot and write in one call (the synchronous path; DDP or a single process)."""
    return write(directory, snapshot(**state))


def _host_buffers(tree, pool: dict, path: str, pairs: list, seen: dict | None = None):
    """The state dict with every tensor replaced by a host buffer (pool[path] reused when it fits; pinned
    for CUDA tensors) that no longer aliases the training state; the (buffer, source) pairs still to copy
    are appended to `pairs`. A tensor under two keys (tied embeddings) gets one buffer under both, which
    torch.save writes once (a buffer each wrote a tied 1B model's embedding twice)."""
    seen = {} if seen is None else seen
    if isinstance(tree, torch.Tensor):
        t = tree.detach()
        same = (t.data_ptr(), t.device, t.dtype, tuple(t.shape), t.stride())
        if t.numel() and same in seen:
            return seen[same]
        buf = pool.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = pool[path] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        pairs.append((buf, t))
        seen[same] = buf
        return buf
    if isinstance(tree, dict):
        return {k: _host_buffers(v, pool, f"{path}/{k}", pairs, seen) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_host_buffers(v, pool, f"{path}/{i}", pairs, seen) for i, v in enumerate(tree))
    return tree


def opened(ckpt):
    """A host's checkpoint value as (a local folder, its shards read where they are or None, whether the folder
    is a copy on this node), for `load`: opened where its run store keeps it (storage/run_store.RunStore.opened:
    in place, by range, or copied once per node)."""
    return RunStore.of_checkpoint(ckpt).opened(ckpt.path)


@contextlib.contextmanager
def opened_on_every_rank(ckpt) -> Iterator[tuple[Path, object, bool]]:
    """`opened(ckpt)` where it opened on every rank; else CheckpointError on every rank (a node's download
    that does not match the manifest fails on that node only: collectives.on_every_rank)."""
    with contextlib.ExitStack() as stack:
        yield collectives.on_every_rank(lambda: stack.enter_context(opened(ckpt)))


def load(directory: str | Path, *, model, optimizer=None, scheduler=None, scaler=None,
         hook_state=None, remote=None, node_copy: bool = False, ema=None) -> TrainState:
    """Verify, then restore the given objects in place. Returns the saved TrainState.

    Either format under either strategy: a sharded checkpoint through DCP (every rank calls this; it
    reshards to this world size), a full one read whole by each rank (under FSDP each keeps its shard). The
    optimizer state of a full checkpoint written under DDP is keyed by parameter index, under FSDP by name:
    each is converted to what this run's optimizer takes. `remote` (`opened`'s): the shard files are read
    there, by range. `node_copy`: the folder is this node's copy, which the other nodes' ranks do not check.
    In a process group every rank calls it: a file that fails its check on any rank fails it on every rank
    (collectives.on_every_rank), so that all go on to the same next checkpoint."""
    d = Path(directory)

    def read(name: str):  # (a file the checkpoint may lack: None)
        return torch.load(d / name, map_location="cpu", weights_only=True) if (d / name).is_file() else None

    if is_sharded_format(d):
        with optimizer_as_built(optimizer):
            sharded.load(d, model, optimizer, remote, shared=not node_copy)
    else:
        collectives.on_every_rank(lambda: verify(d))  # all ranks skip a copy damaged on one node together
        load_model_and_optimizer(read(MODEL_FILE), read("optimizer.pt") if optimizer else None, d, model=model,
                                 optimizer=optimizer)
    load_the_rest(read, ema=ema, scheduler=scheduler, scaler=scaler)
    if hook_state is not None and (d / "comm_hook.pt").is_file():
        saved = torch.load(d / "comm_hook.pt", weights_only=True)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if saved["world_size"] == world:  # each rank's error feedback is its own; a resize starts it afresh
            hook_state.load_bytes(saved["ranks"][rank], device=next(unwrap(model).parameters()).device)
    return TrainState(**json.loads((d / "train_state.json").read_text()))


def load_model_and_optimizer(model_sd: dict, optim_sd: dict | None, where, *, model, optimizer=None) -> None:
    """A full state's model and optimizer dicts into the live objects (a full checkpoint's, or a lone worker's
    memory copy: checkpoints/memory_copy.py): keyed by parameter index (DDP's) or by name (FSDP's), into either."""
    with optimizer_as_built(optimizer):
        _load_model_and_optimizer(model_sd, optim_sd, where, model, optimizer)


# How an optimizer computes its update, not what it learned: its param groups carry these, and a load puts back
# the saved run's. A run written with train.nonfinite: stop (no fused kernel on a CPU) and resumed with skip (the
# fix its error message names) lost the fused kernel that skip's found_inf needs, and failed every step.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


@contextlib.contextmanager
def optimizer_as_built(optimizer):
    """Around a load of `optimizer`'s state: its param groups keep this run's implementation flags."""
    built = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups] if optimizer else []
    yield
    for group, flags in zip(optimizer.param_groups if optimizer else [], built):
        group.update(flags)


def _load_model_and_optimizer(model_sd: dict, optim_sd: dict | None, where, model, optimizer) -> None:
    saved_names = optim_sd.pop("param_names", None) if optim_sd else None
    names = param_names(optimizer, model) if optimizer is not None else []
    if saved_names is not None and optimizer is not None and saved_names != names:
        # numbered in another order than this run's model numbers them (a model's code that declares its layers
        # in another order): by name, or each moment would go to the parameter now at its place
        if sorted(saved_names) != sorted(names):
            lacks, other = sorted(set(names) - set(saved_names)), sorted(set(saved_names) - set(names))
            raise CheckpointError(f"{where}: its optimizer state does not name this model's parameters (lacks "
                                  f"{lacks[:5]}, names {other[:5]}): the model's code changed since the checkpoint")
        optim_sd = _by_name(optim_sd, saved_names)
    by_name = bool(optim_sd) and _keyed_by_name(optim_sd)
    if is_sharded(model) or by_name:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        if optim_sd and not by_name:
            optim_sd = _by_name(optim_sd, names)
        set_state_dict(unwrap(model), optimizer if optimizer else [], model_state_dict=model_sd,
                       optim_state_dict=optim_sd or {}, options=StateDictOptions(full_state_dict=True))
    else:
        load_trained_state(unwrap(model), model_sd, where)
        if optimizer is not None:
            optimizer.load_state_dict(optim_sd)


def load_the_rest(read, *, ema=None, scheduler=None, scaler=None) -> None:
    """The weight average, schedule and fp16 scaler from `read(file name)` (None: the state has none)."""
    if ema is not None:  # a checkpoint from before train.ema_decay was on: the average starts at its weights
        saved = read(EMA_FILE)
        if saved is not None:
            ema.load_state_dict(saved)
        else:
            ema.reset()
    if scheduler is not None:
        scheduler.load_state_dict(read("scheduler.pt"))
    if scaler is not None and scaler.is_enabled():
        saved = read("scaler.pt")
        if saved is not None:
            scaler.load_state_dict(saved)


def trained_state(module: torch.nn.Module) -> dict:
    """What a checkpoint keeps of the model: its state dict; of a model with LoRA adapters (model.lora), only
    the parameters that train (the adapters, a classifier's head): the frozen base is rebuilt as it was."""
    state = module.state_dict()
    if not is_adapted(module):
        return state
    frozen = frozen_names(module)
    return {k: v for k, v in state.items() if k not in frozen}


def load_trained_state(module: torch.nn.Module, state: dict, where) -> None:
    """`trained_state`'s inverse: every key of the model from `state`, but a LoRA model's frozen base."""
    if not is_adapted(module):
        module.load_state_dict(state)
        return
    frozen = frozen_names(module)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in frozen]
    if missing or unexpected:
        raise CheckpointError(f"{where}: its adapters do not fit the model this job builds (missing: "
                              f"{', '.join(missing[:5]) or 'none'}; not in the model: {', '.join(unexpected[:5]) or 'none'})")


def _keyed_by_name(optim_sd: dict) -> bool:
    """Whether an optimizer state dict names its parameters (torch.distributed's layout) or numbers them
    (optimizer.state_dict()'s)."""
    return any(isinstance(p, str) for group in optim_sd.get("param_groups", []) for p in group["params"])


def param_names(optimizer, model) -> list[str]:
    """The names of the optimizer's parameters, in the order optimizer.state_dict() numbers them."""
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _by_name(optim_sd: dict, order: list[str]) -> dict:
    """optimizer.state_dict()'s layout (parameters numbered in the order of the optimizer's groups) -> keyed
    by parameter name, `order` naming the numbers (the saved run's, or this run's optimizer built by the same
    recipe)."""
    return {"state": {order[i]: v for i, v in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optim_sd["param_groups"]]}
