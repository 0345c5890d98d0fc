"""Worker side: training state <-> a checkpoint directory, with a manifest written last and verified on load.

A checkpoint directory holds:
  model.pt, optimizer.pt, scheduler.pt   torch state dicts (the model unwrapped from DDP; under FSDP the full
                                         state gathered by torch.distributed.checkpoint's get_state_dict)
  scaler.pt                              the fp16 gradient scaler's state (train.precision fp16 only)
  comm_hook.pt                           each rank's gradient-compression state (PowerSGD only)
  train_state.json                       step, epoch, step in epoch, samples consumed, world size
  classes.json                           class index -> name (image jobs)
  job.yaml                               the job config that produced it
  manifest.json                          format version, every other file's size and sha256 — written last

No RNG state is stored: the loop reseeds from (seed, rank, step) every step and augmentation draws from
(seed, epoch, sample), so random state is a function of the position, which train_state.json records.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or damaged. The message names the directory and the file."""


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done in the whole run
    epoch: int = 0  # the epoch in progress
    step_in_epoch: int = 0  # optimizer steps done in that epoch
    samples_seen: int = 0  # global samples trained on in the whole run
    world_size: int = 1  # workers when the checkpoint was written (elastic runs log a change)


class Copies:
    """Host copies of device or host tensors, some of them possibly still in flight.

    On CPU the copies deferred by snapshot(overlap=True) run in a thread (torch's copy releases the GIL);
    on GPU every copy is queued non-blocking on the current stream and an event follows them: later kernels
    on that stream (the next step's optimizer update) run after them by stream order.
    """

    def __init__(self, now: list, later: list):
        self.thread = self.event = None
        self.errors: list[BaseException] = []  # a failed background copy must fail the checkpoint, not vanish
        for dst, src in now:
            dst.copy_(src, non_blocking=src.is_cuda)
        if later and not any(src.is_cuda for _, src in later):
            self.thread = threading.Thread(target=self._copy_all, args=(later,), name="behemoth-snapshot",
                                           daemon=True)
            self.thread.start()
            return
        for dst, src in later:
            dst.copy_(src, non_blocking=src.is_cuda)
        if any(src.is_cuda for _, src in now + later):
            self.event = torch.cuda.Event()
            self.event.record()

    def _copy_all(self, pairs: list) -> None:
        try:
            for dst, src in pairs:
                dst.copy_(src)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait_sources_free in the caller's thread
            self.errors.append(e)

    def wait_sources_free(self) -> None:
        """Return once the live tensors may change again (before the next optimizer update)."""
        if self.thread is not None:
            self.thread.join()
        if self.errors:
            raise CheckpointError(f"copying the training state for a checkpoint failed: {self.errors[0]!r}")

    def wait_done(self) -> None:
        """Return once every copy has landed in host memory (before writing the files)."""
        self.wait_sources_free()
        if self.event is not None:
            self.event.synchronize()


@dataclass
class Snapshot:
    """The training state copied to host memory: what a checkpoint directory will hold, file by file.
    Taking it is the only part of a checkpoint the training step waits for when saving in the background."""

    state_dicts: dict  # file name -> state dict of CPU tensors (torch.save)
    texts: dict  # file name -> text
    step: int
    copies: Copies | None = None  # tensor copies possibly still in flight (snapshot(overlap=True))

    def wait_sources_free(self) -> None:
        if self.copies is not None:
            self.copies.wait_sources_free()


def snapshot(*, model, optimizer, scheduler, state: TrainState, classes: list[str] | None, job_yaml: str,
             scaler=None, hook_states: list | None = None, buffers: dict | None = None,
             overlap: bool = False) -> Snapshot | None:
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
    from behemoth.parallel import is_sharded

    copies = None
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(unwrap(model), optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if torch.distributed.get_rank() != 0:
            return None
    else:
        pool, pairs = ({} if buffers is None else buffers), []
        model_sd = _host_buffers(unwrap(model).state_dict(), pool, "model", pairs)
        optim_sd = _host_buffers(optimizer.state_dict(), pool, "optimizer", pairs)
        volatile = {b.data_ptr() for b in unwrap(model).buffers()}
        deferred = [overlap and src.data_ptr() not in volatile for _, src in pairs]
        copies = Copies([p for p, d in zip(pairs, deferred) if not d], [p for p, d in zip(pairs, deferred) if d])
        if not overlap:
            copies.wait_done()
    dicts = {"model.pt": model_sd, "optimizer.pt": optim_sd, "scheduler.pt": scheduler.state_dict()}
    if scaler is not None and scaler.is_enabled():
        dicts["scaler.pt"] = scaler.state_dict()
    if hook_states is not None:  # per-rank gradient-compression state (PowerSGD error feedback)
        dicts["comm_hook.pt"] = {"world_size": len(hook_states), "ranks": hook_states}
    texts = {"train_state.json": json.dumps(asdict(state), indent=1), "job.yaml": job_yaml}
    if classes is not None:
        texts["classes.json"] = json.dumps(classes)
    return Snapshot(dicts, texts, state.step, copies)


def write(directory: str | Path, snap: Snapshot) -> Path:
    """Write a snapshot as a checkpoint directory; the manifest goes last, so its presence means complete."""
    if snap.copies is not None:
        snap.copies.wait_done()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name, sd in snap.state_dicts.items():
        torch.save(sd, d / name)
    for name, text in snap.texts.items():
        (d / name).write_text(text)
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(d.iterdir())
             if p.is_file() and p.name != MANIFEST}
    tmp = d / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format_version": FORMAT_VERSION, "files": files}, indent=1))
    os.replace(tmp, d / MANIFEST)
    return d


def save(directory: str | Path, **state) -> Path:
    """Snapshot and write in one call (the synchronous path; DDP or a single process)."""
    return write(directory, snapshot(**state))


def _host_buffers(tree, pool: dict, path: str, pairs: list):
    """The state dict with every tensor replaced by a host buffer (pool[path] reused when it fits; pinned
    for CUDA tensors) that no longer aliases the training state; the (buffer, source) pairs still to copy
    are appended to `pairs`."""
    if isinstance(tree, torch.Tensor):
        t = tree.detach()
        buf = pool.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = pool[path] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        pairs.append((buf, t))
        return buf
    if isinstance(tree, dict):
        return {k: _host_buffers(v, pool, f"{path}/{k}", pairs) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_host_buffers(v, pool, f"{path}/{i}", pairs) for i, v in enumerate(tree))
    return tree


def verify(directory: str | Path) -> dict:
    """Check every file against the manifest. Returns the manifest or raises CheckpointError naming the file."""
    d = Path(directory)
    manifest_path = d / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {d} has no {MANIFEST}: it was not completely written")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {d}: {MANIFEST} is unreadable ({e})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {d} has format {manifest.get('format_version')}, "
                              f"this behemoth reads {FORMAT_VERSION}")
    for name, expected in files.items():
        p = d / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint {d}: {name} is missing")
        if p.stat().st_size != expected["size"] or _sha256(p) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {d}: {name} does not match its manifest (size or sha256)")
    return manifest


def load(directory: str | Path, *, model, optimizer=None, scheduler=None, scaler=None,
         hook_state=None) -> TrainState:
    """Verify, then restore the given objects in place. Returns the saved TrainState."""
    from behemoth.parallel import is_sharded

    d = Path(directory)
    verify(d)
    model_sd = torch.load(d / "model.pt", map_location="cpu", weights_only=True)
    optim_sd = torch.load(d / "optimizer.pt", map_location="cpu", weights_only=True) if optimizer else None
    if is_sharded(model):  # every rank hands the full state; FSDP keeps its own shard of it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(unwrap(model), optimizer if optimizer else [], model_state_dict=model_sd,
                       optim_state_dict=optim_sd or {}, options=StateDictOptions(full_state_dict=True))
    else:
        unwrap(model).load_state_dict(model_sd)
        if optimizer is not None:
            optimizer.load_state_dict(optim_sd)
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(d / "scheduler.pt", weights_only=True))
    if scaler is not None and scaler.is_enabled() and (d / "scaler.pt").is_file():
        scaler.load_state_dict(torch.load(d / "scaler.pt", weights_only=True))
    if hook_state is not None and (d / "comm_hook.pt").is_file():
        saved = torch.load(d / "comm_hook.pt", weights_only=True)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if saved["world_size"] == world:  # each rank's error feedback is its own; a resize starts it afresh
            hook_state.load_bytes(saved["ranks"][rank], device=next(unwrap(model).parameters()).device)
    return TrainState(**json.loads((d / "train_state.json").read_text()))


def read_state(directory: str | Path) -> TrainState:
    return TrainState(**json.loads((Path(directory) / "train_state.json").read_text()))


def complete_checkpoints(folder: str | Path) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints in a run folder whose manifest was written, newest step first.
    Unreadable train state counts as step -1 (verification names the problem when it is restored)."""
    found = []
    for path in Path(folder).glob("checkpoint_*") if Path(folder).is_dir() else []:
        if (path / MANIFEST).is_file():
            try:
                step = read_state(path).step
            except (OSError, ValueError, TypeError):
                step = -1
            found.append((step, str(path)))
    return sorted(found, reverse=True)


def unwrap(model):
    """The model inside a torch.compile wrapper and/or a DDP wrapper (or the model itself; FSDP2 modules
    are the model)."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


# Fault injection for the failure tests (tests/integration/test_fault_tolerance.py), never set in real runs:
# BEHEMOTH_FAULT_KILL_IN_UPLOAD=RUN_NAME:STEP:MARKER SIGKILLs the process uploading the checkpoint of STEP of
# run RUN_NAME after its files reached the run folder and before its manifest did, once: the marker file
# records it.
FAULT_ENV = "BEHEMOTH_FAULT_KILL_IN_UPLOAD"


def fault_injection_point(step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    import ray.train

    run, at, marker = spec.split(":", 2)
    if run == ray.train.get_context().get_experiment_name() and int(at) == step and not os.path.exists(marker):
        Path(marker).write_text(f"killed pid {os.getpid()} while uploading step {step}\n")
        os.kill(os.getpid(), 9)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
