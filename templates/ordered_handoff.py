"""Injected runtime: the hand-off of several prefetch workers (feature `train_prefetch`).

Rendered after `templates/prefetch_loader.py` into scripts whose loader may run
`TRAIN_PREFETCH_WORKERS` > 1 threads (the ShuffledSequenceLoader family), and
registered in `_ORDERED_WORKER`, where `_PrefetchLoader` finds it; other scripts
carry no copy of it.
"""

import threading
import time

from templates.prefetch_loader import _EMPTY, _ORDERED_WORKER, _POLL_S, _Built, _snapshot, _Worker
from templates.shuffled_assembly import _shuffled_gather, _shuffled_plan
from templates.staging import _stage


class _OrderedHandoff:
    """Numbered items from several producers, taken by one consumer in number order.

    A producer `claim`s a slot before it builds an item (at most `slots` items built
    and not taken) and `deliver`s it under its number; the consumer takes item 0, 1,
    2, ... (`get`), waiting when the next one is still being built, and frees a slot
    with `room()` when it chooses, which wakes at most one producer. Items wait in a
    dict; delivering and taking are single dict operations under the GIL. Signals are
    locks used as binary semaphores (released = "look again"): the consumer states how
    many items in a row it waits for (`_want`) before it looks, and a producer signals
    only such a consumer, so none is missed and a stale one costs one extra look.
    """

    _NOBODY = float("inf")

    def __init__(self, depth, slots):
        self.depth = depth
        self._done = {}
        self._next = 0  # number of the next item to take
        self._free = threading.Semaphore(slots)
        self._slots = slots
        self._want = self._NOBODY
        self._filled = threading.Lock()
        self._filled.acquire()

    def claim(self, stop):
        """Wait for a free slot; False if `stop` (an Event) was set first."""
        while not stop.is_set():
            if self._free.acquire(timeout=_POLL_S):
                return not stop.is_set()
        return False

    def deliver(self, seq, item, stop):
        """Item number `seq`, built in the slot its producer claimed."""
        self._done[seq] = item
        if self._ready() >= self._want:
            _signal(self._filled)

    def _ready(self):
        """How many items, from the next one on, are there in a row."""
        n = 0
        while self._next + n in self._done:
            n += 1
        return n

    def get(self, timeout):
        """The next item in order, or `_EMPTY` if it did not come within `timeout` s. Does not free its slot."""
        if self._next not in self._done and not self._wait_for(1, timeout):
            return _EMPTY
        item = self._done.pop(self._next)
        self._next += 1
        return item

    def wait_full(self, timeout):
        """Block until `depth` items in a row are ready; False after `timeout` s."""
        return self._wait_for(self.depth, timeout)

    def _wait_for(self, count, timeout):
        deadline = time.monotonic() + timeout
        self._want = count
        try:
            while self._ready() < count:
                left = deadline - time.monotonic()
                if left <= 0 or not self._filled.acquire(timeout=left):
                    return self._ready() >= count
            return True
        finally:
            self._want = self._NOBODY

    def room(self):
        """Tell the producers that an item was taken (frees its slot)."""
        self._free.release()

    def clear(self):
        """Drop every item and wake every producer waiting for a slot (to see its stop)."""
        self._done.clear()
        self._free.release(self._slots)

    def qsize(self):
        return self._ready()

    def empty(self):
        return self._next not in self._done

    def full(self):
        return self._ready() >= self.depth


def _signal(lock):
    try:
        lock.release()
    except RuntimeError:
        pass  # already signalled


class _OrderedWorker(_Worker):
    """`workers` daemon threads: under `plan_lock`, number and plan a batch
    (`_shuffled_plan` or `next_batch`, the loader advancing in call order); outside it,
    finish it (`_shuffled_gather` or `_stage`) and deliver it under its number to an
    `_OrderedHandoff`, which hands batches out in number order."""

    def __init__(self, loader, args, depth, pin, rollback=False, host_copy=True, workers=2, assembly=None):
        _Worker.__init__(self, loader, args, depth, pin, rollback=rollback, host_copy=host_copy, assembly=assembly)
        self.queue = _OrderedHandoff(depth, depth + workers)
        self.plan_lock = threading.Lock()
        self.planned = 0  # sequence number of the next plan
        self.failed = False
        self.threads = [self.thread] + [threading.Thread(target=self._run, name="train-prefetch", daemon=True) for _ in range(workers - 1)]

    def _run(self):
        while self.queue.claim(self.stop):
            item = None
            with self.plan_lock:
                if self.failed or self.stop.is_set():
                    return
                seq = self.planned
                self.planned += 1
                try:
                    before = _snapshot(self.loader) if self.rollback else None
                    plan = _shuffled_plan(self.loader, self.assembly, *self.args) if self.assembly is not None else self.loader.next_batch(*self.args)
                except BaseException as error:  # handed to the caller, which re-raises it
                    self.failed = True
                    item = error
            if item is None:
                try:
                    item = _shuffled_gather(plan, self.pin) if self.assembly is not None else _stage(plan, self.pin, self.host_copy)
                    if self.rollback:
                        item = _Built(before, item)
                except BaseException as error:
                    self.failed = True
                    item = error
                plan = None
            self.queue.deliver(seq, item, self.stop)
            if isinstance(item, BaseException):
                return


_ORDERED_WORKER.append(_OrderedWorker)
