"""Worker side: choosing and loading the checkpoint a (re)started worker group continues from."""

from __future__ import annotations


from behemoth.storage import checkpoint, weights
from behemoth import hosts
from behemoth.hosts import collectives
from behemoth.checkpoints import live_state
from behemoth.checkpoints.memory_copy import restore_newer
from behemoth.checkpoints.rescue import is_rescue
from behemoth.storage.checkpoint import TrainState
from behemoth.storage.run_store import RunStore
from behemoth.errors import CheckpointError, PartlyLoadedError
from behemoth.hosts.console import console
from behemoth.checkpoints.trainables import Trainables


def restore_latest(run: Trainables, fence=None, copies=None) -> TrainState | None:
    """Restore the newest checkpoint that passes verification into `run`; None for a fresh run. `fence`
    (runlock.Fence, None outside a locked run): checked before an unfinished upload is deleted. `copies` (the
    run's hosts.state_keeper.KeeperLink, None without one): a lone worker's copy in the driver's memory newer
    than that checkpoint is restored instead (checkpoints/memory_copy.py), as a resume that lost work.

    Candidates, newest first: complete checkpoints in the run folder newer than Ray Train's latest (written
    and uploaded, but the worker or driver died before Ray Train registered them), Ray Train's latest, then
    its earlier ones. A candidate that fails verification on any rank is skipped by every rank, with a
    warning naming it: all ranks restore the same checkpoint (restore_first_verified).
    """
    state = _restore_checkpoint(run, fence)
    copied = restore_newer(copies, run, state.step if state else -1) if copies is not None else None
    if copied is None:
        return state
    if hosts.current().rank == 0:
        console(f"restored step {copied.step} from its copy in the driver's memory (checkpoint.memory_copy): newer "
                f"than the newest checkpoint ({f'step {state.step}' if state else 'none'})")
    copied.interruptions += 1
    copied.ended_on_notice = False
    return copied


def _restore_checkpoint(run: Trainables, fence=None) -> TrainState | None:
    ctx = hosts.current()
    latest = ctx.latest_checkpoint()
    candidates = [latest] if latest else []
    candidates += [c for c in reversed(ctx.reported_checkpoints()) if latest is None or c.path != latest.path]
    registered = _step_of(latest)
    rank0 = ctx.rank == 0
    if rank0:
        remove_partial_uploads(RunStore(*ctx.storage()), {c.path for c in candidates}, fence)
    unregistered = [ckpt for step, ckpt in _run_folder_checkpoints() if step > registered]
    if unregistered and rank0:
        why = ("a live worker's state when Ray Train stopped its group (checkpoint.rescue)"
               if is_rescue(unregistered[0].path) else
               "complete in the run folder, but not registered with Ray Train when the run stopped")
        console(f"restoring from {unregistered[0].path}: {why}")
    state, touched = restore_first_verified(unregistered + candidates, run, ctx.storage()[0], rank0)
    if state is not None:
        # a resume that lost work ends an interruption (checkpoint.every_n_steps auto counts them); one from a
        # notice's last checkpoint lost none
        state.interruptions += 0 if state.ended_on_notice else 1
        state.ended_on_notice = False
        return state
    if candidates or touched:  # never silently start over (from registered checkpoints, or a part-loaded model)
        tried = [c.path for c in unregistered + candidates]
        hint = "" if candidates else (": one failed its check while being loaded, after part of it was; move the "
                                      "damaged checkpoint folder out of the run folder to start from step 0")
        raise CheckpointError(f"no checkpoint of this run passes verification (tried {tried}){hint}")
    # Nothing registered: what failed were unregistered folders (an upload cut short by the failure, whose
    # manifest was copied before the rest). Nothing was committed yet, so the run starts from step 0.
    return None


def restore_first_verified(ckpts: list, run: Trainables, fs, rank0: bool) -> tuple[TrainState | None, bool]:
    """Restore the first of `ckpts` (Ray Train checkpoints on the pyarrow filesystem `fs`, newest first) that
    passes verification on every rank into `run`. Returns (its TrainState, or None where none did; whether a
    failed load left part of a checkpoint in the model). A candidate that fails is skipped with a warning
    naming it.

    Every rank restores the same checkpoint: the ranks try rank 0's list of candidates (a shared mount's
    listing of the run folder can lag on another node) one by one, in step, and skip one together where it
    fails on any rank (one node's copy can be damaged where the others' are whole)."""
    mine = {c.path: c for c in ckpts}
    touched = False
    for path in collectives.from_rank0(list(mine)):
        ckpt = mine.get(path) or hosts.current().checkpoint_at(path, fs)
        try:
            with live_state.opened_on_every_rank(ckpt) as (d, remote, node_copy):
                state = live_state.load(d, **run.parts(), hook_state=run.hook_state, remote=remote,
                                           node_copy=node_copy)
                if remote is not None and rank0:
                    console(f"restored {ckpt.path} from its object store: rank 0 read "
                            f"{remote.fetched / 2**20:.1f} MiB of its {remote.total / 2**20:.1f} MiB")
                return state, touched
        except CheckpointError as e:
            touched = touched or isinstance(e, PartlyLoadedError)
            console(f"WARNING: skipping checkpoint {ckpt.path}: {e}")
    return None, touched


def _step_of(latest) -> int:
    """The step of Ray's latest checkpoint, read even if the checkpoint is damaged (-1: none, unreadable)."""
    if latest:
        try:
            return checkpoint.read_state(latest.path, latest.filesystem).step
        except (OSError, ValueError, TypeError):
            pass
    return -1


def remove_partial_uploads(run: RunStore, registered: set[str], fence=None) -> list[str]:
    """Delete checkpoint folders of this run that have no manifest and that Ray Train never registered:
    uploads cut short by a failure (storage/run_store.CheckpointWrite puts the manifest last). No upload of this run
    is in flight while a worker group starts (the previous group is gone), so each one is dead, unless another
    driver has taken the folder over meanwhile: then an unfinished upload may be its live one, so the lease is
    checked first (LeaseLostError ends the run, nothing deleted). Returns the folders removed."""
    partial = [path for path in run.partial() if path not in registered]
    if partial and fence is not None:
        fence.check(f"removing checkpoint uploads that did not finish ({', '.join(partial)})")
    for path in partial:
        console(f"removing {path}: a checkpoint upload that did not finish (no manifest); it is never "
                f"restored")
        run.delete(path)
    return partial


def _run_folder_checkpoints() -> list[tuple[int, object]]:
    """(step, checkpoint) of the complete checkpoints in this run's folder, newest first, on the run's storage
    (a local folder or an object store)."""
    run = RunStore(*hosts.current().storage())
    return [(step, hosts.current().checkpoint_at(path, run.fs)) for step, path in run.complete()]


def load_init_from(model, cfg, task, rank: int, world: int) -> str | None:
    """Fine-tuning: the weights of train.init_from (the driver resolved it to one folder) into a fresh run's
    model, before DDP/FSDP wraps it; only the weights (the optimizer, schedule and step start fresh). Skipped
    when the run has checkpoints of its own: it resumes from them. Returns the line to print, or None.

    Under DDP only rank 0 reads them: wrapping the model in DDP broadcasts rank 0's parameters and buffers to
    every rank. FSDP shards each rank's own full copy, so there every rank reads them."""
    source = cfg.train.init_from
    if not source or hosts.current().latest_checkpoint() is not None or _run_folder_checkpoints():
        return None
    if not reads_init_from(cfg.scaling.strategy, rank, world):
        return None
    reinit = weights.load_weights(model, weights.read_state_dict(source), source, task.reinit_ok)
    line = f"init_from {source}: weights loaded; optimizer, LR schedule and step start fresh"
    if reinit:
        shapes = model.state_dict()
        line += (f"; kept fresh where the source's shapes differ (the task's reinit_ok): "
                 f"{', '.join(f'{k} {list(shapes[k].shape)}' for k in reinit)}")
    return line


def reads_init_from(strategy: str, rank: int, world: int) -> bool:
    """Whether this rank reads train.init_from's weights itself (see load_init_from)."""
    return rank == 0 or not (strategy == "ddp" and world > 1)
