"""Worker side: the rescue checkpoint, the state a worker holds when its group ends under it.

Under DDP every rank holds the whole training state, the same on each: the same all-reduced gradient updates
the same weights. When Ray Train stops a group while its workers train (a worker lost without notice: its process
killed or crashed, its node gone or vanished; an elastic group resized; the run stopped), each live worker
still holds the state after the last step it finished, and one writes it as a checkpoint of the run folder
(manifest last; not registered with Ray Train: restore_latest takes the newest complete checkpoint there). The
next group resumes from it, not from the last periodic checkpoint, and exactly: the data order and the random
state are functions of the step (storage/checkpoint.py). Two moments trigger it, whichever comes first:
- the training thread's error where it is a peer's loss (`is_peer_loss`: the collective it was in failed with
  a connection error, which gloo raises at once when a peer's process dies);
- Ray Train stopping the group while the loop runs (hosts/rescue_callback.py: its workers' shutdown hook, which
  Ray Train gives 5 s before it kills them): where a peer's host vanished without closing its connections (the
  survivors wait in the collective until Ray's health checks end the group) or NCCL waits rather than fails,
  and where nothing failed (an elastic resize, a stop).

Only where the writer's state is the run's, whole and newer than what is saved:
- not under FSDP or sharded checkpoints (each rank holds its own shards), nor with gradient compression
  (PowerSGD keeps each rank's own error feedback);
- a model with persistent buffers (BatchNorm's running statistics) only from rank 0: the other ranks' are their
  own until the next forward broadcasts rank 0's, and a checkpoint takes rank 0's;
- between steps: from the optimizer update's start (`updating`, CheckpointSaver.before_update) until the loop
  counts the step (`stepped`) the weights are a step ahead of the train state; a rescue waits for that span to
  end (up to a second: the update holds no collective) and writes nothing where an error cut it. The model's
  buffers change earlier, in the next step's forward (BatchNorm's statistics; a peer is usually lost in that
  step's backward, and Ray Train's stop comes at any point of it): they are copied when the step is counted,
  and the rescue writes those copies;
- when the step is newer than the checkpoint the run restored or last wrote synchronously (a notice's last);
- with finite weights: under train.nonfinite: stop a step's non-finite gradients end the run only at the next
  report, and the last good checkpoint must stay the latest;
- while this run's driver holds the run folder's lease (storage/runlock.py: the fence is checked first).

The write runs while the group is being stopped: one longer than Ray Train's 5 s is killed, leaves a folder
without a manifest, and the next group removes it (restore.remove_partial_uploads) and resumes from the last
periodic checkpoint, as without a rescue. checkpoint.rescue: false turns it off.

Who writes: on a local or mounted run folder every live worker tries and the first to create the folder writes
it; on an object store (no atomic create) rank 0 and rank 1 (where rank 0 is the one lost) each write a copy of
their own, and the run's end retires the older one with the other unregistered checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

import torch

from behemoth import hosts
from behemoth.checkpoints import live_state
from behemoth.checkpoints.live_state import trained_state
from behemoth.checkpoints.saver import store
from behemoth.checkpoints.trainables import Trainables
from behemoth.hosts.console import console
from behemoth.models.wrappers import is_sharded, unwrap
from behemoth.storage.checkpoint import MODEL_FILE, TrainState
from behemoth.storage.run_store import RunStore

PREFIX = "checkpoint_rescue_step"
UPDATE_WAIT_S = 1.0  # the longest a rescue from Ray Train's shutdown waits for an update in flight to be counted


def is_rescue(path: str) -> bool:
    """Whether a checkpoint folder's path names a rescue checkpoint."""
    return os.path.basename(path.rstrip("/")).startswith(PREFIX)


def why_not(cfg, run: Trainables, rank: int) -> str | None:
    """Why this worker cannot write its run's state as a rescue (None: it can); decided once, as the loop starts."""
    if not cfg.checkpoint.rescue:
        return "checkpoint.rescue is off"
    if is_sharded(run.model) or cfg.checkpoint.sharded(cfg.scaling.strategy):
        return "each rank holds its own shards"
    if run.hook_state is not None:
        return "gradient compression keeps each rank's own state"
    module = unwrap(run.model)
    saved = module.state_dict()
    if rank != 0 and any(name in saved for name, _ in module.named_buffers()):
        return "the model's buffers (BatchNorm statistics) are rank 0's only after they are broadcast"
    return None


def is_peer_loss(error: BaseException | None) -> bool:
    """Whether `error` (or one it was raised from) is a collective failing because a peer went: torch's
    distributed errors (NCCL's, the store's) or gloo's transport errors (a connection reset or closed by the
    peer, a timeout), which torch raises as plain RuntimeErrors naming gloo's transport."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.distributed.DistError):
            return True
        if isinstance(error, RuntimeError) and "gloo/transport" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


class Rescue:
    """One loop's rescue checkpoint: told of each update (`updating`, `stepped`), of an error passing
    (`after_error`), of Ray Train stopping the group (`at_shutdown`) and of the loop's end (`ended`); writes at
    most one checkpoint."""

    def __init__(self, cfg, run: Trainables, state: TrainState, rank: int, task_files: dict, job_yaml: str,
                 fence=None):
        self.run, self.state, self.rank, self.fence = run, state, rank, fence
        self.task_files, self.job_yaml = task_files, job_yaml
        self.off = why_not(cfg, run, rank)
        self.saved_step = state.step  # the newest step known saved: restored, or written synchronously
        self.running = True
        self.written: str | None = None
        self._whole = threading.Lock()  # held by the loop from an update's start until its step is counted
        self._in_update = False
        self._once = threading.Lock()  # one rescue, from whichever thread comes first
        # the model's buffers as the last counted step left them: {state-dict key: (the buffer, its copy)}
        self._buffers = {} if self.off is not None else _buffer_copies(run.model)
        self._copy_pairs = ([c for _, c in self._buffers.values()], [b for b, _ in self._buffers.values()])
        hosts.when_stopped(self.at_shutdown)  # (Ray Train's shutdown of the group: hosts/rescue_callback.py)

    def updating(self) -> None:
        self._whole.acquire()
        self._in_update = True

    def stepped(self) -> None:
        if self._buffers:  # (a few small device copies: BatchNorm's statistics are ~0.1 MB in a ResNet-50)
            torch._foreach_copy_(*self._copy_pairs)
        if self._in_update:  # (the lock is the training thread's: a rescue's own is released by the rescue)
            self._in_update = False
            self._whole.release()

    def ended(self) -> None:
        self.running = False

    @contextlib.contextmanager
    def around_the_loop(self):
        """The loop runs inside: an error passing is handed to `after_error`, and the loop's end is told."""
        try:
            yield self
        except Exception as e:
            self.after_error(e)
            raise
        finally:
            self.ended()

    def after_error(self, error: BaseException) -> str | None:
        """The training thread's error passing: a peer's loss rescues (never raises: the error goes on)."""
        return self._rescue(f"a peer was lost at step {self.state.step + 1}", wait_s=0.0) \
            if is_peer_loss(error) else None

    def at_shutdown(self) -> str | None:
        """Ray Train stops the group (its shutdown hook's thread): rescues where the loop still runs."""
        if not self.running:
            return None
        return self._rescue(f"the group was stopped at step {self.state.step + 1}", wait_s=UPDATE_WAIT_S)

    def _rescue(self, why: str, wait_s: float) -> str | None:
        with self._once:
            if self.written is not None:  # (the other thread wrote it)
                return self.written
            if self.off is not None or self.state.step <= self.saved_step:
                return None
            # (the training thread passes no wait: where it holds the update itself, its error cut the update)
            if not (self._whole.acquire(timeout=wait_s) if wait_s else self._whole.acquire(blocking=False)):
                return None
            try:
                self.written = _write(self, why)
            except Exception as e:  # (a second failure must not hide the first, nor hold the group's end)
                console(f"rank {self.rank}: no rescue checkpoint at step {self.state.step}: {type(e).__name__}: {e}")
            finally:
                self._whole.release()
            return self.written


def _write(rescue: Rescue, why: str) -> str | None:
    ctx, step = hosts.current(), rescue.state.step
    if rescue.fence is not None:  # (the run lock's: a driver that lost the folder writes nothing there)
        rescue.fence.check("writing a rescue checkpoint into it")
    run = RunStore(*ctx.storage())
    name = f"{PREFIX}{step:09d}"
    claimed = run.claim(name)  # the live workers race for the folder: one writes it
    if claimed is False:
        return None
    if claimed is None:  # (a place without an atomic claim: ranks 0 and 1 write, each under a name of its own)
        if rescue.rank > 1:
            return None
        name += f"_rank{rescue.rank}"
    with _side_stream(rescue.run.model):
        # (the group ends on it: a resume loses nothing, and auto's count of interruptions that lost work keeps)
        ended = dataclasses.replace(rescue.state, ended_on_notice=True)
        snap = live_state.snapshot(**rescue.run.parts(), state=ended, task_files=rescue.task_files,
                                   job_yaml=rescue.job_yaml, metrics={"step": step, "rescued_by_rank": rescue.rank})
    for key, (_, copy) in rescue._buffers.items():  # as the step left them, not as the next forward did
        snap.state_dicts[MODEL_FILE][key] = copy.to("cpu", copy=True)
    if not _finite(snap.state_dicts[MODEL_FILE]):
        if claimed:
            run.release(name)
        console(f"rank {rescue.rank}: no rescue checkpoint at step {step}: the weights are not finite (a step's "
                f"gradients were, and train.nonfinite stops the run only at its next report): the last good "
                f"checkpoint stays the latest")
        return None
    written = store(snap, None, name, run)  # (staged, where the store stages, in a folder of its own)
    console(f"rank {rescue.rank}: {why}; wrote this worker's state at step {step} as {written.path}: the next "
            f"group resumes there")
    return written.path


def _buffer_copies(model) -> dict:
    """{key: (buffer, a copy of it)} for the model's buffers its checkpoint keeps (state-dict keys)."""
    module = unwrap(model)
    kept = trained_state(module)
    return {name: (b, b.detach().clone()) for name, b in module.named_buffers() if name in kept}


def _finite(weights: dict) -> bool:
    """Whether every floating-point tensor of a state dict (host copies) is finite."""
    return all(bool(torch.isfinite(t).all()) for t in weights.values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _side_stream(model):
    """On a GPU, copy on a stream of its own: the default stream may wait behind a collective that never ends
    (NCCL waiting for a lost peer); the weights it reads are not written by it."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))
