"""What of Ray's own output reaches the driver's console: everything, except lines known to be noise in a
behemoth run (each listed below with why), so that a traceback on the console means something failed that
behemoth's own lines do not already explain (a run-ending data, config or disk error is said in one line).

Ray forwards every worker's and actor's stdout/stderr to the driver (log_to_driver). behemoth wraps the
handler that prints them (Ray 2.60: `ray_print_logs` on the driver's stdstream dispatcher) with a filter;
warnings and tracebacks that match none of the patterns pass unchanged.
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
import time

from behemoth.errors import NOT_RETRIED

# Whole lines that are noise in every behemoth run.
NOISE_LINES = [
    # Ray Train's controller creates its PreemptionWatcher actor with arguments in the object store and
    # restarts allowed; Ray's core worker warns about that pattern at every controller start (not actionable).
    re.compile(r"core_worker\.cc:\d+: Actor with class name: 'PreemptionWatcher' .* has constructor arguments"),
    # Ray Train's placement-group cleaner, after a stopped sweep trial: the sweep prints its own line.
    re.compile(r"^Detected that the Ray Train controller actor \(\w+\) is dead\. Cleaning up placement group"),
]

# A traceback block (from "Traceback ..." or "Exception ignored in ..." to its end) is noise when it records an
# exit Ray asked for, which is how a sweep stops a trial and how Ray Train tears down a worker group:
# - it ends in "SystemExit: N" raised by Ray's SIGTERM handler (Tune stopping a trial's actor; the handler's
#   SystemExit surfaced inside whatever Python was running, e.g. a weakref callback);
# - it holds an ActorDiedError and ends in Ray's "The actor is dead because ..." line with exit type
#   INTENDED_SYSTEM_EXIT: a training worker's "Error in training function" whose report in flight found Ray
#   Train's SynchronizationActor gone because Ray destroyed the group on purpose (its placement group was
#   removed, or its owner, the trial's controller, was stopped);
# - it is the traceback Ray Train's controller prints under its own line "Graceful shutdown of backend failed.
#   This is expected if one of the workers has crashed." (torch's on_shutdown call to a dead worker): the line
#   stays, as it says what happened; the traceback under it says nothing more.
# An actor that died any other way (exit type SYSTEM_ERROR, not under that line) still shows.
_BLOCK_START = re.compile(r"^(Traceback \(most recent call last\):|Exception ignored in: |Error in training function:)")
_SIGTERM_END = re.compile(r"^SystemExit: \d+\s*$")
_ACTOR_DEATH_END = re.compile(r"^The actor is dead because")
_INTENDED = re.compile(r"exit type: INTENDED_SYSTEM_EXIT", re.IGNORECASE)
_CRASHED_SHUTDOWN = "Graceful shutdown of backend failed. This is expected if one of the workers has crashed."


def _intended_exit_block(lines: list[str], i: int) -> int | None:
    """The index of the last line of the intended-exit traceback starting at lines[i], or None."""
    under_shutdown_line = i > 0 and lines[i - 1].strip() == _CRASHED_SHUTDOWN
    for j in range(i + 1, min(len(lines), i + 60)):
        block = lines[i:j]
        if _SIGTERM_END.match(lines[j]):
            return j if any("sigterm_handler" in line for line in block) else None
        if _ACTOR_DEATH_END.match(lines[j]):
            intended = _INTENDED.search(lines[j]) or (
                under_shutdown_line and any("on_shutdown" in line for line in block))
            return j if intended and any("ActorDiedError" in line for line in block) else None
    return None


# A traceback block that ends in one of behemoth's errors that end a run at once (errors.NOT_RETRIED: a bad
# sample, a config a worker rejects, a full disk) says nothing the one line of the controller's failure policy
# and the command's error line do not: it is left in Ray's worker log (the policy's line says where), not
# printed; nor are Ray's lines that announce it (_PREAMBLES) and Ray's wrapping of it (_not_retried_block).
_NOT_RETRIED_END = re.compile(rf"^behemoth\.errors\.({'|'.join(t.__name__ for t in NOT_RETRIED)}): ")
# Ray's own lines announcing such a failure, just before its traceback: a failed background upload (Ray Train),
# a failed task of a dataset (Ray Data).
_PREAMBLES = ("`ray.train.report(checkpoint_upload_mode=ASYNC)` checkpoint upload failed in the background",
              "An exception was raised from a task of operator",
              "Exception occurred in user code, with the abbreviated stack trace below")
_CHAINING = ("During handling of the above exception", "The above exception was the direct cause")


_RAY_TASK_HEADER = re.compile(r"^(\x1b\[\d+m)?ray::")  # "ray::MapBatches(transform_batch)() (pid=.., ip=..)"
_DIRECT_CAUSE = "The above exception was the direct cause"


def _not_retried_block(lines: list[str], i: int) -> int | None:
    """The index of the last line of the traceback starting at lines[i] if what failed is a NOT_RETRIED error:
    its exception line, after any number of frames (Ray's RayTaskError line holds its task's frames under it),
    and then at most Ray's own wrapping of it ("The above exception was the direct cause ..." followed by a
    `ray.exceptions.` error, e.g. Ray Data's UserCodeException), up to the blank line that ends that. Another
    exception raised while handling it, or any other error, keeps the whole traceback."""
    j = i + 1
    while j < min(len(lines), i + 200):
        line = lines[j]
        if _NOT_RETRIED_END.match(line):
            break
        following = next((x for x in lines[j + 1:j + 3] if x.strip()), "")
        if (line.strip() and not line[0].isspace() and not _BLOCK_START.match(line)
                and not _RAY_TASK_HEADER.match(line) and not following[:1].isspace()):
            return None  # the traceback ends in another error
        j += 1
    else:
        return None
    after = next((k for k in range(j + 1, min(len(lines), j + 4)) if lines[k].strip()), None)
    if after is None or not lines[after].startswith(_CHAINING):
        return j
    if not lines[after].startswith(_DIRECT_CAUSE):
        return None  # something else failed while handling it
    wrapper = next((k for k in range(after + 1, min(len(lines), after + 6))
                    if lines[k].strip() and not _RAY_TASK_HEADER.match(lines[k])), None)
    if wrapper is None or not lines[wrapper].startswith("ray.exceptions."):
        return None
    end = next((k for k in range(wrapper + 1, min(len(lines), wrapper + 20)) if not lines[k].strip()), None)
    return end if end is not None else len(lines) - 1


def filter_lines(lines: list[str]) -> list[str]:
    """`lines` without the noise lines, without tracebacks of an exit Ray asked for, and without tracebacks
    of an error that ends the run with its own line."""
    kept, i = [], 0
    while i < len(lines):
        if _BLOCK_START.match(lines[i]):
            end = _intended_exit_block(lines, i)
            if end is None and (end := _not_retried_block(lines, i)) is not None:
                while end + 1 < len(lines) and not lines[end + 1].strip():
                    end += 1  # and the blank line Ray Train prints after it
                while kept and kept[-1].startswith(_PREAMBLES):
                    kept.pop()  # Ray's announcement of it
            if end is not None:
                i = end + 1
                continue
        if not any(p.search(lines[i]) for p in NOISE_LINES):
            kept.append(lines[i])
        i += 1
    return kept


def install() -> None:
    """Filter the worker output this driver prints (once per Ray session; a no-op without log_to_driver)."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    with dispatcher._lock:
        for i, (name, handler) in enumerate(dispatcher.handlers):
            if name == "ray_print_logs" and not getattr(handler, "behemoth_filter", False):
                dispatcher.handlers[i] = (name, _filtered(handler))


# Ray forwards a process's output in batches as it comes, so a traceback can arrive cut in two: its first part
# alone would match no pattern and print. A batch that ends inside a traceback keeps that traceback back (per
# process and stream) until the same process's next batch completes it; held lines are let out as they are
# once HOLD_S passes without it (at the next batch of any process), and at the driver's exit.
HOLD_S = 2.0


def _unfinished_tail(lines: list[str]) -> int | None:
    """Where a traceback cut off by the end of `lines` begins (its chain and Ray's announcement of it included),
    or None when the last line that is not blank is not inside one (a frame, a block start, a chaining line,
    an announcement)."""
    body = [line for line in lines if line.strip()]
    if not body or not (body[-1][:1].isspace() or _BLOCK_START.match(body[-1])
                        or body[-1].startswith(_CHAINING + _PREAMBLES)):
        return None
    starts = [i for i, line in enumerate(lines) if _BLOCK_START.match(line) or line.startswith(_PREAMBLES)]
    if not starts:
        return None
    start = starts[-1]
    while True:
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        if prev >= 0 and (_BLOCK_START.match(lines[prev]) or lines[prev].startswith(_PREAMBLES)):
            start = prev  # "Error in training function:" over its "Traceback ...", an announcement over it
        elif prev >= 0 and lines[prev].startswith(_CHAINING) and any(i < prev for i in starts):
            start = max(i for i in starts if i < prev)  # the first traceback of a chain
        else:
            return start


def _filtered(print_logs):
    held: dict = {}  # (pid, is_err) -> (data, lines, since)
    lock = threading.Lock()

    def emit(data: dict, lines: list[str]) -> None:
        lines = filter_lines(lines)
        if lines:
            print_logs({**data, "lines": lines})

    def print_filtered(data: dict) -> None:
        key = (data.get("pid"), data.get("is_err"))
        with lock:
            now = time.monotonic()
            lines = list(data.get("lines") or [])
            if key in held:
                lines = held.pop(key)[1] + lines
            for stale in [k for k, (_, _, since) in held.items() if now - since > HOLD_S]:
                old, old_lines, _ = held.pop(stale)
                emit(old, old_lines)
            cut = _unfinished_tail(lines)
            if cut is not None:
                held[key] = (data, lines[cut:], now)
                lines = lines[:cut]
            emit(data, lines)

    def flush() -> None:
        with lock:
            while held:
                data, lines, _ = held.pop(next(iter(held)))
                emit(data, lines)

    atexit.register(flush)
    print_filtered.flush = flush
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
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _TokenAuthNotice) for f in logger.filters):
        logger.addFilter(_TokenAuthNotice())
