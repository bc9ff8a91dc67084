"""Injected runtime: train-batch prefetch on a background thread (feature `train_prefetch`).

`patch-prefetch` renders the body of this module into a training script after the
body of `patcher/templates/copy_stream.py`, and rewrites each construction of the training
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

One worker thread per loader, calling the script's own `next_batch`. Two producers
of this runtime, both from parameter-golf PR #1532, were measured and removed, with
`patch-prefetch bench --main-thread op-bound --steps 300 --compute-ms 20` on
parameter-golf's 2026-04-05 SDClip record (ShuffledSequenceLoader), 2-core CPU:

- Several threads planning batches in call order and handing them out in order: two
  workers lengthened the step by +0.49 ms against +0.27 ms for one (median, within
  noise of each other; with the script's own `next_batch`: +1.03 vs +0.81 ms), and
  built batches at 0.44-0.77x the rate of one.
- Batches built in numpy (the loader's RNG draws planned in its order, the token
  windows gathered with one fancy index per shard) instead of by the script's own
  `next_batch`: on this thread runtime it shortened the step by about 0.5 ms against
  the thread without it, but every thread variant made the step longer than the
  original (+0.27 ms at best), while the default forked child
  (patcher/templates/prefetch_lean.py) shortened it. In that child, 3 alternated runs each,
  the script's own `next_batch` recovered 61.2, 56.9, 61.1 % of the data time (step
  20.09, 20.21, 20.08 ms) and the numpy build 67.5, 67.4, 58.6 % (step 20.09, 19.92,
  20.13 ms): the ranges overlap, about 0.02 ms a step, for +709 counted bytes on
  that wrapped record.

A script gets only the code paths its patch uses (patcher/render/cut.py): each option
of `_make_train_loader` that the feature declares (`OPTIONS` in
patcher/transforms/train_prefetch.py) and no call site passes is the default of its
parameter, and the code behind it is cut.
"""

import atexit
import contextlib
import copy
import queue
import threading
import time
import warnings

import torch

from patcher.templates.copy_stream import _h2d
from patcher.templates.staging import _POLL_S, _STOP_WAIT_S, _each_tensor, _stage

# One live prefetcher per loader variable: building a new one shuts the old one down.
_live_prefetchers = {}
# Every running worker, stopped at interpreter exit.
_running_workers = set()


def _stop_workers(stopping, wait):
    """Stop the workers `stopping` and drop what they queued, waiting at most `wait` s for their threads in all."""
    for worker in stopping:
        worker.stop.set()
        worker.queue.clear()
    deadline = time.monotonic() + wait
    for worker in stopping:
        for thread in worker.threads:
            thread.join(max(0, deadline - time.monotonic()))
        _running_workers.discard(worker)


atexit.register(lambda: _stop_workers(list(_running_workers), _STOP_WAIT_S))


def _start_worker(worker):
    """Start a worker (`threads`, `stop`, `queue`), registered for the stop at exit."""
    _running_workers.add(worker)
    for thread in worker.threads:
        thread.start()


def _make_train_loader(make_loader, device, prefetch=True, queue_depth=2, copy_stream=True, reshape_arg=None, name="train_loader", rollback=False, host_copy=True, attrs=False, replay=False):
    """Build the training loader, prefetching when `prefetch` is on.

    Takes: make_loader: `device -> loader`, the script's own construction expression;
    device: where batches must end up; prefetch: bool (`TRAIN_PREFETCH`); queue_depth:
    int >= 1, batches built ahead (`TRAIN_PREFETCH_QUEUE`); copy_stream: bool
    (`TRAIN_COPY_STREAM`); reshape_arg: index of a `next_batch` argument used only as
    the trailing dimension of `.reshape(-1, n)`, or None; name: the variable's name,
    so that a rebuild (the warm-up reset) shuts the previous worker down first;
    rollback: snapshot the loader before each batch built ahead, so that a changed
    argument discards the queued batches by restoring a snapshot instead of a replay
    (only for loaders that never change an array in place; the survey checks that);
    host_copy: copy each batch built ahead even when it is not pinned, for loaders
    that may later write into an array a returned batch views (False when the survey
    finds no such write: the batch is handed out as built);
    attrs: the script reads the loader's attributes (`train_loader.stream`), which
    first settle it where the caller is (`_SettlingLoader`, needs `replay=True`);
    without it such reads raise AttributeError; replay: keep the arguments of every batch
    handed out, so that the loader can be rebuilt and replayed to the caller's
    position when arguments change unexpectedly or after a shutdown; without it
    (arguments the survey proved constant) either raises RuntimeError.
    Returns: `make_loader(device)` itself when prefetch is off (the original
    behaviour), else a `_PrefetchLoader`.
    """
    _stop_previous(name)
    if not prefetch:
        return make_loader(device)
    if attrs and not replay:
        raise ValueError("prefetch: attrs=True needs replay=True")
    loader = _live_prefetchers[name] = (_SettlingLoader if attrs else _PrefetchLoader)(make_loader, device, queue_depth, copy_stream, reshape_arg=reshape_arg, rollback=rollback, host_copy=host_copy, replay=replay)
    return loader


def _stop_previous(name):
    """Shut down the prefetcher built before for the variable `name`, if any."""
    old = _live_prefetchers.pop(name, None)
    if old is not None:
        old.shutdown()


class _PrefetchLoader:
    """A training loader whose `next_batch` batches are built ahead on a daemon thread.

    `next_batch(*args)` returns what the wrapped loader's `next_batch(*args)` returns
    (e.g. `x, y: int64 [batch, seq_len]` on `device`), bit for bit and in order.
    A worker's exception is re-raised in the caller with the worker's traceback.
    """

    def __init__(self, make_loader, device, queue_depth=2, copy_stream=True, reshape_arg=None, rollback=False, host_copy=True, replay=False):
        self._copy_stream, self._reshape_arg, self._rollback, self._host_copy, self._replay = copy_stream, reshape_arg, rollback, host_copy, replay
        self._device = torch.device(device)
        self._pin = self._device.type == "cuda" and torch.cuda.is_available()
        self._on_host = self._device.type == "cpu"
        self._depth = max(1, int(queue_depth))
        self._loader = make_loader(torch.device("cpu"))
        # The arguments of every batch handed out (for a replay), the worker and the
        # arguments it builds with, and whether the loader built batches nobody took.
        self._worker, self._worker_args, self._ahead = None, None, False
        if self._replay:
            self._make_loader, self._handed_out = make_loader, []

    def next_batch(self, *args):
        # The common case, a batch built with these arguments waiting in the queue, runs
        # in as few Python frames as possible: this wait is on the training loop's path.
        worker = self._worker
        if worker is None or args != self._worker_args:
            self._follow(args)
            worker = self._worker
        item = worker.queue.get(_POLL_S)
        if item is _EMPTY or isinstance(item, BaseException):
            item = self._checked(item)
        if self._rollback:
            item = item.batch
        if self._replay:
            self._handed_out.append(args)
        batch = item if self._on_host and args == self._worker_args else self._to_device(item, args)
        # Last: the woken worker competes for the GIL, and a torch call above (which
        # releases it) would otherwise let the worker's Python run inside this call.
        worker.queue.room()
        return batch

    def _follow(self, args):
        """Start the worker, or make it build with the caller's new arguments: batches
        queued with other arguments are wrong for this call, so the loader goes back to
        where the caller is (a snapshot with rollback, else a rebuild and a replay)."""
        if self._worker is not None:
            if self._reshape_arg is not None and self._key(args) == self._key(self._worker_args):
                return  # only the reshape argument changed: the hand-out reshapes
            if self._rollback:
                head = self._checked(_EMPTY)  # carries the loader from just before it was built
                self.shutdown()
                self._loader, self._ahead = head.before, False
            else:
                if not self._replay:
                    raise RuntimeError(f"prefetch: next_batch arguments changed to {args}")
                warnings.warn(f"prefetch: next_batch arguments changed to {args}: replaying {len(self._handed_out)} batches", RuntimeWarning, stacklevel=3)
                self.shutdown()
        if self._ahead:
            if not self._replay:
                raise RuntimeError("prefetch: next_batch after shutdown")
            self._rewind()
        self._worker, self._worker_args = _Worker(self._builder(args), self._depth), args
        _start_worker(self._worker)

    def _builder(self, args):
        """The worker's `() -> item`: `next_batch(*args)` staged (`_stage`); with rollback a
        `_Built` that also carries a snapshot of the loader from before the batch (its
        arguments run left to right). The closure holds the loader, not this object,
        whose `__del__` stops the worker."""
        loader, pin, host_copy = self._loader, self._pin, self._host_copy
        if self._rollback:
            return lambda: _Built(_snapshot(loader), _stage(loader.next_batch(*args), pin, host_copy))
        return lambda: _stage(loader.next_batch(*args), pin, host_copy)

    def shutdown(self):
        """Stop the worker and drop queued batches; returns within about `_POLL_S` s.

        The loader has then run ahead of the caller; a later `next_batch` replays it
        to the caller's position first (with `replay`, else it raises RuntimeError).
        """
        worker, self._worker = self._worker, None
        if worker is not None:
            self._ahead = True
            _stop_workers([worker], 1)

    close = shutdown

    def __del__(self):
        with contextlib.suppress(Exception):
            self.shutdown()

    def _key(self, args):
        """The arguments that decide the next batch: all but the reshape argument."""
        if self._reshape_arg is None or self._reshape_arg >= len(args):
            return args
        return args[: self._reshape_arg] + args[self._reshape_arg + 1 :]

    def _rewind(self):
        self._loader = self._make_loader(torch.device("cpu"))
        for old_args in self._handed_out:
            self._loader.next_batch(*old_args)
        self._ahead = False

    def _checked(self, item):
        """`item` from the queue (`_EMPTY`: none yet, wait for it), a worker's error re-raised."""
        if item is _EMPTY:
            item = _next_built(self._worker)
        if isinstance(item, BaseException):
            self.shutdown()
            raise item  # with the worker's traceback
        return item

    def _to_device(self, item, args):
        # The worker built `item` with `self._worker_args`; only a changed reshape
        # argument (the sequence length) needs work here.
        if self._reshape_arg is not None and self._reshape_arg < len(args) and args[self._reshape_arg] != self._worker_args[self._reshape_arg]:
            item = _each_tensor(item, lambda t, n=args[self._reshape_arg]: t.reshape(-1, n))
        if self._on_host:
            return item  # already fresh host tensors: `.to("cpu")` would return them as they are
        return _each_tensor(item, lambda t: _h2d(t, self._device, self._copy_stream))


class _SettlingLoader(_PrefetchLoader):
    """A `_PrefetchLoader` for a script that also reads the loader's attributes.

    Anything but next_batch (e.g. `train_loader.stream.take(n)` for calibration) must
    see the loader exactly where the caller's batches left it: the first such read
    rebuilds the loader and replays the batches handed out (one pass, once); from then
    on the caller may change the loader directly, so nothing is built ahead.
    """

    _settled = False

    def next_batch(self, *args):
        if self._settled:
            return self._to_device(self._loader.next_batch(*args), args)
        return _PrefetchLoader.next_batch(self, *args)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if not self._settled:
            self.shutdown()
            self._rewind()
            self._settled = True
        return getattr(self._loader, name)


class _Built:
    """One batch built ahead, and (with rollback) the loader state from before it."""

    __slots__ = ("before", "batch")

    def __init__(self, before, batch):
        self.before, self.batch = before, batch


class _Worker:
    """The thread producer: a daemon thread that runs `setup()` once, then `build()` in
    a loop, queueing each item (or the exception that ends it) in a bounded `_Handoff`
    of `depth` items. A loader's batches come from `_PrefetchLoader._builder`, a data
    generator's items from `_item_builder` (patcher/templates/prefetch_iterator.py)."""

    def __init__(self, build, depth, setup=None):
        self.build, self.setup = build, setup
        self.queue, self.stop = _Handoff(depth), threading.Event()
        self.thread = threading.Thread(target=self._run, name="train-prefetch", daemon=True)
        self.threads = [self.thread]

    def _run(self):
        try:
            if self.setup is not None:
                self.setup()
            while not self.stop.is_set():
                # The item is not held by this frame while the next one is built.
                self.queue.put_until(self.build(), self.stop)
        except BaseException as error:  # handed to the caller, which re-raises it
            self.queue.put_until(error, self.stop)


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

    Two `queue.SimpleQueue`s: the items, and the free places ("room", one token per
    place). Both are implemented in C, so taking a waiting batch is one C call that
    never releases the GIL, and a side that blocks waits inside C without running
    Python. The consumer gives a place back with `room()` when it chooses (after its
    own torch calls), which is what wakes a producer waiting for room; a `put` wakes
    a consumer only if one is blocked in `get`. Why not `queue.Queue`: its `get` and
    `put` run Python under a Condition and notify the other side on every call.
    """

    def __init__(self, depth):
        self.depth, self._items, self._room = depth, queue.SimpleQueue(), queue.SimpleQueue()
        for _ in range(depth):
            self._room.put(None)

    def put(self, item, timeout):
        """Append `item` once there is room; False if there was none within `timeout` s."""
        try:
            self._room.get(timeout=timeout)
        except queue.Empty:
            return False
        self._items.put(item)
        return True

    def put_until(self, item, stop):
        """Append `item` once there is room, unless `stop` (an Event) is set first."""
        while not (stop.is_set() or self.put(item, _POLL_S)):
            pass

    def get(self, timeout):
        """The oldest item, or `_EMPTY` if none came within `timeout` s. Does not wake the producer."""
        try:
            return self._items.get(timeout=timeout)
        except queue.Empty:
            return _EMPTY

    def wait_full(self, timeout):
        """Block until `depth` items are queued; False after `timeout` s (polls every ms: benchmarks only)."""
        deadline = time.monotonic() + timeout
        while self._items.qsize() < self.depth:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def room(self):
        """Tell the producer that an item was taken."""
        self._room.put(None)

    def clear(self):
        """Drop the queued items; their places, and one more that wakes a waiting producer, are freed."""
        while not self._items.empty():
            self._items.get()
            self._room.put(None)
        self._room.put(None)

    def qsize(self):
        return self._items.qsize()

    def empty(self):
        return self._items.empty()

    def full(self):
        return self._items.qsize() >= self.depth


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
