"""A run's own records, as JSON lines in its run folder (local, or under a URI such as s3://):

- metrics.jsonl: every report of every worker group (rank 0's metrics, with the invocation that ran it);
  a resumed run appends, so steps redone after a failure appear twice (`latest_per_step` keeps the survivor).
- timeline.jsonl: one line per event of the run's life: an invocation starting (with its start-up
  milestones) and ending, Ray Train's controller starting (its run id), a worker group starting (a restart,
  a resize) or failing, a killed driver's resource request withdrawn (driver/ray_cluster/stale_requests.py). The goodput
  account and the report read both.

Local files are appended to. Object stores have no append, and rewriting the whole file at every record
costs O(n^2) bytes over a run: under a URI each log is a folder of part objects, `<log>.parts/<time>-<writer>-
<n>.jsonl`, each holding the records one writer buffered since its last part. Readers concatenate the parts
in name order (the time is the part's first record's), after a whole `<log>` file an older behemoth wrote.
A writer PUTs a part when `flush_s` seconds have passed since its last one (a timer thread flushes a quiet
writer), at flush() (every checkpoint) and at close(): the bytes uploaded over a run are the log's size, and a
killed writer loses at most its last `flush_s` seconds of records.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid

from behemoth.storage.store import Store

METRICS, TIMELINE = "metrics.jsonl", "timeline.jsonl"
PARTS = ".parts"


class JsonlLog:
    def __init__(self, path: str, flush_s: float = 0.0, clock=time.monotonic):
        """`flush_s`: under a URI, how long records may wait in memory (0: every record is PUT at once).
        `clock`: seconds, monotonic (a test's own clock decides when the records are due, not the machine's
        speed)."""
        self.path, self.flush_s, self.clock = path, flush_s, clock
        self.store = Store(path)
        self._buffer: list[str] = []
        self._first_ns = 0  # the first buffered record's time: the next part's name
        self._writer, self._parts = uuid.uuid4().hex[:8], 0
        self._lock = threading.Lock()
        self._last_put = self.clock()
        self._stop: threading.Event | None = None  # the timer thread's, once started
        self._failed = False

    def append(self, record: dict) -> None:
        line = json.dumps(record, default=_plain) + "\n"
        if self.store.is_local:
            self.store.append_text(line)
            return
        with self._lock:
            if not self._buffer:
                self._first_ns = time.time_ns()
            self._buffer.append(line)
            if self.clock() - self._last_put >= self.flush_s:
                self._put_part(quiet=self.flush_s > 0)  # an unbuffered writer's caller hears of a failure
            elif self._stop is None:
                self._stop = threading.Event()
                threading.Thread(target=self._flush_quiet, name="behemoth-records", daemon=True).start()

    def flush(self) -> None:
        """PUT what is buffered now (a checkpoint's records are durable with it)."""
        with self._lock:
            self._put_part()

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        self.flush()

    def _flush_quiet(self) -> None:
        while not self._stop.wait(self.flush_s):
            with self._lock:
                if self.clock() - self._last_put >= self.flush_s:
                    self._put_part(quiet=True)

    def _put_part(self, quiet: bool = False) -> None:
        if not self._buffer:
            return
        name = f"{self._first_ns:020d}-{self._writer}-{self._parts:06d}.jsonl"
        try:  # the folder is made once (on an object store, each making is a PUT of a marker object)
            write_bytes(f"{self.path}{PARTS}/{name}", "".join(self._buffer).encode(), make_folder=self._parts == 0)
        except Exception as e:  # noqa: BLE001 - kept and tried again at the next flush
            if not quiet:
                raise
            if not self._failed:
                print(f"[behemoth] WARNING: could not write {self.path} ({type(e).__name__}: {e}); its records are "
                      f"kept in memory and written again at the next flush", flush=True)
            self._failed = True
            return
        self._buffer.clear()
        self._parts += 1
        self._last_put = self.clock()


def exists(path: str) -> bool:
    """Whether a log has been written (as a file, or under a URI as parts): asked of the store, not read (a
    whole metrics log read to learn it is there, then read again by its reader)."""
    return Store(path).is_file() or bool(_part_names(path))


def read_text(path: str) -> str | None:
    """A file's text, local or under a URI; None if there is none."""
    return Store(path).read_text()


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode())


def write_bytes(path: str, data: bytes, make_folder: bool = True) -> None:
    """Write (replace) a file, local or under a URI, creating its folder (unless known to be there)."""
    Store(path).write_bytes(data, make_folder)


def read_jsonl(path: str) -> list[dict]:
    """The records of a log ([] if there is none): the file, then under a URI its parts in order. A line that
    is no record is skipped, as a line cut short by a kill is: not UTF-8, not JSON, not a JSON object, or a
    step or time that is not a number (a disk fault or a hand edit; the readers do arithmetic on those)."""
    lines = _lines(path)
    if not Store(path).is_local:  # an object store's log is its parts
        lines += [line for name in _part_names(path) for line in _lines(f"{path}{PARTS}/{name}")]
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # (RecursionError: brackets nested past Python's limit)
            continue
        if _is_record(record):
            records.append(record)
    return records


def _lines(path: str) -> list[str]:
    """A file's lines ([] if there is none); a line that is not UTF-8 is dropped, not the whole file."""
    store = Store(path)
    try:
        return (store.read_text() or "").splitlines()
    except UnicodeDecodeError:
        pass
    lines = []
    for raw in store.read_bytes().splitlines():
        try:
            lines.append(raw.decode())
        except UnicodeDecodeError:
            continue
    return lines


_INTEGERS = ("step", "resumed_from_step")  # counted and compared: latest_per_step, goodput
_NUMBERS = ("wall_time", "time", "epoch", "world_size")  # subtracted, sorted, plotted


def _is_record(record) -> bool:
    if not isinstance(record, dict):
        return False
    number = (int, float)
    return (all(isinstance(record[k], int) and not isinstance(record[k], bool) for k in _INTEGERS if k in record)
            and all(isinstance(record[k], number) and not isinstance(record[k], bool) and math.isfinite(record[k])
                    for k in _NUMBERS if k in record))


def _part_names(path: str) -> list[str]:
    store = Store(f"{path}{PARTS}")
    return [] if store.is_local else store.list_files(".jsonl")


def latest_per_step(reports: list[dict]) -> list[dict]:
    """The reports that survived: a step trained again after a restore replaces the earlier record of it
    (and of every later step of the group that was lost); a report of a step its group did not train (a finished
    run's rerun) is added to that step's record. Ordered by step."""
    kept: dict[int, dict] = {}
    groups = set()
    for r in reports:
        if "step" not in r:
            continue
        if r.get("group_id") not in groups:  # a new worker group: what earlier groups did after its start is lost
            groups.add(r.get("group_id"))
            start = r.get("resumed_from_step", r["step"] - 1)
            for step in [s for s in kept if s > start]:
                del kept[step]
        if r["step"] <= r.get("resumed_from_step", -1) and r["step"] in kept:
            # a step its group did not train: a finished run's rerun evaluating its final weights, added to
            # the step's record (replacing it left the report without its training figures and total_steps)
            kept[r["step"]] = {**kept[r["step"]], **r}
        else:
            kept[r["step"]] = r
    return [kept[s] for s in sorted(kept)]


def _plain(value):
    """JSON for what reports may hold besides plain numbers (numpy scalars)."""
    try:
        return value.item()
    except AttributeError:
        return str(value)
