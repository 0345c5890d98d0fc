"""A run's own records, as JSON lines in its run folder (local, or under a URI such as s3://):

- metrics.jsonl: every report of every worker group (rank 0's metrics, with the invocation that ran it);
  a resumed run appends, so steps redone after a failure appear twice (`latest_per_step` keeps the survivor).
- timeline.jsonl: one line per event of the run's life: an invocation starting (with its start-up
  milestones) and ending, Ray Train's controller starting (its run id), a worker group starting (a restart,
  a resize) or failing, a killed driver's resource request withdrawn (driver/stale_requests.py). The goodput
  account and the report read both.

Local files are appended to. Object stores have no append: a URI's file is read once and rewritten whole on
every write (one writer at a time: the run lock's holder and the Ray Train controller it starts).
"""

from __future__ import annotations

import json
import os

from behemoth import paths

METRICS, TIMELINE = "metrics.jsonl", "timeline.jsonl"


class JsonlLog:
    def __init__(self, path: str):
        self.path = path
        self._lines: list[str] | None = None  # a URI's current content, read on first write

    def append(self, record: dict) -> None:
        line = json.dumps(record, default=_plain) + "\n"
        if not paths.is_uri(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
            return
        if self._lines is None:
            self._lines = [f"{json.dumps(r)}\n" for r in read_jsonl(self.path)]
        self._lines.append(line)
        write_text(self.path, "".join(self._lines))


def read_text(path: str) -> str | None:
    """A file's text, local or under a URI; None if there is none."""
    if paths.is_uri(path):
        import pyarrow.fs

        fs, where = pyarrow.fs.FileSystem.from_uri(path)
        if fs.get_file_info(where).type == pyarrow.fs.FileType.NotFound:
            return None
        with fs.open_input_stream(where) as f:
            return f.read().decode()
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode())


def write_bytes(path: str, data: bytes) -> None:
    """Write (replace) a file, local or under a URI, creating its folder."""
    if paths.is_uri(path):
        import pyarrow.fs

        fs, where = pyarrow.fs.FileSystem.from_uri(path)
        fs.create_dir(where.rpartition("/")[0], recursive=True)
        with fs.open_output_stream(where) as f:
            f.write(data)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file ([] if there is none); a line cut short by a kill is skipped."""
    text = read_text(path) or ""
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def latest_per_step(reports: list[dict]) -> list[dict]:
    """The reports that survived: a step trained again after a restore replaces the earlier record of it
    (and of every later step of the group that was lost). Ordered by step."""
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
        kept[r["step"]] = r
    return [kept[s] for s in sorted(kept)]


def _plain(value):
    """JSON for what reports may hold besides plain numbers (numpy scalars)."""
    try:
        return value.item()
    except AttributeError:
        return str(value)
