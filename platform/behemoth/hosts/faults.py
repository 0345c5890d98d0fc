"""Fault injection for the failure tests, never set in real runs: each hook reads one environment variable
that a test puts into the training workers' environment, and does nothing when it is unset. All of them act
on one run only (its name, or a pattern of names, is the first field), so the other runs of a test cluster are
untouched.

- BEHEMOTH_FAULT_KILL_IN_UPLOAD=RUN:STEP:MARKER SIGKILLs the process uploading the checkpoint of STEP after its
  files reached the run folder and before its manifest did, once: the marker file records it
  (tests/integration/test_fault_tolerance.py, test_train_lm.py).
- BEHEMOTH_FAULT_DISK_FULL=RUN:STEP makes every checkpoint from STEP on fail after its first file with the OSError
  a full disk raises (ENOSPC): a disk that fills stays full, for a rescue checkpoint written as the failed run's
  group stops too (tests/integration/test_train_images.py).
- BEHEMOTH_FAULT_KILL_AT_STEP=RUN:STEP:MARKER SIGKILLs rank 0 once, 1 s after STEP and its report (Ray Train's
  controller collects a report when it next polls, every 0.2 s: a kill right after it takes the last report or
  two with it, and the logged steps the worker had not handed to Ray Train yet: worker/reporting.py), and writes to the marker the seconds its worker group had trained and waited for data by then
  (tests/integration/test_tracking.py: the goodput account's lost work against a kill at a known step).
- BEHEMOTH_FAULT_RAISE_AT_STEP=RUN:STEP makes rank 0 raise a RuntimeError after STEP, every time (a sweep's
  trial that fails while the others go on: tests/integration/test_lanes.py).
- BEHEMOTH_FAULT_SLOW_WORLD=RUN:WORLD:SECONDS[:UNTIL[:FROM]] makes every step (from step FROM up to step UNTIL)
  trained by a worker group of WORLD workers take SECONDS longer: the elastic test's shrunk group cannot finish
  the run before Ray Train grows it back, however fast the machine trains (test_fault_tolerance.py, R6); the spot
  notice's deadline lands between two checkpoints (R7, R8).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

FAULT_ENV = "BEHEMOTH_FAULT_KILL_IN_UPLOAD"
DISK_FULL_ENV = "BEHEMOTH_FAULT_DISK_FULL"
SLOW_WORLD_ENV = "BEHEMOTH_FAULT_SLOW_WORLD"
KILL_AT_STEP_ENV = "BEHEMOTH_FAULT_KILL_AT_STEP"
RAISE_AT_STEP_ENV = "BEHEMOTH_FAULT_RAISE_AT_STEP"


def _spec_for_this_run(env: str) -> list[str] | None:
    """The fields after the run name, when `env` is set for the run this worker trains (the name may be a
    pattern: a sweep's trials are named by ids a test does not know beforehand, `*_00001` is the second)."""
    spec = os.environ.get(env)
    if not spec:
        return None
    from fnmatch import fnmatchcase

    from behemoth import hosts

    run, rest = spec.split(":", 1)
    return rest.split(":") if fnmatchcase(hosts.current().run_name, run) else None


def kill_in_upload(step: int) -> None:
    fields = _spec_for_this_run(FAULT_ENV)
    if fields is not None:
        at, marker = fields[0], ":".join(fields[1:])
        if int(at) == step and not os.path.exists(marker):
            Path(marker).write_text(f"killed pid {os.getpid()} while uploading step {step}\n")
            os.kill(os.getpid(), 9)


def at_step(step: int, rank: int, totals: dict) -> None:
    """The hooks that act after a step: KILL_AT_STEP's kill and RAISE_AT_STEP's error. `totals`: rank 0's
    PhaseClock totals (seconds per phase since its loop started)."""
    kill_at_step(step, rank, totals)
    fields = _spec_for_this_run(RAISE_AT_STEP_ENV)
    if fields is not None and rank == 0 and int(fields[0]) == step:
        raise RuntimeError(f"injected by {RAISE_AT_STEP_ENV} after step {step}")


def kill_at_step(step: int, rank: int, totals: dict) -> None:
    fields = _spec_for_this_run(KILL_AT_STEP_ENV)
    if fields is not None and rank == 0:
        at, marker = fields[0], ":".join(fields[1:])
        if int(at) == step and not os.path.exists(marker):
            import json

            time.sleep(1.0)
            Path(marker).write_text(json.dumps({"step": step, "pid": os.getpid(), "killed_at": time.time(),
                                                "step_s": totals["step"], "data_wait_s": totals["data_wait"]}))
            os.kill(os.getpid(), 9)


def disk_full(step: int, path: Path) -> None:
    fields = _spec_for_this_run(DISK_FULL_ENV)
    if fields is not None and step >= int(fields[0]):
        import errno

        raise OSError(errno.ENOSPC, f"No space left on device (injected by {DISK_FULL_ENV})", str(path))


def slow_step(world: int, step: int) -> None:
    fields = _spec_for_this_run(SLOW_WORLD_ENV)
    if (fields is not None and int(fields[0]) == world and (len(fields) < 3 or step <= int(fields[2]))
            and (len(fields) < 4 or step >= int(fields[3]))):
        time.sleep(float(fields[1]))
