"""Injected runtime: train-batch prefetch on a background thread (feature `train_prefetch`).

`patch-prefetch` renders the body of this module into a training script after the
body of `templates/copy_stream.py`, and rewrites each construction of the training
loader, e.g.

    train_loader = DistributedTokenLoader(args.train_files, rank, world_size, device)

into

    train_loader = _make_train_loader(
        lambda device: DistributedTokenLoader(args.train_files, rank, world_size, device),
        device, prefetch=..., queue_depth=..., copy_stream=...)

The script's own loader class is not changed. The wrapper builds it with
`device=cpu`, so its `next_batch` returns host tensors; a daemon thread calls it
ahead of the training loop and stages each batch in pinned memory (a bounded queue
of `queue_depth` batches); `next_batch` hands the batches out in order and does the
H2D copy (on the copy stream when enabled).

Exactness: the worker calls `next_batch` with the arguments of the caller's latest
call, in the same order the original would, on the same loader state. The caller's
arguments are checked on every call; when they differ from the ones the queued
batches were built with, the queued batches are thrown away and the loader is
rebuilt and replayed to exactly where the caller is, so a changed argument costs
time, never different data. An argument that the loader only uses as the trailing
dimension of `.reshape(-1, n)` (the sequence length in the TokenStream family, where
the stream advances by a span that does not depend on it) is left out of that check
and applied when the batch is handed out.

Several workers (`TRAIN_PREFETCH_WORKERS`): each batch is planned under one lock in
call order (the loader advances), finished on any of the threads, and taken by its
sequence number (`_OrderedHandoff`, templates/ordered_handoff.py).
"""

import atexit
import collections
import copy
import threading
import time
import traceback
import warnings

import torch

from templates.copy_stream import _h2d

# One live prefetcher per loader variable: building a new one shuts the old one down.
_live_prefetchers = {}
# Every running worker, stopped at interpreter exit: a daemon thread still inside a
# torch op while Python finalizes aborts the process.
_running_workers = set()
# How often a blocked caller or worker looks at the stop event (s).
_POLL_S = 0.1
# [_OrderedHandoff] where templates/ordered_handoff.py is injected (several workers).
_ORDERED_HANDOFF = []


def _stop_workers_at_exit():
    for worker in list(_running_workers):
        worker.stop.set()
        worker.queue.clear()
    # Long enough for a batch or a shard load in progress, short enough that Ctrl-C with
    # a worker stuck in a read still ends the process promptly.
    deadline = time.monotonic() + 3.0
    for worker in list(_running_workers):
        for thread in worker.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


atexit.register(_stop_workers_at_exit)


def _make_train_loader(make_loader, device, prefetch=True, queue_depth=2, copy_stream=True, reshape_arg=None, slot="train_loader", rollback=False, host_copy=True, workers=1, assembly=None):
    """Build the training loader, prefetching when `prefetch` is on.

    Takes: make_loader: `device -> loader`, the script's own construction expression;
    device: where batches must end up; prefetch: bool (`TRAIN_PREFETCH`); queue_depth:
    int >= 1, batches built ahead (`TRAIN_PREFETCH_QUEUE`); copy_stream: bool
    (`TRAIN_COPY_STREAM`); reshape_arg: index of a `next_batch` argument used only as
    the trailing dimension of `.reshape(-1, n)`, or None; slot: the variable name,
    so that a rebuild (the warm-up reset) shuts the previous worker down first;
    rollback: snapshot the loader before each batch built ahead, so that a changed
    argument discards the queued batches by restoring a snapshot instead of a replay
    (only for loaders that never change an array in place; the survey checks that);
    host_copy: copy each batch built ahead even when it is not pinned, for loaders
    that may later write into an array a returned batch views (False when the survey
    finds no such write: the batch is handed out as built); workers: threads
    building batches (`TRAIN_PREFETCH_WORKERS`); assembly: None (`next_batch` in the
    worker) or `_ShuffledAssembly` (`TRAIN_PREFETCH_NUMPY`): `plan(loader, args)`
    advances the loader as `next_batch(*args)`; `gather(plan, pin)` builds its batch.
    Returns: `make_loader(device)` itself when prefetch is off (the original
    behaviour), else a `_PrefetchLoader`.
    """
    _free_slot(slot)
    if not prefetch:
        return make_loader(device)
    loader = _PrefetchLoader(make_loader, device, queue_depth, copy_stream, reshape_arg, rollback, host_copy, workers, assembly)
    _live_prefetchers[slot] = loader
    return loader


def _free_slot(slot):
    """Shut down the prefetcher built before for the variable `slot`, if any."""
    old = _live_prefetchers.pop(slot, None)
    if old is not None:
        old.shutdown()


class _PrefetchLoader:
    """A training loader whose `next_batch` batches are built ahead on a daemon thread.

    `next_batch(*args)` returns what the wrapped loader's `next_batch(*args)` returns
    (e.g. `x, y: int64 [batch, seq_len]` on `device`), bit for bit and in order.
    A worker's exception is re-raised in the caller with the worker's traceback.
    """

    def __init__(self, make_loader, device, queue_depth=2, copy_stream=True, reshape_arg=None, rollback=False, host_copy=True, workers=1, assembly=None):
        self._make_loader = make_loader
        self._workers = max(1, int(workers))
        self._assembly = assembly
        self._device = torch.device(device)
        self._pin = self._device.type == "cuda" and torch.cuda.is_available()
        self._copy_stream = copy_stream
        self._reshape_arg = reshape_arg
        self._rollback = rollback
        self._host_copy = host_copy
        self._depth = max(1, int(queue_depth))
        self._loader = make_loader(torch.device("cpu"))
        self._handed_out = []  # arguments of every batch handed out, for replay
        self._worker = None
        self._worker_args = None  # the arguments the worker builds with
        self._on_host = self._device.type == "cpu"
        self._settled = False
        self._ahead = False  # the loader has built batches nobody took (after a shutdown)

    def next_batch(self, *args):
        # The common case, a batch built with these arguments waiting in the queue, runs
        # in as few Python frames as possible: this wait is on the training loop's path.
        worker = self._worker
        if worker is None or args != self._worker_args:
            if self._settled:
                # The caller has used the loader directly: no more building ahead.
                return self._to_device(_stage(self._loader.next_batch(*args), self._pin, copy=False), args)
            self._follow(args)
            worker = self._worker
        item = worker.queue.get(_POLL_S)
        if item.__class__ is not _Built:
            item = self._checked(item)
        self._handed_out.append(args)
        batch = item.batch if self._on_host and args == self._worker_args else self._to_device(item.batch, args)
        # Last: the woken worker competes for the GIL, and a torch call above (which
        # releases it) would otherwise let the worker's Python run inside this call.
        worker.queue.room()
        return batch

    def _follow(self, args):
        """Start the worker, or make it build with the caller's new arguments."""
        if self._worker is None:
            if self._ahead:
                self._replay()
            self._start(args)
        elif self._key(args) != self._key(self._worker_args):
            self._resync(args)
        # Else only the reshape argument changed: the hand-out reshapes.

    def shutdown(self):
        """Stop the worker and drop queued batches; returns within about `_POLL_S` s.

        The loader has then run ahead of the caller; a later `next_batch` replays it
        to the caller's position first.
        """
        worker, self._worker = self._worker, None
        if worker is None:
            return
        self._ahead = True
        _stop_worker(worker)

    close = shutdown

    def __getattr__(self, name):
        # Anything but next_batch (e.g. `train_loader.stream.take(n)` for calibration)
        # must see the loader exactly where the caller's batches left it.
        if name.startswith("_"):
            raise AttributeError(name)
        self._settle()
        return getattr(self._loader, name)

    def _settle(self):
        """Bring the wrapped loader to the state the original would be in now.

        The worker has built batches ahead; rebuild the loader and replay the batches
        handed out. Costs one pass over them, once. After this the caller may change
        the loader directly, so `next_batch` stops building ahead.
        """
        if self._settled:
            return
        self.shutdown()
        self._replay()
        self._settled = True

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    def _key(self, args):
        if self._reshape_arg is None or self._reshape_arg >= len(args):
            return args
        return args[: self._reshape_arg] + args[self._reshape_arg + 1 :]

    def _start(self, args):
        worker = _Worker(self._loader, args, self._depth, self._pin, self._rollback, self._host_copy, self._workers, self._assembly)
        self._worker, self._worker_args = worker, args
        _start_worker(worker)

    def _resync(self, args):
        # Batches queued with other arguments are wrong for this call. With snapshots,
        # the next queued batch carries the loader state from just before it was built,
        # which is where the caller is: restore it. Else rebuild the loader and replay
        # every batch handed out so far. Then speculate anew.
        if self._rollback:
            head = self._take_built()
            self.shutdown()
            self._loader, self._ahead = head.before, False
            self._start(args)
            return
        message = f"prefetch: next_batch arguments changed to {args}; replaying {len(self._handed_out)} batches to stay exact"
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.shutdown()
        self._replay()
        self._start(args)

    def _replay(self):
        self._loader = self._make_loader(torch.device("cpu"))
        for old_args in self._handed_out:
            if self._assembly is not None:
                self._assembly.plan(self._loader, old_args)
            else:
                self._loader.next_batch(*old_args)
        self._ahead = False

    def _take_built(self):
        return self._checked(_EMPTY)

    def _checked(self, item):
        """`item` from the queue (`_EMPTY`: none yet, wait for it) as a `_Built`; a worker's error is re-raised."""
        if item is _EMPTY:
            item = _next_built(self._worker)
        if isinstance(item, _WorkerError):
            self.shutdown()
            raise item.error.with_traceback(item.error.__traceback__)
        return item

    def _to_device(self, item, args):
        # The worker built `item` with `self._worker_args`; only a changed reshape
        # argument (the sequence length) needs work here.
        n = None
        ra = self._reshape_arg
        if ra is not None and ra < len(args) and (self._worker_args is None or args[ra] != self._worker_args[ra]):
            n = args[ra]
        if self._on_host and n is None:
            return item  # already fresh host tensors: `.to("cpu")` would return them as they are
        return self._place(item, n)

    def _place(self, item, n):
        if isinstance(item, torch.Tensor):
            if n is not None:
                item = item.reshape(-1, n)
            return _h2d(item, self._device, self._copy_stream)
        if isinstance(item, (tuple, list)):
            return type(item)(self._place(t, n) for t in item)
        return item


class _WorkerError:
    """An exception raised in the worker, carried to the caller with its traceback."""

    def __init__(self, error):
        self.error = error
        self.text = "".join(traceback.format_exception(type(error), error, error.__traceback__))


class _Built:
    """One batch built ahead, and (with rollback) the loader state from before it."""

    __slots__ = ("batch", "before")

    def __init__(self, batch, before):
        self.batch, self.before = batch, before


class _Worker:
    """Daemon threads: under `plan_lock`, number and plan a batch (`assembly.plan` or
    `next_batch`); outside it, finish it (`assembly.gather` or `_stage`) and deliver
    it under its number. One thread: a bounded `_Handoff`; several: `_OrderedHandoff`."""

    def __init__(self, loader, args, depth, pin, rollback=False, copy=True, workers=1, assembly=None):
        self.loader, self.args, self.pin, self.rollback, self.copy, self.assembly = loader, args, pin, rollback, copy, assembly
        workers = max(1, int(workers))
        if workers > 1 and not _ORDERED_HANDOFF:
            raise RuntimeError("prefetch: several workers need _OrderedHandoff (templates/ordered_handoff.py)")
        self.queue = _Handoff(depth) if workers == 1 else _ORDERED_HANDOFF[0](depth, depth + workers)
        self.stop = threading.Event()
        self.plan_lock = threading.Lock()
        self.planned = 0  # sequence number of the next plan
        self.failed = False
        self.threads = [threading.Thread(target=self._run, name="train-prefetch", daemon=True) for _ in range(workers)]
        self.thread = self.threads[0]

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
                    plan = self.assembly.plan(self.loader, self.args) if self.assembly is not None else self.loader.next_batch(*self.args)
                except BaseException as error:  # handed to the caller, which re-raises it
                    self.failed = True
                    item = _WorkerError(error)
            if item is None:
                try:
                    item = _Built(self.assembly.gather(plan, self.pin) if self.assembly is not None else _stage(plan, self.pin, self.copy), before)
                except BaseException as error:
                    self.failed = True
                    item = _WorkerError(error)
                plan = None
            self.queue.deliver(seq, item, self.stop)
            if isinstance(item, _WorkerError):
                return


def _start_worker(worker):
    """Start a worker (`threads`, `stop`, `queue`), registered for the stop at exit."""
    _running_workers.add(worker)
    for thread in worker.threads:
        thread.start()


def _stop_worker(worker):
    """Stop a worker and drop what it queued; returns within about `_POLL_S` s (1 s at most)."""
    worker.stop.set()
    worker.queue.clear()
    deadline = time.monotonic() + 1.0
    for thread in worker.threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    _running_workers.discard(worker)


def _next_built(worker):
    """The worker's next queued item, waiting for it; RuntimeError if the worker died without one."""
    while True:
        item = worker.queue.get(_POLL_S)
        if item is not _EMPTY:
            return item
        if not any(t.is_alive() for t in worker.threads) and worker.queue.empty():
            raise RuntimeError("prefetch worker exited without a batch")


_EMPTY = object()


class _Handoff:
    """Bounded FIFO of built batches, one producer (the worker), one consumer (the caller).

    Why not `queue.Queue`: its `get` takes a Condition and wakes the producer inside
    the call, and every `put` signals the consumer. Here taking a batch is a deque pop
    that never releases the GIL; the caller wakes the producer with `room()` when it
    chooses (after its own torch calls), and the producer signals only a consumer that
    waits (`_want`: how many items it waits for). The signals are locks used as binary
    semaphores: released = "look again"; a stale one costs one extra look, and none is
    missed since each side states what it waits for before it looks, then blocks.
    """

    _NOBODY = float("inf")

    def __init__(self, depth):
        self.depth = depth
        self._items = collections.deque()
        self._want = self._NOBODY
        self._room, self._filled = threading.Lock(), threading.Lock()
        self._room.acquire()
        self._filled.acquire()

    def put(self, item, timeout):
        """Append `item` once there is room; False if there was none within `timeout` s."""
        while len(self._items) >= self.depth:
            if not self._room.acquire(timeout=timeout):
                return False
        self._items.append(item)
        if len(self._items) >= self._want:
            _signal(self._filled)
        return True

    def put_until(self, item, stop):
        """Append `item` once there is room, unless `stop` (an Event) is set first."""
        while not stop.is_set():
            if self.put(item, _POLL_S):
                return

    def claim(self, stop):
        """Before building an item: True unless `stop` is set (the one producer waits for room in `deliver`)."""
        return not stop.is_set()

    def deliver(self, seq, item, stop):
        """The producer's item number `seq` (they come in order): `put_until`."""
        self.put_until(item, stop)

    def get(self, timeout):
        """The oldest item, or `_EMPTY` if none came within `timeout` s. Does not wake the producer."""
        if not self._items and not self._wait_for(1, timeout):
            return _EMPTY
        return self._items.popleft()

    def wait_full(self, timeout):
        """Block until `depth` items are queued; False after `timeout` s."""
        return self._wait_for(self.depth, timeout)

    def _wait_for(self, count, timeout):
        deadline = time.monotonic() + timeout
        self._want = count
        try:
            while len(self._items) < count:
                left = deadline - time.monotonic()
                if left <= 0 or not self._filled.acquire(timeout=left):
                    return len(self._items) >= count
            return True
        finally:
            self._want = self._NOBODY

    def room(self):
        """Tell the producer that an item was taken."""
        try:  # `_signal`, inline: this runs on the training loop's path
            self._room.release()
        except RuntimeError:
            pass

    def clear(self):
        self._items.clear()
        _signal(self._room)

    def qsize(self):
        return len(self._items)

    def empty(self):
        return not self._items

    def full(self):
        return len(self._items) >= self.depth


def _signal(lock):
    try:
        lock.release()
    except RuntimeError:
        pass  # already signalled


def _stage(item, pin, copy=True):
    """The host tensors of one batch in fresh (pinned when `pin`) memory.

    A copy, so that a loader that reuses its buffers cannot change a queued batch;
    with `copy=False` and no pinning the batch is returned as it is (a loader that
    never writes into an array it keeps).
    """
    if not (pin or copy):
        return item
    if isinstance(item, torch.Tensor):
        if item.device.type != "cpu":
            return item
        out = torch.empty(item.shape, dtype=item.dtype, pin_memory=pin)
        out.copy_(item)
        return out
    if isinstance(item, (tuple, list)):
        return type(item)(_stage(t, pin, copy) for t in item)
    return item


def _snapshot(loader):
    """A deep copy of the loader's state that shares its tensors and arrays.

    The shards are read-only; everything else (positions, file index, lists) is
    copied, so the copy is the loader as it was, at the cost of a few small objects.
    """
    memo = {}
    _share_arrays(loader, memo, 0)
    return copy.deepcopy(loader, memo)


def _share_arrays(obj, memo, depth):
    if depth > 6 or id(obj) in memo:
        return
    if isinstance(obj, torch.Tensor) or (hasattr(obj, "__array_interface__") and hasattr(obj, "shape")):
        memo[id(obj)] = obj
        return
    if isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    else:
        children = getattr(obj, "__dict__", {}).values()
    for child in children:
        _share_arrays(child, memo, depth + 1)
