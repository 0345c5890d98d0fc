"""Reading Ray's forwarded worker output, as text: which of its lines and blocks are noise, which tracebacks
are real (whole, chained, cut across batches), and a repeat of a real one as one line. Pure functions of
lines, with no Ray in them, so the tests feed them lines; installing them on the driver's console (Ray's
printer, the lines held back between batches, Tune's and Ray's loggers) is driver/ray_cluster/output_filter.py.

What of Ray's own output reaches the driver's console: everything, except what is proven noise in a behemoth
run: a few whole lines, and tracebacks that are, whole, one traceback of a known kind (each listed below with
why), so that a traceback on the console means something failed that behemoth's own lines do not already
explain. The console never loses a real error: a block is dropped only when all of it, from its first line to
its last, is read as one of those kinds, with no other error chained to it before or after; anything else,
however it is cut across Ray's batches and whatever noise comes before or after it, is printed whole, in
order. The dropped tracebacks stay in Ray's worker logs (worker-*.err in the node's Ray log folder).

A real traceback shows whole once: a later copy of it, equal line for line once pids and memory addresses
are taken out (another rank's, a retried attempt's), is printed as one line that names the process that
showed it whole and its error. A copy that differs in any other way shows whole.
"""

from __future__ import annotations

import re

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

# A real traceback already shown whole is shown again as one line: each rank of each attempt prints the same
# user error. A copy is the same error when its lines are equal once what differs between processes is taken
# out: pids, Ray's actor ids and ips, memory addresses (in a repr: 8 hex digits or more, not a byte's 0xff).
# Nothing else: another message (other shapes), another frame or line number is another error: it shows whole.
_VOLATILE = re.compile(r"\b(pid[=:] ?\d+|ip=[\w.:]+|actor_id[=:] ?[0-9a-f]+|0x[0-9a-fA-F]{8,})")
# The line a traceback is printed under, which goes with it (when it is the same for the copy).
_HEADERS = (_TRAIN_FN_FAILED, "Exception in thread ", _IGNORED)
_OWN = "[behemoth] "  # behemoth's own lines: never part of another error's message
# Lines that start a new record, never go on an error's message: a log record's time stamp (Ray's core
# "[2026-11-23 12:48:54,770 E ...]", Python logging's "2026-11-23 12:48:54,770 ..."), Ray Data's line on a
# failed task (also when it goes on: "... Ignoring this exception with remaining max_errored_blocks=3.")
_NEW_RECORD = re.compile(r'^(\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d'
                         r'|An exception was raised from a task of operator ")')
_SHOWN_MAX = 1000  # distinct tracebacks remembered (a long sweep's), the oldest forgotten first


class _Lines:
    """The lines being read, noting a read past the last one (`ran_out`): a block read then may be decided
    differently once the lines after it come (a chained traceback, the rest of a cut one)."""

    def __init__(self, lines: list[str]):
        self.lines, self.ran_out = lines, False
        self.read: dict = {}  # j -> (_exception_line(self, j), whether reading it ran out)

    def __getitem__(self, j: int) -> str:
        try:
            return self.lines[j]
        except IndexError:
            self.ran_out = True
            return _END

    def lines_after(self, j: int) -> bool:
        """Whether a line comes after lines[j] (reading it: none yet may mean not yet)."""
        return self[j + 1] != _END

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
    if j not in src.read:  # read once: a traceback is read for noise, then as a real one
        ran_out, src.ran_out = src.ran_out, False
        src.read[j] = _after_frames(src, j + 1), src.ran_out
        src.ran_out = ran_out
    src.ran_out |= src.read[j][1]  # (a read past the last line counts at every read)
    return src.read[j][0]


def _after_frames(src: _Lines, k: int) -> int | None:
    """The index of the line after the frames from lines[k] on, or None when it is blank or past the last."""
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


def _message_goes_on(line: str) -> bool:
    """Whether `line` can be one more line of a real error's message: as for `_goes_on_message`, or a field
    Ray indents with a tab under its error (an ActorDiedError's class_name, pid); a noise line, behemoth's
    own, another traceback's header or a new log record ends it (the noise must still go, and a copy of the
    traceback followed by other lines is still the same)."""
    return ((line.startswith("\t") or _goes_on_message(line)) and not line.startswith(_OWN)
            and not line.startswith(_HEADERS) and not _NEW_RECORD.match(line)
            and not any(p.search(line) for p in NOISE_LINES))


def _traceback_chain(src: _Lines, i: int, before: str) -> tuple[int, int] | None:
    """(the index of its last line, that of its error's line) for the real traceback lines[i] starts, with
    its message, every link chained after it (a traceback, or Ray's wrapping: a `ray::` line over a
    `ray.exceptions.` error) and the blank lines after it; None when lines[i] starts none, or only a later
    link of a chain whose start came before, or a chain with a link not read as one (not whole). Its error:
    the exception line of its last link that is a traceback (Ray's wrapping under it says less)."""
    if before.startswith(_CHAINING):
        return None
    k = error = _exception_line(src, i)
    while k is not None:
        while _message_goes_on(src[k + 1]):
            k += 1
        link = src.text_from(k + 1)
        if not src[link].startswith(_CHAINING):
            return link - 1, error
        j = src.text_from(link + 1)
        if src[j].rstrip() == _TRACEBACK:
            next_k = next_error = _exception_line(src, j)
        else:
            j += 1 if _RAY_TASK_HEADER.match(src[j]) else 0
            next_k, next_error = (j, error) if src[j].startswith("ray.exceptions.") else (None, error)
        if next_k is None:  # a link not read as one: not a whole traceback, printed as it is (never one line)
            return None
        k, error = next_k, next_error
    return None


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


def scan_lines(lines: list[str], before: str = "",
               final: bool = True) -> tuple[list[str], list, list[str], str]:
    """(the lines to print, the real tracebacks whole among them, the lines to hold back, the last line not
    blank before those held). Unless `final`, the lines from the first block that cannot be decided before
    more lines come (it reaches the last line) are held back, with the header line over it; `before`: the last
    line not blank that came before `lines` in the same stream. Each real traceback: (first, start, end,
    error), indices in the lines to print of its header line (its start when it has none), its "Traceback"
    line, the line after it, its error's line."""
    src, kept, tracebacks, i = _Lines(lines), [], [], 0
    header = None  # (index, `before` then) of the header line last kept: it goes with a traceback under it
    while i < len(lines):
        src.ran_out = False
        block = _noise_block(src, i, before)
        real = block is None and lines[i].startswith(_TRACEBACK)
        chain = _traceback_chain(src, i, before) if real else None
        if block is None and lines[i].startswith(_HEADERS):
            src.lines_after(i)  # a header waits for the line under it: the traceback it goes with
        under = int(header is not None and header[0] == i - 1)
        if src.ran_out and not final:
            if under:
                kept.pop()
                i, before = header
            return kept, tracebacks, lines[i:], before
        if chain is not None:
            end, error = chain
            tracebacks.append((len(kept) - under, len(kept), len(kept) + end + 1 - i, len(kept) + error - i))
            kept += lines[i:end + 1]
            before = next(line for line in reversed(lines[i:end + 1]) if line.strip())
            i = end + 1
        elif block is None:
            if not any(p.search(lines[i]) for p in NOISE_LINES):
                kept.append(lines[i])
                header = (i, before) if lines[i].startswith(_HEADERS) else header
            before = lines[i] if lines[i].strip() else before
            i += 1
        else:
            first, end = block
            kept += lines[i:first]  # (the crashed-shutdown line)
            before = next(line for line in reversed(lines[i:end + 1]) if line.strip())
            i = end + 1
    return kept, tracebacks, [], before


def one_line_per_repeat(kept: list[str], tracebacks: list, process: str, shown: dict) -> list[str]:
    """`kept`, with each traceback in it (see `scan_lines`) that `shown` holds (normalised traceback -> (process,
    header) that showed it) as one line naming that process and the error; the others whole, and remembered.
    A header line that differs from the one the first copy had stays over the line."""
    out, at = [], 0
    for first, start, end, error in tracebacks:
        body = kept[start:end]
        while not body[-1].strip():
            body.pop()  # its blank lines after: a copy cut before them is the same
        key = _VOLATILE.sub("_", "\n".join(body))
        header = _VOLATILE.sub("_", kept[first]) if first < start else None
        out += kept[at:first]
        if key in shown:
            shown_by, shown_header = shown[key]
            out += kept[first:start] if header != shown_header else []
            message = kept[error].strip()
            message = message if len(message) <= 160 else message[:157] + "..."
            out.append(f"{_OWN}the same traceback as {shown_by} printed above ({message})")
        else:
            if len(shown) >= _SHOWN_MAX:
                del shown[next(iter(shown))]
            shown[key] = (process, header)
            out += kept[first:end]
        at = end
    return out + kept[at:]


def filter_lines(lines: list[str]) -> list[str]:
    """`lines` without the noise lines and the noise tracebacks (repeats not collapsed: they need a console's
    memory, see output_filter._filtered)."""
    return scan_lines(lines)[0]
