"""Batches made ahead of the training step, in a background thread; iterators opened ahead, one after another.

A batch read from a decoded cache is prepared in the training process (gather rows, crop, flip, normalise: a
few milliseconds for 64 small images). Made in the training thread it adds to every step; made here it
overlaps the step, whose torch kernels release the GIL. The order is the iterable's: a thread only moves
when a batch is made, never which one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

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


class Chain:
    """The items of `openers[0]()`, then of `openers[1]()`, ...: while one iterator is consumed, the next is
    opened and its first item pulled in a daemon thread (a Ray Dataset starts executing at its first item). An
    error opening one is raised here, where its first item was due. Closing early (or dropping it) closes the one
    opened ahead.

    `all_opened` is set once the chain has opened its last iterator (opened ahead, while the one before is read):
    nothing of it is left to start, so whatever comes after it (the next epoch's pipeline, worker/feed.py) is
    started then. At the chain's end that keeps the next part's work queued behind its own, as within it: a
    short last part that is already done when it is read would leave the CPUs without work until the next
    chain's first task starts."""

    def __init__(self, openers: list[Callable[[], Iterator]]):
        self.all_opened = threading.Event()
        # a generator of its own (not a method): it holds no reference to the Chain, so dropping the Chain frees
        # it at once and its `finally` closes the iterator opened ahead without waiting for the cycle collector
        self._items = _chained(openers, self.all_opened)

    def __iter__(self) -> Chain:
        return self

    def __next__(self):
        return next(self._items)

    def close(self) -> None:
        self._items.close()


def _chained(openers: list[Callable[[], Iterator]], all_opened: threading.Event) -> Iterator:
    ahead = _open(openers, 0, all_opened)
    try:
        for i in range(len(openers)):
            current, ahead = ahead.iterator(), _open(openers, i + 1, all_opened)
            yield from current
    finally:
        if ahead is not None:
            ahead.close()


def _open(openers: list[Callable[[], Iterator]], i: int, all_opened: threading.Event) -> OpenedAhead | None:
    ahead = OpenedAhead(openers[i]) if i < len(openers) else None
    if i >= len(openers) - 1:
        all_opened.set()
    return ahead


class OpenedAhead:
    """An iterator opened by `open_fn` in a daemon thread that also pulls its first item (`seconds`: how long
    that took). `iterator()` waits for it and yields every item; an error is raised there."""

    _END = object()

    def __init__(self, open_fn: Callable[[], Iterator], name: str = "behemoth-open-ahead"):
        self._box: dict = {}
        self._began = time.monotonic()
        self._thread = threading.Thread(target=self._open, args=(open_fn,), daemon=True, name=name)
        self._thread.start()

    def _open(self, open_fn) -> None:
        try:
            it = open_fn()
            self._box["first"], self._box["it"] = next(it, self._END), it
            self._box["seconds"] = time.monotonic() - self._began
        except BaseException as e:  # noqa: BLE001 - raised in the consumer's thread where the item was due
            self._box["error"] = e

    @property
    def seconds(self) -> float:
        """From the start of the opening to its first item (after `iterator()` has returned one)."""
        return self._box.get("seconds", 0.0)

    def iterator(self) -> Iterator:
        self._thread.join()
        if "error" in self._box:
            raise self._box["error"]
        if self._box["first"] is not self._END:
            yield self._box["first"]
            yield from self._box["it"]

    def close(self) -> None:
        self._thread.join()
        close = getattr(self._box.get("it"), "close", None)
        if close is not None:
            close()


def to_device_ahead(batches: Iterable[dict], device, host_keys: tuple[str, ...] = ()) -> Iterator[dict]:
    """Each batch's tensors on `device`, the copy of the next batch issued before this one is yielded. On a
    GPU the host tensors are pinned first, so the copies are asynchronous (a pageable copy makes the host wait
    for the device) and the next batch's overlaps this one's step; on the CPU nothing is copied. `host_keys`
    stay on the host (sample ids, which only the ledger reads there)."""
    if device.type == "cpu":
        yield from batches
        return
    pending = None
    for batch in batches:
        ready = {key: value if key in host_keys else value.pin_memory().to(device, non_blocking=True)
                 for key, value in batch.items()}
        if pending is not None:
            yield pending
        pending = ready
    if pending is not None:
        yield pending
