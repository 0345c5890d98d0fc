"""What a warm lane carries from trial to trial (driver/sweep/lane.py, sweep/process_state.py), without Ray: the global
state a trial changes is put back as a fresh worker process has it; the prepared data kept per config stays
within its share of memory; a CUDA error that leaves the process's context unusable ends the lane's process
instead of restarting in it, the original error shown."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from behemoth.driver.sweep import lane
from behemoth.driver.sweep.process_state import FreshState


def _a_trial_changes_everything():
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.autograd.set_detect_anomaly(True)
    torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic = not torch.backends.cudnn.deterministic
    torch.backends.cudnn.allow_tf32 = not torch.backends.cudnn.allow_tf32
    torch.set_num_threads(torch.get_num_threads() + 1)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)


def test_what_a_trial_sets_process_wide_is_put_back_for_the_next():
    """Each piece a trial may set: the next trial in the lane finds it as the lane found it first, random
    states included (a fresh worker's would be its own: here every trial starts from the same)."""
    fresh = FreshState()
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    fresh.restore()
    try:
        _a_trial_changes_everything()
        assert set(fresh.differences()) >= {"default_dtype", "deterministic", "anomaly", "cuda_matmul_tf32",
                                            "cudnn", "threads"}
        fresh.restore()
        assert fresh.differences() == []
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws
    finally:
        fresh.restore()


def test_the_lane_tidies_with_the_state_it_started_with(monkeypatch):
    fresh = FreshState()
    monkeypatch.setattr(lane, "fresh_state", lambda: fresh)
    try:
        _a_trial_changes_everything()
        lane._tidy()
        assert fresh.differences() == []
    finally:
        fresh.restore()


def test_the_prepared_data_a_lane_keeps_stays_within_its_budget():
    """A sweep over a model key prepares the corpus once per value: the lane keeps the most recently used
    entries within its budget (the one in use always), by the memory their arrays hold (a file mapping: none)."""
    prepared = {f"config {i}": SimpleNamespace(tokens=np.zeros(1_000_000, np.uint8), names=["a", "b"])
                for i in range(5)}
    assert lane.held_bytes(prepared["config 0"]) == 1_000_000
    lane.keep_within(prepared, 2_500_000)
    assert list(prepared) == ["config 3", "config 4"]
    lane.keep_within(prepared, 10)
    assert list(prepared) == ["config 4"]  # the one in use stays


@pytest.mark.parametrize("message, lost", [
    ("CUDA error: an illegal memory access was encountered", True),
    ("CUDA error: device-side assert triggered", True),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("something else", False),
])
def test_a_cuda_error_that_breaks_the_context_ends_the_lane_with_the_error_shown(monkeypatch, capsys, message, lost):
    """A sticky CUDA error: every later CUDA call in the process fails too, so an in-lane restart would fail at
    once; the lane shows the error and ends its process (Tune retries the trial in a new actor). Other errors
    restart in the lane as before."""
    assert lane.cuda_context_lost(RuntimeError(message)) is lost
    wrapped = RuntimeError("the step failed")
    wrapped.__cause__ = RuntimeError(message)
    assert lane.cuda_context_lost(wrapped) is lost

    import behemoth.worker.loop as loop

    calls = []
    monkeypatch.setattr(loop, "train_loop_per_worker", lambda config: calls.append(1) or (_ for _ in ()).throw(
        RuntimeError(message)))
    monkeypatch.setattr(lane.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    events = []
    recorder = SimpleNamespace(event=lambda *a, **k: events.append(k.get("decision")), close=lambda: None)
    ctx = SimpleNamespace(close=lambda: None, fence=None, drain=lambda: None, _failed=None)
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(run_name="r", storage_path="."),
                          failure=SimpleNamespace(max_failures=3), to_dict=lambda: {})
    monkeypatch.setattr(lane.hosts, "hosted", lambda ctx: __import__("contextlib").nullcontext())
    if lost:
        with pytest.raises(SystemExit) as ended:
            lane._loop_with_restarts(cfg, None, ctx, recorder)
        assert ended.value.code == 70 and calls == [1] and "NEW_PROCESS" in events
        err = capsys.readouterr().err
        assert message in err and "ending the lane's process" in err
    else:
        monkeypatch.setattr(lane, "_failure_message", lambda *a: "used up")
        with pytest.raises(Exception, match="used up"):
            lane._loop_with_restarts(cfg, None, ctx, recorder)
        assert len(calls) == 4  # restarted in the lane, failure.max_failures times
