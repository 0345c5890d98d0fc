"""Batches made ahead in a thread (behemoth/data/prefetch.py): the same batches in the same order, an error
raised where its batch was due, a bounded lead, a thread that stops when the consumer stops."""

import threading
import time

import pytest

from behemoth.data.prefetch import Chain, prefetched
from conftest import closable


class Source:
    """Yields 0..n-1, recording each item made and the thread that made it; fails at `fail_at`."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at, self.made, self.threads = n, fail_at, [], set()

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise OSError(f"cannot read batch {i}")
            self.made.append(i)
            self.threads.add(threading.current_thread().name)
            yield i


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_the_same_items_in_the_same_order(depth):
    source = Source(50)
    assert list(prefetched(source, depth)) == list(range(50))
    assert source.threads == ({threading.current_thread().name} if depth == 0 else {"behemoth-prefetch"})


def test_the_lead_is_bounded_by_the_depth():
    """After the first item is taken, the thread makes `depth` more (queued) and one it holds, then waits:
    seen in its stack (waiting for room in the queue, where it makes nothing), not by sleeping and hoping it
    ran meanwhile."""
    source = Source(100)
    it = prefetched(source, 2)
    assert next(it) == 0
    wait_for(lambda: waiting_for_room() and len(source.made) == 4)
    assert next(it) == 1
    wait_for(lambda: waiting_for_room() and len(source.made) == 5)
    it.close()


def waiting_for_room() -> bool:
    """The prefetch thread is blocked putting a made item into its full queue (a Condition's wait inside
    Queue.put, inside prefetch's _put): while it is there, it cannot make another."""
    import sys

    thread = next((t for t in threading.enumerate() if t.name == "behemoth-prefetch"), None)
    frame = sys._current_frames().get(thread.ident) if thread is not None else None
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names[:1] == ["wait"] and "put" in names and "_put" in names


def test_an_error_is_raised_where_its_batch_was_due():
    it = prefetched(Source(10, fail_at=3), 2)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OSError, match="cannot read batch 3"):
        next(it)


def test_closing_early_stops_the_thread():
    before = set(threading.enumerate())
    it = prefetched(Source(1000), 2)
    assert next(it) == 0
    it.close()
    assert not [t for t in threading.enumerate() if t not in before and t.name == "behemoth-prefetch"]


def test_an_epoch_left_early_by_the_feed_stops_its_thread():
    """The loop's feed groups micro-batches (worker/feed.py _grouped); leaving an epoch early closes the
    prefetching iterator inside it, so its thread ends then, not when the garbage collector gets to it."""
    from behemoth.worker.feed import _grouped

    before = set(threading.enumerate())
    inner = prefetched(Source(1000), 2)
    steps = _grouped(inner, 2)
    assert next(steps) == [0, 1]
    steps.close()
    assert not [t for t in threading.enumerate() if t not in before and t.name == "behemoth-prefetch"]
    assert inner.gi_frame is None  # closed


def test_chained_iterators_give_every_item_in_order_and_open_the_next_one_ahead():
    """A rank's windows (data/image/image_batches.py): the next iterator is opened, and its first item pulled, while the
    current one is consumed; the items are those of the iterators one after another. `all_opened` is set when the
    last one has been opened (what the next epoch's opening waits for, worker/feed.py), not before."""
    opened, events = [], threading.Event()

    def opener(i):
        def open_():
            opened.append(i)
            if i == 1:
                events.set()
            return iter(range(10 * i, 10 * i + 3))
        return open_

    it = Chain([opener(i) for i in range(3)])
    assert next(it) == 0
    assert events.wait(5)  # window 1 opened while window 0 is still being consumed
    assert opened == [0, 1]
    assert not it.all_opened.is_set()  # window 1 opened ahead, window 0 read: window 2 not yet
    assert [next(it) for _ in range(3)] == [1, 2, 10]
    assert it.all_opened.is_set()  # window 2 opened ahead as window 1 is read
    assert list(it) == [11, 12, 20, 21, 22]
    assert opened == [0, 1, 2]
    empty = Chain([])
    assert list(empty) == [] and empty.all_opened.is_set()
    one = Chain([opener(5)])
    assert not one.all_opened.is_set() and next(one) == 50 and one.all_opened.is_set()


def test_a_chain_dropped_early_closes_the_iterator_it_opened_ahead_at_once():
    """An epoch left early (a run stopped, a next epoch opened ahead and never trained): dropping the chain closes
    the window it opened ahead then, not when the cycle collector next runs (its Ray Dataset would go on decoding)."""
    import gc

    closed = []
    Closable = closable(closed)

    gc.disable()
    try:
        it = Chain([lambda: iter([1, 2]), lambda: Closable([3, 4])])
        assert next(it) == 1
        del it
        assert closed == [True]
    finally:
        gc.enable()


def test_chained_raises_an_opening_error_where_its_first_item_was_due_and_closes_what_it_opened():
    closed = []
    Closable = closable(closed)

    def broken():
        raise OSError("cannot open window 1")

    it = Chain([lambda: iter([1, 2]), broken])
    assert [next(it), next(it)] == [1, 2]
    with pytest.raises(OSError, match="cannot open window 1"):
        next(it)
    it = Chain([lambda: iter([1, 2]), lambda: Closable([3, 4])])
    assert next(it) == 1
    it.close()  # left early: the window opened ahead is closed, not left running
    assert closed == [True]
