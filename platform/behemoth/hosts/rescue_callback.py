"""The rescue checkpoint's hook in Ray Train's workers (checkpoints/rescue.py): when Ray Train stops a worker
group (a worker lost, an elastic resize, the run stopped), it first calls each live worker's shutdown hooks and
gives them up to 5 s (WorkerGroup shutdown: `_shutdown_workers(patience_s=5)`) before it kills the workers. A
worker whose loop still trains writes its state there; one whose training thread is writing it already is waited
for. A Ray Train callback that runs in the workers, so it lives with their host."""

from __future__ import annotations

from behemoth.ray_internals.train_v2 import WorkerCallback


class RescueCallback(WorkerCallback):
    def before_worker_shutdown(self):
        from behemoth import hosts

        hosts.stopping()  # (the loop's rescue registered itself: hosts.when_stopped)
