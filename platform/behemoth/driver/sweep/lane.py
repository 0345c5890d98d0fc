"""The warm lane: a sweep trial of one worker, trained in the Tune actor that runs the trial, which Tune reuses
from trial to trial (TuneConfig(reuse_actors=True)).

A trial through Ray Train starts a controller, a synchronisation actor, a placement-group cleaner and its
worker: new processes that each import Ray Train and torch, ~20 s on 2 cores, for a few seconds of training.
A lane starts none of them. It runs the same worker loop (worker/loop.py) in the trial's own process under the
lane's worker host (hosts/lane.py, made current by hosts.hosted), which writes what Ray Train's would: the run folder, its
checkpoints (the manifest last; the sweep's lease checked around each), retention (checkpoint.keep: the
best K by the run's metric and the latest, as Ray's CheckpointConfig keeps them: driver/run/resume.py retention),
the run's records through the same RunRecorder (metrics.jsonl, timeline.jsonl, TensorBoard, MLflow, the goodput account) and the run's summary.

What a lane keeps from one trial to the next, all of it read-only and keyed by everything it depends on:
torch, transformers and the task's code imported; the prepared data (an image index and its decoded cache
mapped, a corpus's token index), per data config and seed, the least recently used dropped beyond
LANE_DATA_SHARE of the node's memory; a model's FLOP count, per model and batch shape (worker/speed.py). What
it puts back before and after every trial: the global state a fresh worker process has (default dtype,
deterministic and anomaly modes, cuDNN and TF32 switches, the global random states, torch's thread count:
sweep/process_state.py); no thread, open file or CUDA memory of the trial outlives it (tests/integration/test_tune.py
checks, trial after trial in one lane).

Failures, as under Ray Train: an error in the loop restarts it from the run's latest checkpoint, in the same
process, up to failure.max_failures times (a data or config error ends the trial at once); a lane whose
process dies (SIGKILL, out of memory) is Tune's to restart: the trial is retried in a new actor
(sweep trial_max_failures) and resumes from its run folder. So is a lane whose CUDA context an error left
unusable (an illegal memory access, a device-side assert): it shows the error and ends its own process. A trial that ASHA stops ends at its next report
(Tune raises SystemExit there): its records are closed, and its pending checkpoint upload finishes.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import sys
import traceback

import torch

from behemoth import hosts
from behemoth.config import JobConfig
from behemoth.driver.sweep.process_state import fresh_state
from behemoth.errors import RunFailedError, user_facing_error
from behemoth.hosts.lane import LaneHost

# A lane's process: its prepared data per (data config, model config, seed), most recently used last.
# Read-only for the trials. A sweep over a model key tokenises a corpus once per value (the vocabulary may
# differ): the entries beyond this share of the node's memory go, the least recently used first.
_PREPARED: dict[str, object] = {}
LANE_DATA_SHARE = 0.25
_TRIALS_HERE = [0]  # trials this process has hosted (the trial's console line says which one it is)
def train_in_lane(cfg: JobConfig, forward=None, parent_mlflow_run: str | None = None, fence=None,
                  worker_env: dict | None = None):
    """Train (or resume) the one-worker run of `cfg` in this process, as trainer.train would through Ray Train;
    its RunSummary. `forward`: called with every report (a sweep's trial sends the evaluations to Tune).
    Runs under the sweep's lease (`fence`), never a lock of its own. `worker_env`: the variables Ray Train's
    workers start with (ray_session.worker_env_vars, the driver's), set for the trial and put back after it."""
    with _environment(worker_env or {}):
        return _train_in_lane(cfg, forward, parent_mlflow_run, fence)


def _train_in_lane(cfg: JobConfig, forward, parent_mlflow_run: str | None, fence):
    from behemoth.driver.run.resume import run_dir
    from behemoth.driver.run.sequence import run_sequence
    from behemoth.tracking.invocation import RunTracking

    tracking = RunTracking(cfg, run_dir(cfg), parent_mlflow_run=parent_mlflow_run)
    return run_sequence(cfg, LaneLauncher(tracking, forward, fence), tracking, fence)


class LaneLauncher:
    """A run in this process, under the lane's host: the run sequence's launcher for a sweep's one-worker trial
    (driver/run/sequence.py), as trainer.RayTrainLauncher is for a run through Ray Train."""

    def __init__(self, tracking, forward, fence):
        self.tracking, self.forward, self.fence = tracking, forward, fence
        self.recorder = None

    def prepare(self, run, mark):
        return _prepared(run.cfg, mark, run.task)

    def launch(self, run, data):
        from behemoth.checkpoints.retention import kept_indices
        from behemoth.driver.run.sequence import Launched
        from behemoth.tasks import run_metric

        self.recorder = recorder = self.tracking.callbacks()[0]
        kept = functools.partial(kept_indices, keep=run.cfg.checkpoint.keep, order=run_metric(run.task, run.cfg)[1])
        ctx = LaneHost(run.place, kept, recorder, self.fence, self.forward)
        fresh_state().restore()  # as a fresh worker process starts (sweep/process_state.py)
        _TRIALS_HERE[0] += 1
        try:
            returned = _loop_with_restarts(run.cfg, data, ctx, recorder)
        except BaseException as e:  # (a SystemExit too: Tune stopped the trial at a report)
            ctx.close()
            recorder.close(failed=self.records_failure(e))
            raise
        finally:
            _tidy()
        ctx.close()
        return Launched(ctx.kept, ctx.result(returned), returned)

    def records_failure(self, error: BaseException) -> bool:
        """Tune stopped the trial (ASHA: SystemExit at a report): as through Ray Train, its invocation has no end
        record; any other error ended the run."""
        return not isinstance(error, SystemExit)

    @contextlib.contextmanager
    def ending(self):
        self.recorder.close()  # the recorder's last lines before the invocation's end record
        yield


def _loop_with_restarts(cfg: JobConfig, data, ctx: LaneHost, recorder) -> dict:
    """The worker loop under the lane's context; after an error it starts again from the latest checkpoint,
    failure.max_failures times (not after a data or config error: it would fail the same way)."""
    from behemoth.worker.loop import train_loop_per_worker

    failures = 0
    while True:
        recorder.event("group_start", workers=1, lane_pid=os.getpid())
        try:
            with hosts.hosted(ctx):
                returned = train_loop_per_worker({"job": cfg, "data": data, "fence": ctx.fence})
                ctx.drain()
            return returned
        except Exception as e:  # decided below: restarted, or the run's failure
            ctx.close()
            ctx._failed = None
            gc.collect()  # the failed attempt's iterators and threads end now, not at some later collection
            if user_facing_error(e) is not None:
                raise  # (Tune shows it, once, with the trial's traceback)
            # shown whole here, as Ray Train's worker shows its own (Tune's copy then is one line: ray_cluster/output_filter.py)
            sys.stderr.write(f"[behemoth] error in the training of run '{cfg.checkpoint.run_name}' (a lane):\n"
                             f"{traceback.format_exc()}")
            sys.stderr.flush()
            if cuda_context_lost(e):
                _end_lane(cfg, recorder)
            if failures >= cfg.failure.max_failures:
                raise RunFailedError(_failure_message(cfg, e, failures)) from e
            failures += 1
            recorder.event("failure", decision="RETRY")
            fresh_state().restore()
            print(f"[behemoth] run '{cfg.checkpoint.run_name}' failed in its lane ({type(e).__name__}: "
                  f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); restarting from its latest "
                  f"checkpoint ({failures} of failure.max_failures={cfg.failure.max_failures})", flush=True)


def _failure_message(cfg: JobConfig, e: Exception, failures: int) -> str:
    from behemoth.driver.run.sequence import used_up

    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return used_up(cfg, f"{type(e).__name__}: {first} ({failures} restarts in the lane)", "rerun the sweep to resume it")


def _prepared(cfg: JobConfig, mark, task=None):
    """The task's prepared data, made once per lane process for each data config (the sweep's driver made it
    first: here it is only checked and opened)."""
    from behemoth.driver.run.sequence import prepare_data

    key = json.dumps({"data": cfg.to_dict()["data"], "model": cfg.to_dict()["model"], "seed": cfg.train.seed},
                     sort_keys=True, default=str)
    if key not in _PREPARED:
        _PREPARED[key] = prepare_data(cfg, mark, task=task)
    else:
        for milestone in ("data_checked", "ray_ready", "data_ready"):
            mark(milestone)
        _PREPARED[key] = _PREPARED.pop(key)  # the most recently used, last
    keep_within(_PREPARED, LANE_DATA_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return _PREPARED[key]


def keep_within(prepared: dict, budget: float) -> None:
    """Drop the least recently used entries (the first) while the entries' memory exceeds `budget`; the last,
    the one in use, stays whatever its size."""
    while len(prepared) > 1 and sum(map(held_bytes, prepared.values())) > budget:
        prepared.pop(next(iter(prepared)))


def held_bytes(obj, depth: int = 0) -> int:
    """The memory a prepared object holds in arrays (numpy arrays not mapped from files, Arrow tables), found
    through its attributes, dicts and lists."""
    import numpy as np
    import pyarrow as pa

    if isinstance(obj, np.memmap):
        return 0  # pages of a file: the OS drops them under pressure
    if isinstance(obj, np.ndarray):
        return obj.nbytes if obj.base is None or not isinstance(obj.base, np.memmap) else 0
    if isinstance(obj, (pa.Table, pa.Array, pa.ChunkedArray)):
        return obj.nbytes
    if depth > 4 or isinstance(obj, (str, bytes, int, float, type(None))):
        return 0
    if isinstance(obj, dict):
        return sum(held_bytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):  # (a long list: its first 1,000 items, scaled)
        return sum(held_bytes(v, depth + 1) for v in obj[:1000]) * max(len(obj), 1000) // 1000
    fields = getattr(obj, "__dict__", None)
    return sum(held_bytes(v, depth + 1) for v in fields.values()) if fields else 0


@contextlib.contextmanager
def _environment(variables: dict):
    """`variables` set in this process while the block runs; the values before put back after it. (Those read
    once, when a library starts, keep the first trial's: MKL_CBWR, which every trial sets alike.)"""
    before = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _tidy() -> None:
    """Put back what a trial changed in the lane's process: the global state (sweep/process_state.py), its memory."""
    fresh_state().restore()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # cuBLAS's workspaces are tensors of the caching allocator, kept per stream after the first matrix
        # product (memory_allocated stays above 0 once a trial has run): freed too, so that the next trial
        # finds the GPU as the lane's first did
        try:
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a CUDA context the trial broke: the trial's own error is the one to show
            print(f"[behemoth] freeing the trial's GPU memory failed too ({type(e).__name__}: "
                  f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})", file=sys.stderr, flush=True)


# Errors after which a process's CUDA context is unusable (CUDA's "sticky" errors): every later call fails too.
_STICKY_CUDA = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
                "illegal instruction", "uncorrectable ecc", "hardware stack error", "cuda error: unknown error")


def cuda_context_lost(e: BaseException) -> bool:
    """Whether `e` (or an error it came from) is a CUDA error that leaves this process's CUDA context unusable:
    an in-lane restart would reuse it and fail at once; only a new process trains again."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).lower()
        if "cuda" in text and any(sticky in text for sticky in _STICKY_CUDA):
            return True
        e = e.__cause__ or e.__context__
    return False


def _end_lane(cfg: JobConfig, recorder) -> None:
    """End this lane's process (its trial's error is shown above): Tune retries the trial in a new actor, with
    a CUDA context of its own, resuming from the run folder (sweep trial_max_failures)."""
    print(f"[behemoth] run '{cfg.checkpoint.run_name}': the GPU's CUDA context in this lane is lost (the error "
          f"above); ending the lane's process so that the trial restarts in a new one, from its latest "
          f"checkpoint", file=sys.stderr, flush=True)
    recorder.event("failure", decision="NEW_PROCESS")
    recorder.close()
    os._exit(70)
