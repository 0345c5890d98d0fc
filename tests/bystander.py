"""A Ray instance that is not the suite's, started beside it (`pytest --bystander-ray`, the full tier): the
suite must end with it alive. A test that stops Ray or kills processes by name (`ray stop`, a kill of every
`ray::RayTrainWorker` on the machine) would end it, as it would end a user's own cluster or another checkout's
suite.

The instance belongs to a process of its own (`python tests/bystander.py FOLDER`: `ray.init()` of a local
instance whose temp dir is FOLDER, nothing to do with the suite's), which says `ready`, then on a line
`check` runs a task on its instance and answers `alive` (or the error), and on `stop` shuts it down. It
leaves the suite's process tree at once (a double fork, as a daemon does): like a user's cluster, it is not a
descendant of the pytest process, so a test that kills only what it started cannot reach it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

READY_S = 60  # the first fork's parent exits at once


class Bystander:
    def __init__(self, process: subprocess.Popen):
        self.process = process

    @classmethod
    def start(cls, folder: Path) -> "Bystander":
        folder.mkdir(parents=True)
        process = subprocess.Popen([sys.executable, __file__, str(folder)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        line = process.stdout.readline().strip()
        process.wait(timeout=READY_S)  # the first fork's parent: it exits once its child is on its own
        if line != "ready":
            raise RuntimeError(f"the bystander Ray instance did not start: {line!r}")
        return cls(process)

    def check_and_stop(self) -> str | None:
        """None if the instance ran a task at the end of the suite; else what went wrong."""
        try:
            self.process.stdin.write("check\n")
            self.process.stdin.flush()
            answer = self.process.stdout.readline().strip()
            self.process.stdin.write("stop\n")
            self.process.stdin.flush()
            self.process.stdout.readline()  # "stopped", once its instance is shut down
        except OSError as e:
            return f"its process did not answer: {type(e).__name__}: {e}"
        return None if answer == "alive" else f"it no longer runs tasks ({answer or 'its process had died'})"


def _serve(folder: str) -> None:
    import os

    if os.fork() > 0:  # leave the suite's process tree: the parent ends, the child is re-parented to init
        os._exit(0)
    os.setsid()
    import ray

    os.environ.pop("RAY_ADDRESS", None)
    # A local instance of its own: 1 CPU, no dashboard, its temp dir given (not the suite's TMPDIR).
    ray.init(num_cpus=1, include_dashboard=False, logging_level="error", object_store_memory=100 * 2**20,
             _temp_dir=folder)

    @ray.remote
    def ping() -> str:
        return "alive"

    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            try:
                print(ray.get(ping.remote(), timeout=60), flush=True)
            except Exception as e:  # noqa: BLE001 - reported to the suite as the answer
                print(f"{type(e).__name__}: {e}".replace("\n", " "), flush=True)
        elif line.strip() == "stop":
            break
    ray.shutdown()
    print("stopped", flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1])
