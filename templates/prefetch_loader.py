"""Injected runtime: the thread producer (feature `train_prefetch`): a training
loader's batches (`_make_train_loader`), a data generator's items (`_prefetch_iterator`)
or a self-prefetching loader's calls (`_prefetch_next_batch`) built ahead on one
background thread, `_Worker`.

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
  (templates/prefetch_lean.py) shortened it. In that child, 3 alternated runs each,
  the script's own `next_batch` recovered 61.2, 56.9, 61.1 % of the data time (step
  20.09, 20.21, 20.08 ms) and the numpy build 67.5, 67.4, 58.6 % (step 20.09, 19.92,
  20.13 ms): the ranges overlap, about 0.02 ms a step, for +709 counted bytes on
  that wrapped record.

A script gets only the code paths its patch uses (patcher/render/cut.py): each option
of `_make_train_loader` that the feature declares (`OPTIONS` in
patcher/transforms/train_prefetch.py) and no call site passes is the default of its
parameter, and the code behind it is cut.
Generators and loaders that move their own batches to the GPU:

For scripts whose training data comes from a generator or any iterator that does not
depend on the model (modded-nanogpt's `distributed_data_generator`), the construction

    train_loader = distributed_data_generator(args.train_files, batch_size, seq_len)

becomes

    train_loader = _prefetch_iterator(lambda: distributed_data_generator(...), prefetch=..., queue_depth=..., copy_stream=...)

and `next(train_loader)` then returns the items the generator yields, in order, built
`queue_depth` items ahead by a daemon thread. The generator runs unchanged on that
thread, on the CUDA device that was current where it was built, and on the copy
stream when `copy_stream` is on: its own `.to("cuda", non_blocking=True)` H2D copies
then leave the training thread and overlap compute; the training thread's stream waits
on an event recorded after each item, and `record_stream` keeps the caching allocator
from reusing the memory early. The first item is built when the first one is asked
for (cold start), the rest ahead.

`_prefetch_next_batch` does the same for a loader class whose `next_batch()` moves
its batch to the GPU itself and takes no device (`return x.cuda(), y.cuda()`).

Exactness: the same generator object is advanced by `next` only, one item per item
handed out, so the sequence is the original's. `.send(None)` is `next()`. `.send(value)`
with a value (modded-nanogpt's new batch size and sequence length) arrives after the
worker has already resumed the generator with None at that `yield` and built items
ahead without the value; a generator frame cannot be rolled back, so those items are
dropped and the generator is rebuilt: a new one from the script's own expression,
replayed with every value the caller passed so far (None for `next`), then sent the
new value. The item handed out is therefore the one the original returns, never one
built with stale parameters. The rebuild costs one pass over the items handed out so
far, on the caller's thread; it is meant for schedules that change a few times a run
(the usual `.send(None)` per step costs nothing). Only a generator built through
`_prefetch_iterator` (which keeps the expression) can be rebuilt; otherwise a value
sent raises.
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
    A worker's exception is re-raised in the caller with the worker's traceback, at
    the batch where it happened, and the worker goes on: a caller that catches it and
    calls again gets what the loader's next call returns, as from the original.
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
            self._worker.queue.room()  # its place back: the worker goes on, as the loader would at a next call
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
    generator's items from `_item_builder`."""

    def __init__(self, build, depth, setup=None):
        self.build, self.setup = build, setup
        self.queue, self.stop = _Handoff(depth), threading.Event()
        self.thread = threading.Thread(target=self._run, name="train-prefetch", daemon=True)
        self.threads = [self.thread]

    def _run(self):
        try:
            if self.setup is not None:
                self.setup()
        except BaseException as error:  # handed to the caller, which re-raises it
            return self.queue.put_until(error, self.stop)
        while not self.stop.is_set():
            # The item is not held by this frame while the next one is built.
            self.queue.put_until(_built(self.build), self.stop)


def _built(build):
    """`build()`, or the exception it raised: handed to the caller, which re-raises it at
    that batch, while the worker goes on building, as the loader goes on at a next call
    (a loop that catches a bad shard's error and calls again gets the next batch)."""
    try:
        return build()
    except BaseException as error:
        return error


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


# A data generator, or a loader class whose next_batch() moves its batch to the GPU itself,
# run ahead on the same worker thread.


def _prefetch_iterator(make_iterator, prefetch=True, queue_depth=2, copy_stream=True, name="train_loader"):
    """Build the training data iterator, running it ahead when `prefetch` is on.

    Takes: make_iterator: `() -> iterator`, the script's own expression; prefetch:
    bool (`TRAIN_PREFETCH`); queue_depth: int >= 1, items built ahead
    (`TRAIN_PREFETCH_QUEUE`); copy_stream: bool (`TRAIN_COPY_STREAM`), run the
    iterator's H2D copies on a side CUDA stream; name: the variable's name, so that
    building it again shuts the previous worker down first.
    Returns: `make_iterator()` itself when prefetch is off, else a `_PrefetchIterator`.
    """
    _stop_previous(name)
    if not prefetch:
        return make_iterator()
    iterator = _PrefetchIterator(make_iterator(), queue_depth, copy_stream, remake=make_iterator)
    _live_prefetchers[name] = iterator
    return iterator


class _PrefetchIterator:
    """An iterator whose items are produced `queue_depth` ahead by a daemon thread.

    `next()` returns exactly what `next(iterator)` would (tuples of tensors on the
    iterator's device, numpy arrays, ...), in order. StopIteration and any exception
    raised by the iterator reach the caller at the item where they happened, the
    latter with the worker's traceback. `send(value)` as a generator's (module
    docstring); remake: `() -> iterator`, a new iterator equal to `iterator` when
    built, needed for sending values other than None.
    """

    def __init__(self, iterator, queue_depth=2, copy_stream=True, remake=None):
        self._iterator = iterator
        self._remake = remake
        self._sent = []  # per item handed out: the value the caller passed (None for next)
        self._depth = max(1, int(queue_depth))
        self._cuda = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self._stream = torch.cuda.Stream(device=self._cuda) if (copy_stream and self._cuda is not None) else None
        self._worker = None
        self._ended = None

    def __iter__(self):
        return self

    def __next__(self):
        if isinstance(self._ended, StopIteration):
            raise StopIteration
        if self._ended is not None:
            raise self._ended
        if self._worker is None:
            self._start()
        worker = self._worker
        item = _next_built(worker)
        if isinstance(item, BaseException):
            self.shutdown()
            if isinstance(item, StopIteration):
                self._ended = item
                raise StopIteration
            raise item  # with the worker's traceback
        value, ready = item
        if ready is not None:
            current = torch.cuda.current_stream(self._cuda)
            current.wait_event(ready)
            _record_stream(value, current)
        worker.queue.room()  # last: see _PrefetchLoader.next_batch
        self._sent.append(None)
        return value

    def send(self, value):
        """`generator.send(value)`: the next item, built after the generator received `value`.

        Raises TypeError for a value sent before the first item (as a generator does),
        RuntimeError when a value is sent and the iterator cannot be rebuilt.
        """
        if value is None:
            return next(self)
        if not self._sent:
            raise TypeError("can't send non-None value to a just-started generator")
        if self._remake is None:
            raise RuntimeError("prefetch: .send() of a value to an iterator that runs ahead and cannot be rebuilt")
        if self._ended is not None:
            return next(self)  # ended: StopIteration or the error, as for next()
        self.shutdown()
        self._ended = None
        self._iterator = self._rebuilt()
        item = self._iterator.send(value)  # StopIteration and errors reach the caller as the original's
        self._sent.append(value)
        self._start()  # the next items, ahead again with the new parameters
        return item

    def _start(self):
        # The worker runs on the rank's device, set per thread (not device 0).
        setup = None if self._cuda is None else lambda device=self._cuda: torch.cuda.set_device(device)
        self._worker = _Worker(_item_builder(self._iterator, self._stream), self._depth, setup)
        _start_worker(self._worker)

    def _rebuilt(self):
        """A new iterator where the caller's is: built by `remake`, then replayed with
        every value handed to the caller's one so far, the items dropped."""
        iterator = self._remake()
        next(iterator)
        for value in self._sent[1:]:
            iterator.send(value)  # send(None) is next()
        return iterator

    def shutdown(self):
        """Stop the worker and drop queued items; returns within about `_POLL_S` s."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        _stop_workers([worker], 1)
        if self._ended is None and worker.thread.ident is not None:
            self._ended = RuntimeError("prefetch iterator shut down")

    close = shutdown

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def _item_builder(iterator, stream):
    """`() -> (item, ready)`: `next(iterator)`, on the copy stream `stream` when it is
    not None, with the CUDA event recorded after it (`ready`; None without a stream).
    StopIteration ends the worker and reaches the caller as the original's."""

    def build():
        if stream is None:
            return next(iterator), None
        with torch.cuda.stream(stream):
            value = next(iterator)
            ready = torch.cuda.Event()
            ready.record(stream)
        return value, ready

    return build


def _record_stream(value, stream):
    """`record_stream` on every CUDA tensor in `value` (a batch of any structure, see `_each_leaf`)."""
    _each_tensor(value, lambda t: t.is_cuda and t.record_stream(stream))


def _prefetch_next_batch(make_loader, prefetch=True, queue_depth=2, copy_stream=True, name="train_loader"):
    """Build a training loader whose `next_batch()` moves batches to the GPU itself, run ahead.

    For loader classes built without a device (modded-nanogpt's older
    `DistributedDataLoader`, `return x.cuda(), y.cuda()`). Takes: make_loader:
    `() -> loader`, the script's own construction; the toggles as `_prefetch_iterator`.
    Returns: `make_loader()` itself when prefetch is off, else a `_CallsAhead`.
    """
    _stop_previous(name)
    if not prefetch:
        return make_loader()
    loader = _CallsAhead(make_loader, queue_depth, copy_stream)
    _live_prefetchers[name] = loader
    return loader


class _CallsAhead:
    """`next_batch(*args)` of a loader, called ahead on a daemon thread with constant arguments.

    Returns what the loader's `next_batch(*args)` returns, in order. Anything else the
    caller uses (`reset()`, `ntok_total`) first brings the loader to where the caller is:
    the calls run ahead are dropped, the loader rebuilt and every call the caller made
    replayed (exact, costs one pass); method calls are recorded for later replays.
    New arguments to `next_batch` do the same before running ahead again.
    """

    def __init__(self, make_loader, queue_depth=2, copy_stream=True):
        self._make_loader = make_loader
        self._depth, self._copy_stream = queue_depth, copy_stream
        self._loader = make_loader()
        self._history = []  # (method, args, kwargs) in the order the caller made them
        self._ahead = None  # the _PrefetchIterator over next_batch(*self._args)
        self._args = None
        self._stale = False  # the loader ran ahead of the caller

    def next_batch(self, *args):
        if self._ahead is not None and args != self._args:
            self._sync()
        if self._ahead is None:
            if self._stale:
                self._rewind()
            self._args = args
            self._ahead = _PrefetchIterator(_repeated_calls(self._loader, args), self._depth, self._copy_stream)
        batch = next(self._ahead)
        self._history.append(("next_batch", args, {}))
        return batch

    def shutdown(self):
        """Stop the worker; the loader has then run ahead (a later use replays)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.shutdown()
            self._stale = True

    close = shutdown

    def _sync(self):
        self.shutdown()
        if self._stale:
            self._rewind()

    def _rewind(self):
        self._loader = self._make_loader()
        for method, args, kwargs in self._history:
            getattr(self._loader, method)(*args, **kwargs)
        self._stale = False

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        self._sync()
        value = getattr(self._loader, name)
        if not callable(value):
            return value

        def recorded(*args, **kwargs):
            self._history.append((name, args, kwargs))
            return value(*args, **kwargs)

        return recorded


def _repeated_calls(loader, args):
    while True:
        yield loader.next_batch(*args)
