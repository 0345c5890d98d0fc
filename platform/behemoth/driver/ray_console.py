"""What of Ray's own output reaches the driver's console: everything, except what is proven noise in a behemoth
run: a few whole lines, and tracebacks that are, whole, one traceback of a known kind (each listed below with
why), so that a traceback on the console means something failed that behemoth's own lines do not already
explain. The console never loses a real error: a block is dropped only when all of it, from its first line to
its last, is read as one of those kinds, with no other error chained to it before or after; anything else,
however it is cut across Ray's batches and whatever noise comes before or after it, is printed whole, in
order. The dropped tracebacks stay in Ray's worker logs (worker-*.err in the node's Ray log folder).

Ray forwards every worker's and actor's stdout/stderr to the driver (log_to_driver). behemoth wraps the
handler that prints them (Ray 2.60: `ray_print_logs` on the driver's stdstream dispatcher) with a filter.
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

# The traceback blocks that are noise, each one traceback read whole (its header, "Traceback ...", frames, its
# exception line and what belongs to that line, nothing else), not chained to another:
# 1. An exit Ray asked for, which is how a sweep stops a trial and how Ray Train tears down a worker group:
#    - "SystemExit: N" raised by Ray's SIGTERM handler (a frame of ray/_private/worker.py's sigterm_handler):
#      Tune stopping a trial's actor; it surfaces inside whatever Python was running, e.g. a weakref callback;
#    - an ActorDiedError whose "The actor is dead because ..." line says INTENDED_SYSTEM_EXIT: a training
#      worker's "Error in training function" whose report in flight found Ray Train's SynchronizationActor gone
#      because Ray destroyed the group on purpose (its placement group was removed, or its owner, the trial's
#      controller, was stopped);
#    - the ActorDiedError of torch's on_shutdown call to a dead worker, under Ray Train's controller's own line
#      "Graceful shutdown of backend failed. This is expected if one of the workers has crashed.": the line
#      stays, as it says what happened; the traceback under it says nothing more.
#    An actor that died any other way (exit type SYSTEM_ERROR, not under that line) still shows.
# 2. A worker's failure on one of behemoth's errors that end a run at once (errors.NOT_RETRIED: a bad sample, a
#    config a worker rejects, a full disk): the run ends with the failure policy's line (which says where the
#    traceback is kept) and the command's error line. Only where Ray Train prints the failure it hands to the
#    controller, which is what ends the run: under "Error in training function:" (ray/train/v2/_internal/
#    util.py: construct_user_exception_with_traceback) or under the line of a failed background checkpoint
#    upload, which Ray Train hands on the same way right after. With it go Ray Data's lines announcing it just
#    above and Ray's wrapping of it just below. The same error printed anywhere else (a thread's, a log's), or
#    chained to another error, shows: it did not, or not alone, end the run.
_TRACEBACK = "Traceback (most recent call last):"
_TRAIN_FN_FAILED = "Error in training function:"
_IGNORED = "Exception ignored in: "
_UPLOAD_FAILED = "`ray.train.report(checkpoint_upload_mode=ASYNC)` checkpoint upload failed in the background"
_DATA_ABORT = re.compile(r'^An exception was raised from a task of operator ".*"\. Dataset execution will now abort\.')
_DATA_USER_CODE = "Exception occurred in user code, with the abbreviated stack trace below"
_CRASHED_SHUTDOWN = "Graceful shutdown of backend failed. This is expected if one of the workers has crashed."
_DIRECT_CAUSE = "The above exception was the direct cause"
_CHAINING = ("During handling of the above exception", _DIRECT_CAUSE)
_SIGTERM_END = re.compile(r"^SystemExit: \d+\s*$")
_SIGTERM_FRAME = re.compile(r'ray/_private/worker\.py", line \d+, in sigterm_handler\s*$')
_ACTOR_DIED = "ray.exceptions.ActorDiedError: "
_ACTOR_DEATH_END = re.compile(r"^The actor is dead because")
_INTENDED = re.compile(r"exit type: INTENDED_SYSTEM_EXIT", re.IGNORECASE)
_NOT_RETRIED_END = re.compile(rf"^behemoth\.errors\.({'|'.join(t.__name__ for t in NOT_RETRIED)}): ")
_RAY_TASK_HEADER = re.compile(r"^(\x1b\[\d+m)?ray::")  # "ray::MapBatches(transform_batch)() (pid=.., ip=..)"
# A RayTaskError's line, over the frames of the remote task it carries
_RAY_TASK_LINE = re.compile(r"^((\x1b\[\d+m)?ray::|ray\.exceptions\.RayTaskError(\(\w+\))?: )")
_END = "\x00"  # what a read past the last line gives: a line that is no part of any block


class _Lines:
    """The lines being read, noting a read past the last one (`ran_out`): a block read then may be decided
    differently once the lines after it come (a chained traceback, the rest of a cut one)."""

    def __init__(self, lines: list[str]):
        self.lines, self.ran_out = lines, False

    def __getitem__(self, j: int) -> str:
        if j < len(self.lines):
            return self.lines[j]
        self.ran_out = True
        return _END

    def text_from(self, j: int) -> int:
        """The index of the first line from j on that is not blank."""
        while self[j] != _END and not self[j].strip():
            j += 1
        return j


def _exception_line(src: _Lines, j: int) -> int | None:
    """The index of the exception line of the traceback whose "Traceback ..." line is lines[j], or None when
    lines[j] does not start one. Frames are indented lines, with blank lines between them and RayTaskError
    lines over a remote task's frames; the exception line follows the last frame directly."""
    if src[j].rstrip() != _TRACEBACK:
        return None
    k = j + 1
    while src[k].startswith(" ") or (
            (not src[k].strip() or _RAY_TASK_LINE.match(src[k])) and src[src.text_from(k + 1)].startswith(" ")):
        k += 1
    return k if src[k] != _END and src[k].strip() else None


def _intended_exit_end(src: _Lines, i: int, under_shutdown: bool = False) -> int | None:
    """The index of the last line of the intended-exit traceback (kind 1) starting at lines[i] ("Traceback"
    or a header over it), or None."""
    j = i + 1 if src[i].startswith((_IGNORED, _TRAIN_FN_FAILED)) else i
    k = _exception_line(src, j)
    if k is None:
        return None
    frames = src.lines[j + 1:k]
    if _SIGTERM_END.match(src[k]):
        return k if any(_SIGTERM_FRAME.search(line) for line in frames) else None
    if not src[k].startswith(_ACTOR_DIED):
        return None
    k += 1
    while src[k].startswith("\t"):  # the ActorDiedError's "\tclass_name: ...", "\tpid: ..."
        k += 1
    intended = _ACTOR_DEATH_END.match(src[k]) and (
        _INTENDED.search(src[k]) or (under_shutdown and any("in on_shutdown" in line for line in frames)))
    return k if intended else None


def _run_ending_end(src: _Lines, i: int) -> int | None:
    """The index of the last line of the run-ending traceback (kind 2) under Ray Train's line lines[i], with
    Ray's wrapping of it and the blank lines after it, or None."""
    k = _exception_line(src, i + 1)
    if k is None or not _NOT_RETRIED_END.match(src[k]):
        return None
    after = src.text_from(k + 1)
    if src[after].startswith(_DIRECT_CAUSE):
        k = _ray_wrapping_end(src, after)
        if k is None:
            return None
    while src[k + 1] != _END and not src[k + 1].strip():
        k += 1  # the blank line Ray Train prints after it
    return k


def _ray_wrapping_end(src: _Lines, j: int) -> int | None:
    """lines[j] says "The above exception was the direct cause ...": the index of the last line of what
    follows if it is Ray's wrapping (a `ray::` task line, a `ray.exceptions.` error and its message, e.g.
    Ray Data's UserCodeException), or None (a user's own wrapper, say)."""
    k = src.text_from(j + 1)
    if _RAY_TASK_HEADER.match(src[k]):
        k += 1
    if not src[k].startswith("ray.exceptions."):
        return None
    while _goes_on_message(src[k + 1]):
        k += 1
    return k


def _goes_on_message(line: str) -> bool:
    """Whether `line` can be one more line of an exception's message: text, not a frame, not a new block."""
    return (line != _END and bool(line.strip()) and not line[0].isspace() and not line.startswith(_CHAINING)
            and line.rstrip() not in (_TRACEBACK, _TRAIN_FN_FAILED, _CRASHED_SHUTDOWN)
            and not line.startswith((_IGNORED, _UPLOAD_FAILED, _DATA_USER_CODE)) and not _DATA_ABORT.match(line))


def _noise_block(src: _Lines, i: int, before: str) -> tuple[int, int] | None:
    """(first, last): the lines to drop for the noise block that lines[i] starts, or None. `before`: the last
    line that is not blank before lines[i] (in this or an earlier batch of the same stream)."""
    line, first, end = src[i], i, None
    if line.rstrip() == _CRASHED_SHUTDOWN:
        first = i + 1  # the line stays
        end = _intended_exit_end(src, first, under_shutdown=True)
    elif _DATA_ABORT.match(line) or line.startswith(_DATA_USER_CODE):
        j = i
        while _DATA_ABORT.match(src[j]) or src[j].startswith(_DATA_USER_CODE):
            j += 1
        end = _run_ending_end(src, j) if src[j].rstrip() == _TRAIN_FN_FAILED else None
    elif line.startswith(_UPLOAD_FAILED):
        end = _run_ending_end(src, i)
    elif line.rstrip() == _TRAIN_FN_FAILED:
        end = _run_ending_end(src, i)
        end = _intended_exit_end(src, i) if end is None else end
    elif line.rstrip() == _TRACEBACK or line.startswith(_IGNORED):
        end = _intended_exit_end(src, i)
    if end is None or before.startswith(_CHAINING) or src[src.text_from(end + 1)].startswith(_CHAINING):
        return None  # not noise, or one link of a chained traceback: another error is in it
    return first, end


def _scan(lines: list[str], before: str = "", final: bool = True) -> tuple[list[str], list[str], str]:
    """(the lines to print, the lines to hold back, the last line not blank before those held). Unless `final`,
    the lines from the first block that cannot be decided before more lines come (it reaches the last line)
    are held back; `before`: the last line not blank that came before `lines` in the same stream."""
    src, kept, i = _Lines(lines), [], 0
    while i < len(lines):
        src.ran_out = False
        block = _noise_block(src, i, before)
        if src.ran_out and not final:
            return kept, lines[i:], before
        if block is None:
            if not any(p.search(lines[i]) for p in NOISE_LINES):
                kept.append(lines[i])
            before = lines[i] if lines[i].strip() else before
            i += 1
        else:
            first, end = block
            kept += lines[i:first]  # (the crashed-shutdown line)
            before = next(line for line in reversed(lines[i:end + 1]) if line.strip())
            i = end + 1
    return kept, [], before


def filter_lines(lines: list[str]) -> list[str]:
    """`lines` without the noise lines and the noise tracebacks."""
    return _scan(lines)[0]


def install() -> None:
    """Filter the worker output this driver prints (once per Ray session; a no-op without log_to_driver)."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    with dispatcher._lock:
        for i, (name, handler) in enumerate(dispatcher.handlers):
            if name == "ray_print_logs" and not getattr(handler, "behemoth_filter", False):
                dispatcher.handlers[i] = (name, _filtered(handler))


# Ray forwards a process's output in batches as it comes, so a traceback can arrive cut anywhere: a part alone
# may read as noise or as real when the whole does not. A batch whose end leaves a block undecided keeps that
# block back (per process and stream) until the same process's next batch decides it; held lines are let out,
# filtered as they are, once HOLD_S passes without it, and at the driver's exit.
HOLD_S = 2.0


def _filtered(print_logs):
    held: dict = {}  # (pid, is_err) -> (data, lines, since)
    before: dict = {}  # (pid, is_err) -> the last line not blank before what is held (chains cross batches)
    lock = threading.Lock()
    timer = [None]  # the one pending release of held lines, if any

    def scan(key, data: dict, lines: list[str], final: bool) -> None:
        kept, rest, before[key] = _scan(lines, before.get(key, ""), final)
        if rest:
            held[key] = (data, rest, time.monotonic())
        if kept:
            print_logs({**data, "lines": kept})

    def release(now: float, stale_only: bool) -> None:
        for key in [k for k, (_, _, since) in held.items() if not stale_only or now - since >= HOLD_S]:
            data, lines, _ = held.pop(key)
            scan(key, data, lines, final=True)

    def schedule(now: float) -> None:
        """Wake up when the oldest held lines are due, unless a wake-up is pending."""
        if held and timer[0] is None:
            due = min(since for _, _, since in held.values()) + HOLD_S
            timer[0] = threading.Timer(max(0.0, due - now), wake_up)
            timer[0].daemon = True  # nothing waits for it at exit: the atexit flush lets all out
            timer[0].start()

    def wake_up() -> None:
        with lock:
            timer[0], now = None, time.monotonic()
            release(now, stale_only=True)
            schedule(now)

    def print_filtered(data: dict) -> None:
        key = (data.get("pid"), data.get("is_err"))
        with lock:
            lines = (held.pop(key)[1] if key in held else []) + list(data.get("lines") or [])
            scan(key, data, lines, final=False)
            schedule(time.monotonic())

    def flush() -> None:
        with lock:
            release(time.monotonic(), stale_only=False)

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
