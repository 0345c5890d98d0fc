"""Batches made ahead of the training step, in a background thread.

A batch read from a decoded cache is prepared in the training process (gather rows, crop, flip, normalise: a
few milliseconds for 64 small images). Made in the training thread it adds to every step; made here it
overlaps the step, whose torch kernels release the GIL. The order is the iterable's: a thread only moves
when a batch is made, never which one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

_END = object()


def prefetched(batches: Iterable, depth: int) -> Iterator:
    """`batches` in order, made ahead by a daemon thread: `depth` ready, and the next one being made (depth 0:
    made on demand, here). An error raised while making one is raised here, where that batch would have been
    yielded. Closing the iterator early (a run that stops mid-epoch) stops the thread at its next batch."""
    if depth <= 0:
        yield from batches
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def make() -> None:
        try:
            for batch in batches:
                if not _put(ready, (batch, None), stop):
                    return
            _put(ready, (_END, None), stop)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised where its batch was due
            _put(ready, (_END, e), stop)

    thread = threading.Thread(target=make, daemon=True, name="behemoth-prefetch")
    thread.start()
    try:
        while True:
            batch, error = ready.get()
            if error is not None:
                raise error
            if batch is _END:
                return
            yield batch
    finally:
        stop.set()
        if thread is not threading.current_thread():  # the garbage collector may close it from the thread itself
            thread.join()


def _put(ready: queue.Queue, item, stop: threading.Event) -> bool:
    """Put `item` once there is room; False when the consumer stopped first."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
