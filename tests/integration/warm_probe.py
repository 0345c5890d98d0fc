"""A training loop that reports which processes its Ray tasks ran in, for the warm-up test.

Ray Train workers import this module by name (the tests' Ray instance puts tests/ on their PYTHONPATH).
"""

import json
import os
import sys


def where_tasks_run(loop_config: dict) -> None:
    """Each rank writes its runtime environment, and the processes a task and a Ray Data map ran in (with
    whether they had the image decode module imported before running it), to `<storage_path>/rank<r>.json`."""
    import ray.data
    import ray.train

    job = loop_config["job"]

    def seen(_=None):
        return os.getpid(), "behemoth.data.image.image_batches" in sys.modules

    task = ray.get(ray.remote(seen).options(num_cpus=job.data.cpus_per_task).remote())
    mapped = ray.data.range(4, override_num_blocks=1).map_batches(
        lambda b: {"pid": [seen()[0]] * len(b["id"]), "imported": [seen()[1]] * len(b["id"])},
        num_cpus=job.data.cpus_per_task).take(1)[0]
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(job.checkpoint.storage_path, f"rank{rank}.json"), "w") as f:
        json.dump({"runtime_env": dict(ray.get_runtime_context().runtime_env), "task": list(task),
                   "map": [int(mapped["pid"]), bool(mapped["imported"])]}, f)
