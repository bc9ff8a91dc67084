"""Injected runtime: train-batch prefetch for constant `next_batch` arguments (feature `train_prefetch`).

The common case, and the one a submission can afford (every injected byte counts
against the artifact cap): the survey proved that every `next_batch` call passes run
constants (`args.train_batch_tokens, args.train_seq_len, grad_accum_steps`), and the
script uses the loader variable for nothing but `.next_batch(...)`. The construction

    train_loader = DistributedTokenLoader(args.train_files, rank, world_size, device)

becomes

    train_loader = _make_train_loader(
        lambda loader_device: DistributedTokenLoader(args.train_files, rank, world_size, loader_device),
        device, prefetch=..., queue_depth=..., copy_stream=...)

The script's loader is built with `device=cpu`; one daemon thread calls its
`next_batch` with the arguments of the first call, stages each batch in fresh
(pinned, when the batch goes to CUDA) host memory and queues it; `next_batch` hands
the batches out in order and does the H2D copy (`_h2d`: on the copy stream when
enabled). The loader runs exactly the calls the original makes, in the same order, so
the batches are bit-identical; the worker is at most `queue_depth` batches (plus the
one it is building) ahead.

The hand-off is two `queue.SimpleQueue`s (implemented in C): `ready` (built batches)
and `room` (one token per free place). Taking a waiting batch is one C call that
never releases the GIL; a side that waits blocks inside C without running Python, so
the worker costs the training thread no more GIL hand-offs than it must: a host-bound
training loop launches thousands of kernels a step, and a worker running Python
between them delays every launch.

Contracts: a worker's exception is re-raised in the caller, with the worker's
traceback, at the batch where it happened; building the loader again for the same
variable (the warm-up reset) shuts the previous worker down first; workers are
daemons, stopped (and joined for up to 3 s, so none is inside a torch op while Python
finalizes) at exit. Arguments that differ from the first call's, or a `next_batch`
after `shutdown()`, raise RuntimeError: they cannot happen where this runtime is
injected, and would otherwise hand out batches built for other arguments.
Scripts with per-step arguments, attribute reads or the producer tuning toggles get
`templates/prefetch_loader.py` instead.

Options that no call site passes are cut (patcher/render/cut.py): `host_copy` (False: a
loader that never writes into an array it keeps hands its batches out as built on a
CPU device) and `assembly` (the numpy assembly, templates/shuffled_assembly.py).
"""

import atexit
import queue
import threading

import torch

from templates.copy_stream import _h2d
from templates.shuffled_assembly import _shuffled_gather, _shuffled_plan
from templates.staging import _each_tensor, _stage

# One live prefetcher per loader variable: building a new one shuts the old one down.
_live_prefetchers = {}
_CUT_OPTIONS = {"host_copy": True, "assembly": None}


def _make_train_loader(make_loader, device, prefetch=True, queue_depth=2, copy_stream=True, slot="train_loader", host_copy=True, assembly=None):
    """Build the training loader, prefetching when `prefetch` is on.

    Takes: make_loader: `device -> loader`, the script's own construction expression;
    device: where batches must end up; prefetch: bool (`TRAIN_PREFETCH`); queue_depth:
    int >= 1, batches built ahead (`TRAIN_PREFETCH_QUEUE`); copy_stream: bool
    (`TRAIN_COPY_STREAM`); slot: the variable name, so that a rebuild shuts the
    previous worker down first; host_copy: copy each batch even when it is not
    pinned (False when the survey finds that the loader never writes into an array
    a returned batch views); assembly: None, or the name of the script's shard getter
    (`"_get_shard_memmap"`): each batch is then `_shuffled_plan` (the loader advances
    as `next_batch(*args)`) and `_shuffled_gather` (templates/shuffled_assembly.py).
    Returns: `make_loader(device)` itself when prefetch is off (the original
    behaviour), else a `_PrefetchLoader`.
    """
    old = _live_prefetchers.pop(slot, None)
    if old is not None:
        old.shutdown()
    if not prefetch:
        return make_loader(device)
    loader = _live_prefetchers[slot] = _PrefetchLoader(make_loader(torch.device("cpu")), torch.device(device), queue_depth, copy_stream, host_copy=host_copy, assembly=assembly)
    return loader


atexit.register(lambda: [loader.shutdown() for loader in list(_live_prefetchers.values())])


class _PrefetchLoader:
    """A training loader whose batches are built ahead on a daemon thread.

    `next_batch(*args)` returns what the wrapped loader's `next_batch(*args)` returns
    (e.g. `x, y: int64 [batch, seq_len]` on `device`), bit for bit and in order.
    Raises the worker's exception (with its traceback) at the batch where it happened;
    RuntimeError for arguments other than the first call's, or after `shutdown()`.
    """

    def __init__(self, loader, device, queue_depth=2, copy_stream=True, host_copy=True, assembly=None):
        self.loader, self.device, self.copy_stream, self.host_copy, self.assembly, self.args = loader, device, copy_stream, host_copy, assembly, None
        self.ready, self.room, self.stop = queue.SimpleQueue(), queue.SimpleQueue(), threading.Event()
        for _ in range(max(1, int(queue_depth))):
            self.room.put(None)
        self.thread = threading.Thread(target=self._run, name="train-prefetch", daemon=True)

    def next_batch(self, *args):
        if self.args is None:
            self.args = args
            self.thread.start()
        if args != self.args or self.stop.is_set():
            raise RuntimeError(f"prefetch: next_batch{args} after next_batch{self.args} or shutdown")
        batch = self.ready.get()
        self.room.put(None)  # after the take: the worker wakes only once the batch is ours
        if isinstance(batch, BaseException):
            self.shutdown()
            raise batch
        return batch if self.device.type == "cpu" else _each_tensor(batch, lambda t: _h2d(t, self.device, self.copy_stream))

    def _run(self):
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        try:
            while not self.stop.is_set():
                if self.assembly is not None:
                    batch = _shuffled_gather(_shuffled_plan(self.loader, self.assembly, *self.args), pin)
                else:
                    batch = _stage(self.loader.next_batch(*self.args), pin, self.host_copy)
                self.room.get()
                self.ready.put(batch)
                batch = None  # not held while the next batch is built
        except BaseException as error:  # handed to the caller, which re-raises it
            self.ready.put(error)

    def shutdown(self):
        """Stop the worker (it finishes the batch in hand, at most 3 s waited for)."""
        self.stop.set()
        self.room.put(None)  # wakes a worker waiting for room
        if self.thread.is_alive():
            self.thread.join(3)
