"""The run lock's fence in Ray Train's workers: no checkpoint is uploaded into, or handed to Ray Train for
registration in, a folder whose lease this run's driver no longer holds (storage/runlock.py).

Ray Train registers a checkpoint, writes its snapshot and applies retention (CheckpointConfig.num_to_keep,
deleting older checkpoints) in its controller, in the first of its report callbacks, as soon as it has the
workers' report: no callback of ours runs before that there. The step before it is the worker's checkpoint
transfer, which Ray Train wraps in its TrainContextCallback.on_checkpoint_transfer (in the upload thread with
checkpoint.async_save): the lease is checked on entry (nothing written) and on exit (the report is not queued
for registration). These run in the workers, not in the driver's process: a driver stopped by SIGSTOP keeps
its run training, and its heartbeat stops, so another driver may take the folder over meanwhile.

A lost lease raises LeaseLostError, which behemoth's failure policy ends the run on at once (not retried).
The window left is from the exit check to the controller's registration: the time Ray Train takes to poll the
report (about a second), against a lease that has gone EXPIRY_S without a heartbeat before it is taken over.
"""

from __future__ import annotations

from contextlib import contextmanager

from behemoth.ray_internals.train_v2 import TrainContextCallback
from behemoth.storage.runlock import Fence


class LeaseFenceCallback(TrainContextCallback):
    def __init__(self, fence: Fence):
        self.fence = fence

    @contextmanager
    def on_checkpoint_transfer(self):
        self.fence.check("writing a checkpoint into it")
        yield
        # the checkpoint is written but not yet registered: its registration would apply retention
        self.fence.check("Ray Train registers the checkpoint it just wrote and applies checkpoint.keep")
