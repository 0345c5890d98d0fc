"""Worker side: how a report reaches the host without holding the training step (a thread of its own, in
order; the logged steps between two reports go with the next)."""

from __future__ import annotations

import queue
import threading
import time

from behemoth.checkpoints import send_report
from behemoth.metrics import LOGGED


class ReportSender:
    """Reports to the host without holding the training step.

    Ray Train's worker keeps one uncollected report and its controller collects every poll interval
    (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: 0.2 s where behemoth starts the driver); each report is also a barrier
    of all ranks through an actor, and waits for the asynchronous upload of the checkpoint reported before it:
    a run that reports every 10 steps of 17 ms waits at nearly every report, and at the first one after a
    checkpoint for its whole upload. So (with the host's `report_interval_s` > 0) the sending runs in a thread
    of its own, in order, and a logged step's metrics are handed to it only when rank 0 votes so: an interval
    (REPORT_EVERY_S, or the host's poll interval if longer) has passed since its last report and its thread
    is idle. The ones in between wait here and go with the
    next report handed over, under LOGGED (the run's records expand them: every logged step is kept, and the
    console prints each at once). Every rank learns rank 0's vote in the metrics' all-reduce, so all ranks send
    the same reports (the barrier counts calls). The report after a checkpoint goes at once (a failed upload
    then ends the run at the next report). A checkpoint's report goes through the thread too, in order, after
    the training thread took its snapshot (`submit`); a synchronous checkpoint's (a preemption's) waits for the
    thread first and is sent by the training thread. An error in the thread is raised in the training thread at
    the next report. A crash loses the logged steps not handed over yet: at
    most about an interval's. A host with interval 0 (a sweep's lane, in-process) gets every report at once, in
    the training thread."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.pending: list[dict] = []
        self.last_sent = time.monotonic()
        self.after_checkpoint = False  # the next report goes at once
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def due(self) -> bool:
        """Rank 0's vote (the ranks' all-reduce shares it): an interval since its last report, its thread idle."""
        return time.monotonic() - self.last_sent >= self.interval_s and self._queue.unfinished_tasks == 0

    def send(self, report: dict, now: bool) -> None:
        """A metrics-only report: held until a report step where `now` (the same on every rank)."""
        self.raise_failed()
        if not (now or self.after_checkpoint):
            self.pending.append(report)
            return
        self.after_checkpoint = False
        self.attach_pending(report)
        if self.interval_s <= 0:
            send_report(report)
            return
        self._start()
        self._queue.put(report)

    def submit(self, call) -> None:
        """A checkpoint's report (a call that sends it), after the reports handed over before it."""
        self.raise_failed()
        if self.interval_s <= 0:
            call()
            return
        self._start()
        self._queue.put(call)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="behemoth-reports", daemon=True)
            self._thread.start()

    def attach_pending(self, report: dict) -> None:
        """The held logged steps go with `report` (the next one sent, a checkpoint's included)."""
        if self.pending:
            report[LOGGED] = self.pending
            self.pending = []
        self.last_sent = time.monotonic()

    def flush(self) -> None:
        """Wait until every report handed to the thread has reached the host."""
        if self._thread is not None:
            self._queue.join()
        self.raise_failed()

    def raise_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            report = self._queue.get()
            try:
                if self._error is None:
                    report() if callable(report) else send_report(report)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
            finally:
                self._queue.task_done()
