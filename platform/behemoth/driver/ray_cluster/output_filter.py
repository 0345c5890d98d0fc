"""The driver's console hooks on Ray's output: the filter of driver/ray_cluster/output_scan.py installed on what Ray
prints, Ray Tune's log of a failed trial, and Ray's token-auth notice. This is what touches Ray (through
ray_internals) and keeps state: the lines held back per process until a later batch decides them, the
tracebacks already shown, the timer that lets held lines out; what the lines are is decided in the scan.

Ray forwards every worker's and actor's stdout/stderr to the driver (log_to_driver). behemoth wraps the
handler that prints them (Ray 2.60: `ray_print_logs` on the driver's stdstream dispatcher) with a filter,
and turns Ray's own log deduplication off for it (see `install`).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time

from behemoth.driver.ray_cluster.output_scan import one_line_per_repeat, scan_lines
from behemoth.errors import RunFailedError


def install() -> None:
    """Filter the worker output this driver prints (once per Ray session; a no-op without log_to_driver)."""
    from behemoth.ray_internals import core

    ray_logging = core.ray_logging()

    # Ray's log deduplication (RAY_DEDUP_LOGS, on by default) runs after this filter, on what it prints: lines
    # equal to one another process printed in the last 5 s are held back and printed later, or merged into
    # "... [repeated 2x across cluster]" lines, which cuts a second traceback that shares lines with a first
    # one (another message, the same frames) into pieces. The filter collapses whole repeated tracebacks
    # itself, so it is off here, unless the user set the variable. Ray reads it when ray is imported, before
    # behemoth runs, so the flag its deduplicators read on every batch is set instead.
    if "RAY_DEDUP_LOGS" not in os.environ:
        ray_logging.RAY_DEDUP_LOGS = False
    dispatcher = ray_logging.global_worker_stdstream_dispatcher
    with dispatcher._lock:
        for i, (name, handler) in enumerate(dispatcher.handlers):
            if name == "ray_print_logs" and not getattr(handler, "behemoth_filter", False):
                dispatcher.handlers[i] = (name, _filtered(handler))
    filter_tune_trial_errors()


# Ray Tune logs every failed trial's error on the driver ("Trial task failed for trial ..."), with the whole
# traceback of the trial's driver function. For a trial that ended on behemoth's RunFailedError that is a
# third copy: its workers' tracebacks came through this console (whole, once), and the RunFailedError's one
# line names each rank's error. There it becomes that one line; Tune keeps the whole in the trial's error.txt
# (its path follows on the console). Any other error (the trial's driver itself failing) keeps its traceback.
TUNE_CONTROLLER_LOG = "ray.tune.execution.tune_controller"


def filter_tune_trial_errors() -> None:
    tune_log = logging.getLogger(TUNE_CONTROLLER_LOG)
    if not any(isinstance(f, TrialErrorOnce) for f in tune_log.filters):
        tune_log.addFilter(TrialErrorOnce())


class TrialErrorOnce(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        failed = _run_failure(record.exc_info[1] if record.exc_info else None)
        if failed is not None:
            record.msg = (f"{record.getMessage()}: {failed} (its workers' traceback is shown above; the trial's "
                          f"whole error: the error file below)")
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


def _run_failure(error: BaseException | None) -> str | None:
    """behemoth's one line when `error` is a RunFailedError, or Ray's wrapping of one (a task's error: only its
    `cause` is followed, never an error raised while handling another), else None."""
    for _ in range(8):  # Ray wraps a task's error once per task it crossed
        cause = getattr(error, "cause", None)
        if not isinstance(cause, BaseException):
            break
        error = cause
    return str(error) if isinstance(error, RunFailedError) else None


def _process(data: dict) -> str:
    """The process a batch of lines comes from, as Ray's prefix on them names it ("RayTrainWorker pid=12")."""
    name = data.get("actor_name") or data.get("task_name")
    ip = data.get("ip")
    where = f", ip={ip}" if ip and ip != data.get("localhost") else ""
    return f"{name + ' ' if name else ''}pid={data.get('pid')}{where}"


# Ray forwards a process's output in batches as it comes, so a traceback can arrive cut anywhere: a part alone
# may read as noise or as real when the whole does not, and a real one is compared with those shown only whole
# (its message or a chained traceback may follow). A batch whose end leaves a block undecided keeps that block
# back, with the header line over it (per process and stream), until the same process's next batch decides it.
# Held lines are let out, filtered as they are, HOLD_S after the first of them came (whatever came after it:
# lines that go on an error's message keep it undecided, so a bound from the last batch would hold a real
# traceback for as long as a process keeps printing), when more than HOLD_LINES are held (each batch reads the
# held lines again: this bounds its cost), and at the driver's exit.
HOLD_S = 2.0
HOLD_LINES = 500  # a traceback chained through Ray's wrappers is ~100-200 lines


def _wake_up_after(delay_s: float, callback) -> None:
    timer = threading.Timer(delay_s, callback)
    timer.daemon = True  # nothing waits for it at exit: the atexit flush lets all out
    timer.start()


def _filtered(print_logs, clock=time.monotonic, wake_up_after=_wake_up_after):
    """`print_logs` behind the filter, for Ray's batches of one process's lines. `clock` and `wake_up_after`
    (delay, callback): the time held lines are measured by, and how a release of them is scheduled."""
    held: dict = {}  # (pid, is_err) -> (data, lines, when each of them came)
    shown: dict = {}  # the tracebacks shown whole on this console (see output_scan.one_line_per_repeat)
    before: dict = {}  # (pid, is_err) -> the last line not blank before what is held (chains cross batches)
    lock = threading.Lock()
    wake_up_pending = [False]  # one pending release of held lines at most

    def scan(key, data: dict, lines: list[str], came: list[float], final: bool) -> None:
        kept, tracebacks, rest, before[key] = scan_lines(lines, before.get(key, ""), final)
        if rest:
            held[key] = (data, rest, came[len(lines) - len(rest):])
        if tracebacks:
            kept = one_line_per_repeat(kept, tracebacks, _process(data), shown)
        if kept:
            print_logs({**data, "lines": kept})

    def release(keys) -> None:
        for key in list(keys):
            data, lines, came = held.pop(key)
            scan(key, data, lines, came, final=True)

    def release_due(now: float) -> None:
        release(key for key, (_, _, came) in held.items() if now - came[0] >= HOLD_S)

    def schedule(now: float) -> None:
        """Wake up when the oldest held lines are due, unless a wake-up is pending."""
        if held and not wake_up_pending[0]:
            due = min(came[0] for _, _, came in held.values()) + HOLD_S
            wake_up_pending[0] = True
            wake_up_after(max(0.0, due - now), wake_up)

    def wake_up() -> None:
        with lock:
            wake_up_pending[0], now = False, clock()
            release_due(now)
            schedule(now)

    def print_filtered(data: dict) -> None:
        key, lines = (data.get("pid"), data.get("is_err")), list(data.get("lines") or [])
        with lock:
            now = clock()
            release_due(now)  # (as the wake-up would, had it come first)
            if key in held and len(held[key][1]) + len(lines) > HOLD_LINES:
                release([key])
            _, held_lines, came = held.pop(key, (None, [], []))
            scan(key, data, held_lines + lines, came + [now] * len(lines), final=False)
            schedule(now)

    def flush() -> None:
        with lock:
            release(held)

    atexit.register(flush)
    print_filtered.flush = flush
    print_filtered.shown = shown
    print_filtered.behemoth_filter = True
    return print_filtered


class _TokenAuthNotice(logging.Filter):
    """Ray 2.60 turns token auth on by default for a new local instance and says so at every start ("Token
    authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out"): behemoth wants
    it on, so that is not news. Its warning that auth is *disabled* still shows. (Setting RAY_AUTH_MODE=token
    instead does not work from here: Ray's core reads it when ray is imported, and a GCS started with the
    variable then rejects this driver.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def quiet_token_auth_notice() -> None:
    from behemoth.ray_internals.core import token_auth_logger

    logger = token_auth_logger()
    if not any(isinstance(f, _TokenAuthNotice) for f in logger.filters):
        logger.addFilter(_TokenAuthNotice())
