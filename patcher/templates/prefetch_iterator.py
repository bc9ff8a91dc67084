"""Injected runtime: a data generator run ahead on a background thread (feature `train_prefetch`).

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

import torch

from patcher.templates.prefetch_loader import _Worker, _live_prefetchers, _next_built, _start_worker, _stop_previous, _stop_workers
from patcher.templates.staging import _each_tensor


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
