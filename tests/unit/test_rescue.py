"""The rescue checkpoint: a DDP worker whose group is stopped under it (a peer lost without notice) writes its
state, the run's, as a checkpoint."""

import datetime
import json
import os
import signal
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from behemoth import hosts
from behemoth.checkpoints import live_state, rescue
from behemoth.checkpoints.trainables import Trainables
from behemoth.hosts.contract import WorkerHost
from behemoth.job import config_from_dict
from behemoth.storage import checkpoint
from behemoth.storage.checkpoint import TrainState

STEPS_BEFORE_LOSS = 5


class _Host(WorkerHost):
    """A worker's host with the run folder on local disk (what `rescue` asks of it)."""

    def __init__(self, rank: int, run_path: str):
        import pyarrow.fs

        self.rank, self.world, self.run_path, self.fs = rank, 2, run_path, pyarrow.fs.LocalFileSystem()

    def storage(self):
        return self.fs, self.run_path

    def checkpoint_at(self, path, fs):
        return SimpleNamespace(path=path, filesystem=fs)


def _run(model: torch.nn.Module) -> Trainables:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return Trainables(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), scaler=None)


def _cfg(**checkpoint_keys):
    return config_from_dict({"data": {"kind": "text", "train_files": ["t.jsonl"], "val_fraction": 0.1,
                                      "tokenizer": "tok"},
                             "model": {"name": "causal_lm", "hf_config": {"model_type": "llama"}},
                             "checkpoint": checkpoint_keys})


def _rescue(run: Trainables, state: TrainState, rank: int = 1, **checkpoint_keys) -> rescue.Rescue:
    return rescue.Rescue(_cfg(**checkpoint_keys), run, state, rank, {}, "")


def _step(run: Trainables, state: TrainState, guard: rescue.Rescue, x: torch.Tensor) -> None:
    """A training step as worker/loop.py marks it for the rescue: the update, then the count."""
    run.optimizer.zero_grad()
    run.model(x).square().mean().backward()
    guard.updating()  # (CheckpointSaver.before_update)
    run.optimizer.step()
    run.scheduler.step()
    state.advance(1000, 16)
    guard.stepped()


def _rank(rank: int, port: int, root: str, how: str) -> None:
    """One of 2 gloo ranks training a DDP model. Rank 0 writes its weights after STEPS_BEFORE_LOSS steps, then
    `how`: "exits" at once, without a word (its connections close as a killed process's do: rank 1's all-reduce
    fails and rank 1 hands the error to its rescue, as the loop does), or "freezes" (SIGSTOP: its connections
    stay open, as a vanished host's, and rank 1 waits in the all-reduce; a second later Ray Train's shutdown
    hook, here a thread, asks rank 1's rescue). Rank 1 records what was written."""
    import threading

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    run = _run(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4)))
    state = TrainState(world_size=2)

    def record(**seen):
        Path(root, "rank1.json").write_text(json.dumps({"step": state.step, **seen}))

    def shutdown_hook():  # (hosts/rescue_callback.py)
        while state.step < STEPS_BEFORE_LOSS:
            time.sleep(0.01)
        time.sleep(1.0)  # rank 1 now waits in step STEPS_BEFORE_LOSS + 1's all-reduce
        record(written=hosts.stopping() or guard.written)
        os._exit(0)  # (Ray Train's kill: the training thread never returns from the all-reduce)

    with hosts.hosted(_Host(rank, f"{root}/run")):
        guard = _rescue(run, state, rank)
        if rank == 1 and how == "freezes":
            threading.Thread(target=shutdown_hook, daemon=True).start()
        try:
            while True:
                torch.manual_seed(state.step * 2 + rank)
                x = torch.randn(8, 16)
                if rank == 0 and state.step == STEPS_BEFORE_LOSS:
                    torch.save(run.model.module.state_dict(), f"{root}/rank0_weights.pt")
                    if how == "freezes":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    os._exit(0)
                _step(run, state, guard, x)
        except RuntimeError as e:
            written = guard.after_error(e)
            record(error=str(e), peer_loss=rescue.is_peer_loss(e), written=written,
                   again=_rescue(run, state).after_error(e))  # (another live worker finds the folder taken)


@pytest.mark.parametrize("how", ["exits", "freezes"])
def test_a_survivor_writes_the_runs_state_when_its_peer_is_lost(tmp_path, how):
    """Two real gloo processes. Rank 0 goes without notice after STEPS_BEFORE_LOSS steps: its process ends
    (rank 1's all-reduce fails with gloo's connection error, which counts as a peer's loss) or freezes (rank 1
    waits in the all-reduce until Ray Train's shutdown reaches it). Either way rank 1 writes a complete
    checkpoint at step STEPS_BEFORE_LOSS whose weights are exactly rank 0's at that step (DDP's replicas are one
    state), found as the run folder's newest complete checkpoint; a second live worker finds the folder taken."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawned = mp.spawn(_rank, args=(port, str(tmp_path), how), nprocs=2, join=False)
    deadline = time.time() + 120
    while not (tmp_path / "rank1.json").exists() and time.time() < deadline:
        time.sleep(0.1)
    for process in spawned.processes:  # (the frozen rank 0, and anything left waiting)
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=30)
    seen = json.loads((tmp_path / "rank1.json").read_text())
    assert seen["step"] == STEPS_BEFORE_LOSS, seen
    if how == "exits":
        assert seen["peer_loss"] and "gloo" in seen["error"] and seen["again"] is None, seen
    assert seen["written"] == f"{tmp_path}/run/{rescue.PREFIX}{STEPS_BEFORE_LOSS:09d}"
    assert checkpoint.complete_checkpoints(tmp_path / "run") == [(STEPS_BEFORE_LOSS, seen["written"])]
    checkpoint.verify(seen["written"])
    model = torch.nn.Linear(16, 4)
    run = _run(model)
    state = live_state.load(seen["written"], **run.parts())
    # (the group ended on it: a resume loses nothing, and counts no interruption: checkpoint.every_n_steps auto)
    assert state.step == STEPS_BEFORE_LOSS and state.world_size == 2 and state.ended_on_notice
    expected = torch.load(tmp_path / "rank0_weights.pt")
    assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)
    assert run.optimizer.state_dict()["state"][0]["step"] == STEPS_BEFORE_LOSS


def _peer_loss() -> RuntimeError:
    return RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:2440: Connection reset by peer.")


def test_a_group_stopped_while_it_trains_leaves_its_state_once_and_only_when_whole(tmp_path):
    """Ray Train's shutdown hook (another thread) rescues a loop that still runs: at the step it last counted,
    waiting for an update in flight to be counted (up to UPDATE_WAIT_S), nothing where the loop is cut in the
    middle of one (the weights a step ahead of the count) or has ended, at most once (the training thread's
    error afterwards finds it written), and only a step newer than the last saved."""
    import threading

    torch.manual_seed(0)
    run, state = _run(torch.nn.Linear(16, 4)), TrainState()
    with hosts.hosted(_Host(1, str(tmp_path / "run"))):
        guard = _rescue(run, state)
        assert guard.at_shutdown() is None  # step 0: nothing newer than the start
        for _ in range(3):
            _step(run, state, guard, torch.randn(8, 16))
        guard.updating()  # an update in flight, counted 0.3 s later by the "training thread"
        timer = threading.Timer(0.3, lambda: (run.optimizer.step(), state.advance(1000, 16), guard.stepped()))
        timer.start()
        hosts.stopping()  # (Ray Train's shutdown of the group: hosts/rescue_callback.py)
        written = guard.written
        timer.join()
        assert written == str(tmp_path / "run" / f"{rescue.PREFIX}000000004"), written
        assert live_state.load(written, **_run(torch.nn.Linear(16, 4)).parts()).step == 4
        assert guard.after_error(_peer_loss()) == written  # (once: the thread that comes second finds it)

        cut = _rescue(run, state)
        _step(run, state, cut, torch.randn(8, 16))
        cut.updating()  # ... and never counted: the loop's error cut the update
        started = time.perf_counter()
        assert cut.at_shutdown() is None and cut.after_error(_peer_loss()) is None
        assert time.perf_counter() - started >= rescue.UPDATE_WAIT_S
        cut.stepped()
        ended = _rescue(run, state)
        ended.ended()
        assert ended.at_shutdown() is None
        assert [p.name for p in (tmp_path / "run").iterdir()] == [f"{rescue.PREFIX}000000004"]


@pytest.mark.parametrize("how", ["peer lost in the backward", "group stopped in the forward"])
def test_a_rescue_keeps_the_batchnorm_statistics_of_the_step_it_names(tmp_path, how):
    """BatchNorm's running statistics change in the next step's forward, before its update: a peer lost in that
    step's backward (gloo's all-reduce), or Ray Train's stop during it, wrote them one forward ahead of the step
    the checkpoint names, so the resumed run counted that batch twice."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4))
    run, state = _run(model), TrainState()
    with hosts.hosted(_Host(0, str(tmp_path / "run"))):
        guard = _rescue(run, state, rank=0)
        for _ in range(3):
            _step(run, state, guard, torch.randn(8, 16))
        after = {k: v.clone() for k, v in model.state_dict().items()}
        run.optimizer.zero_grad()
        model(torch.randn(8, 16)).square().mean()  # step 4's forward: the statistics move
        assert not torch.equal(model.state_dict()["1.running_mean"], after["1.running_mean"])
        written = guard.after_error(_peer_loss()) if how.startswith("peer") else guard.at_shutdown()
    fresh = _run(torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4)))
    assert live_state.load(written, **fresh.parts()).step == 3
    restored = fresh.model.state_dict()
    assert restored.keys() == after.keys() and all(torch.equal(restored[k], after[k]) for k in after)


def _lease_lost(before: str):
    from behemoth.errors import LeaseLostError

    raise LeaseLostError(f"this driver no longer holds the folder's lease: it stops before {before}")


def test_no_rescue_for_another_error_a_step_already_saved_or_where_it_is_off(tmp_path):
    """The training thread's error rescues only where it is a peer's loss (read along its chain: the loop's own
    error raised while handling the peer's counts), the state newer than the step saved, checkpoint.rescue on,
    the run's driver still holding the run folder's lease, and the weights finite (a folder claimed for
    non-finite ones is removed: nothing is left that a restart would call an unfinished upload)."""
    run, state = _run(torch.nn.Linear(4, 4)), TrainState(step=7)
    with hosts.hosted(_Host(1, str(tmp_path / "run"))):
        other, saved, off, chained = _rescue(run, state), _rescue(run, state), _rescue(run, state, rescue=False), \
            _rescue(run, state)
        state.advance(1000, 16)  # step 8: newer than the start
        assert other.after_error(ValueError("a bad sample")) is None
        saved.saved_step = 8  # (a notice's last checkpoint, written synchronously)
        assert saved.after_error(_peer_loss()) is None and saved.at_shutdown() is None
        assert off.after_error(_peer_loss()) is None and off.at_shutdown() is None
        lost = _rescue(run, TrainState(step=7))
        lost.state.advance(1000, 16)
        lost.fence = SimpleNamespace(check=_lease_lost)  # (another driver took the run folder over)
        assert lost.after_error(_peer_loss()) is None
        diverged = _rescue(_run(torch.nn.Linear(4, 4)), TrainState(step=7))
        diverged.state.advance(1000, 16)
        with torch.no_grad():
            diverged.run.model.weight[0, 0] = float("nan")  # (a step's gradients were not finite)
        assert diverged.after_error(_peer_loss()) is None
        assert not list((tmp_path / "run").glob("checkpoint_*"))
        try:
            try:
                raise _peer_loss()
            except RuntimeError as e:
                raise ValueError("the loop's own error, raised while handling the peer's") from e
        except ValueError as error:
            assert chained.after_error(error).endswith(f"{rescue.PREFIX}000000008")
    assert rescue.is_peer_loss(torch.distributed.DistBackendError("NCCL error: remote process exited"))


@pytest.mark.parametrize("model, cfg, rank, why", [
    (torch.nn.Linear(4, 4), {}, 1, None),
    (torch.nn.Linear(4, 4), {"rescue": False}, 0, "checkpoint.rescue is off"),
    (torch.nn.Linear(4, 4), {"format": "sharded"}, 0, "own shards"),
    (torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), {}, 1, "BatchNorm"),
    (torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), {}, 0, None),
])
def test_a_worker_rescues_only_where_its_state_is_the_runs(model, cfg, rank, why):
    """Where a worker's state would not be what a checkpoint holds (each rank's shards; another rank's
    BatchNorm statistics, which a checkpoint takes from rank 0) it has no rescue, and says why."""
    said = rescue.why_not(_cfg(**cfg), _run(model), rank)
    assert said == why if why is None else why in said


def test_the_stop_hook_keeps_nothing_of_a_finished_loop_alive(tmp_path):
    """The host's stop hook holds the loop's rescue weakly: once the loop is gone its model is unreachable (a
    sweep's lane trains trial after trial in one process: tests/integration/test_lanes.py counts the models left
    alive at each trial's start), and stopping then does nothing."""
    import gc
    import weakref

    model = torch.nn.Linear(4, 4)
    alive = weakref.ref(model)
    with hosts.hosted(_Host(0, str(tmp_path / "run"))):
        guard = _rescue(_run(model), TrainState())
        del guard, model
        gc.collect()
        assert alive() is None
        hosts.stopping()  # (nothing to run)
