"""Reports that never hold a fast step (worker/report_sender.py): a host that takes a report only every
poll interval (Ray Train's controller) makes the training thread wait nowhere, and the run's records still get
every logged step, in order, each as its own record."""

from __future__ import annotations

import threading
import time

import pytest

from behemoth import hosts
from behemoth.metrics import LOGGED, logged_reports
from behemoth.worker.report_sender import ReportSender


class _SlowHost(hosts.WorkerHost):
    """A host like Ray Train's worker: a report returns only when the controller has collected the previous one
    (every `poll_s`), and may fail."""

    def __init__(self, poll_s: float, fail_at: int | None = None):
        self.poll_s, self.fail_at = poll_s, fail_at
        self.received: list[dict] = []
        self.threads: set[str] = set()
        self._last = 0.0

    def report(self, metrics, upload=None, *, folder=None, dir_name=None, async_upload=False):
        self.threads.add(threading.current_thread().name)
        wait = self._last + self.poll_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._last = time.monotonic()
        if self.fail_at is not None and metrics["step"] >= self.fail_at:
            raise RuntimeError(f"the controller is gone (step {metrics['step']})")
        self.received.append(metrics)


def _logged(host: _SlowHost) -> list[int]:
    return [r["step"] for m in host.received for r in logged_reports(m)]


def test_a_step_never_waits_for_the_host_and_every_logged_step_arrives_in_order():
    host, sender = _SlowHost(poll_s=0.2), ReportSender(interval_s=0.2)
    held = []
    with hosts.hosted(host):
        for step in range(1, 61):  # a logged step every 10 ms, 20 per poll interval
            t0 = time.perf_counter()
            sender.send({"step": step}, now=sender.due())  # (rank 0's vote alone: one rank here)
            held.append(time.perf_counter() - t0)
            time.sleep(0.01)
        final = {"step": 61}
        sender.attach_pending(final)  # a checkpoint's report: the held steps go with it, after the sent ones
        sender.flush()
        hosts.current().report(final)
    assert max(held) < 0.05, f"a send held the step {max(held):.3f} s"
    assert _logged(host) == list(range(1, 62))
    assert 2 <= len(host.received) <= 8  # ~one report per interval, not 61
    assert host.threads - {threading.current_thread().name} == {"behemoth-reports"}
    assert all(LOGGED not in r for m in host.received for r in logged_reports(m))


def test_without_an_interval_every_report_goes_at_once_in_the_training_thread():
    host, sender = _SlowHost(poll_s=0.0), ReportSender(interval_s=0.0)
    with hosts.hosted(host):
        for step in range(1, 6):
            sender.send({"step": step}, now=sender.due())
    assert [m["step"] for m in host.received] == [1, 2, 3, 4, 5] and all(LOGGED not in m for m in host.received)
    assert host.threads == {threading.current_thread().name}


def test_a_failed_report_is_raised_in_the_training_thread_at_the_next_report():
    host, sender = _SlowHost(poll_s=0.0, fail_at=2), ReportSender(interval_s=1e-9)
    with hosts.hosted(host):
        sender.send({"step": 1}, now=True)
        sender.send({"step": 2}, now=True)
        with pytest.raises(RuntimeError, match=r"the controller is gone \(step 2\)"):
            sender.flush()
        with pytest.raises(RuntimeError, match="the controller is gone"):
            sender.send({"step": 3}, now=True)


def test_the_runs_records_hold_each_logged_step_as_its_own_report(tmp_path):
    from types import SimpleNamespace

    from behemoth.tracking.callbacks import RunRecorder
    from behemoth.tracking.records import read_jsonl

    recorder = RunRecorder(str(tmp_path), "inv", tensorboard=False)
    recorder.after_report(SimpleNamespace(checkpoint=None), [
        {"step": 30, "loss": 3.0, LOGGED: [{"step": 10, "loss": 1.0}, {"step": 20, "loss": 2.0}]}, {"step": 30}])
    recorder.after_report(SimpleNamespace(checkpoint=None), [{"step": 40, "loss": 4.0}])
    recorder.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in rows] == [(10, 1.0), (20, 2.0), (30, 3.0), (40, 4.0)]
    assert all(LOGGED not in r and r["invocation"] == "inv" for r in rows)
