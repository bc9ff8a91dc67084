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

The script's loader is built with `device=cpu`. The first `next_batch` runs it in the
training process, as the original does; then a child process, forked with the loader
in that state, keeps calling its `next_batch` with the same arguments and writes each
batch into one of `queue_depth` shared-memory slots. In the training process a thin
thread copies each filled slot into fresh pinned memory (when the batch goes to CUDA)
and hands the slot back; `next_batch` takes the batches in order and does the H2D copy
(`_h2d`: on the copy stream when enabled). Only the child advances the loader, with
exactly the calls the original makes, so the batches are bit-identical.

Why a process: a host-bound training loop launches thousands of kernels a step, each
a torch call that releases and re-takes the GIL. A producer thread running the
loader's Python between them delays every launch, so the loop's wait falls while its
step grows (bench `--main-thread op-bound`: a thread running the loader recovered
25-45 % of the original's data time as a shorter step). The child holds no GIL of
the training process; the pinning thread holds it for a few microseconds a batch (its
copies run in torch with the GIL released). This is the design of PyTorch's
DataLoader (forked workers into shared memory, a pin-memory thread), for a loader
whose order must not change.

Contracts: at most `queue_depth + 1` batches are built ahead (`queue_depth` in the
slots, one pinned); the child waits for a free slot before it builds; a child's exception is re-raised in the caller at
the batch where it happened, with the child's traceback as its cause; a child that
dies (killed, out of memory) raises RuntimeError with its exit code; building the
loader again for the same variable (the warm-up reset) kills the previous child
first; children are daemons, terminated at exit. Arguments that differ from the
first call's, a batch whose tensor shapes differ from the first batch's,
or a `next_batch` after `shutdown()` raise RuntimeError: they cannot happen where
this runtime is injected, and would otherwise hand out wrong batches. The child
never touches CUDA (the loader is built on the CPU) and runs torch on one thread
(a forked OpenMP team would hang). Needs the `fork` start method (Linux).
Scripts with per-step arguments, attribute reads or the producer tuning toggles get
`templates/prefetch_loader.py` instead.
"""

import itertools
import multiprocessing.pool
import queue
import threading

import torch

from templates.copy_stream import _h2d
from templates.staging import _each_tensor

# One live prefetcher per loader variable: building a new one shuts the old one down.
_live_prefetchers = {}


def _make_train_loader(make_loader, device, prefetch=True, queue_depth=2, copy_stream=True, slot="train_loader"):
    """Build the training loader, prefetching when `prefetch` is on.

    Takes: make_loader: `device -> loader`, the script's own construction expression;
    device: where batches must end up; prefetch: bool (`TRAIN_PREFETCH`); queue_depth:
    int >= 1, batches built ahead (`TRAIN_PREFETCH_QUEUE`); copy_stream: bool
    (`TRAIN_COPY_STREAM`); slot: the variable name, so that a rebuild shuts the
    previous producer down first.
    Returns: `make_loader(device)` itself when prefetch is off (the original
    behaviour), else a `_PrefetchLoader`.
    """
    old = _live_prefetchers.pop(slot, None)
    if old is not None:
        old.shutdown()
    if not prefetch:
        return make_loader(device)
    loader = _live_prefetchers[slot] = _PrefetchLoader(make_loader(torch.device("cpu")), torch.device(device), queue_depth, copy_stream)
    return loader


def _produce(loader, args, slots, conn):
    """The child process: `loader.next_batch(*args)` into `slots` in turn, forever.

    Sends the index of each filled slot on `conn`; before reusing a slot, waits for one
    message on `conn` (a slot handed back, in order). An exception is sent instead,
    with its traceback, and ends the child.
    """
    torch.set_num_threads(1)  # the parent's OpenMP team does not exist in a forked child
    try:
        for n in itertools.count():
            if n >= len(slots):
                conn.recv()
            built, slot = [], []
            _each_tensor(loader.next_batch(*args), built.append)
            _each_tensor(slots[n % len(slots)], slot.append)
            for into, tensor in zip(slot, built):
                if into.shape != tensor.shape:
                    raise RuntimeError("prefetch: batch shape changed; set TRAIN_PREFETCH=0")
                into.copy_(tensor)
            conn.send(n % len(slots))
    except BaseException as error:  # re-raised in the training process
        conn.send(multiprocessing.pool.ExceptionWithTraceback(error, error.__traceback__))


class _PrefetchLoader:
    """A training loader whose batches are built ahead by a forked child process.

    `next_batch(*args)` returns what the wrapped loader's `next_batch(*args)` returns
    (e.g. `x, y: int64 [batch, seq_len]` on `device`), bit for bit and in order.
    Raises the child's exception (its traceback as `__cause__`) at the batch where it
    happened; RuntimeError when the child died, for arguments other than the first
    call's, or after `shutdown()`.
    """

    def __init__(self, loader, device, queue_depth=2, copy_stream=True):
        self.loader, self.device, self.copy_stream, self.args, self.process = loader, device, copy_stream, None, None
        self.depth, self.ready, self.room = max(1, int(queue_depth)), queue.SimpleQueue(), queue.SimpleQueue()
        self.room.put(None)  # one pinned batch waits; the slots hold the rest

    def next_batch(self, *args):
        if self.args is None and self.process is None:
            self.args = args
            batch = self.loader.next_batch(*args)  # the first batch here; the child goes on from this state
            self.slots = [_each_tensor(batch, lambda t: torch.empty_like(t).share_memory_()) for _ in range(self.depth)]
            self.conn, child_conn = multiprocessing.Pipe()
            self.process = multiprocessing.get_context("fork").Process(target=_produce, args=(self.loader, args, self.slots, child_conn), daemon=True)
            self.process.start()
            child_conn.close()  # so that the child's death reads as EOF here
            self.thread = threading.Thread(target=self._pin, daemon=True)
            self.thread.start()
        elif args != self.args or not self.process:
            raise RuntimeError(f"prefetch: next_batch{args} after next_batch{self.args} or shutdown")
        else:
            batch = self.ready.get()
            self.room.put(None)
            if isinstance(batch, BaseException):
                self.shutdown()
                raise batch
        return batch if self.device.type == "cpu" else _each_tensor(batch, lambda t: _h2d(t, self.device, self.copy_stream))

    def _pin(self):
        """Thread: each filled slot copied out (pinned for CUDA), queued, the slot handed back."""
        process, pin = self.process, self.device.type == "cuda" and torch.cuda.is_available()
        try:
            while True:
                index = self.conn.recv()
                if isinstance(index, BaseException):
                    raise index
                self.room.get()
                self.ready.put(_each_tensor(self.slots[index], lambda t: t.pin_memory() if pin else t.clone()))
                self.conn.send(None)
        except BaseException as error:  # handed to the caller, which re-raises it
            if isinstance(error, (EOFError, OSError)):  # the child is gone
                process.join(1)
                error = RuntimeError(f"prefetch: producer exit code {process.exitcode}")
            self.ready.put(error)

    def shutdown(self):
        """Kill the child process, then wait for the pinning thread, which ends on its EOF."""
        process, self.process = self.process, False
        if process:
            process.kill()
            process.join()
            self.room.put(None)  # wakes a pinning thread waiting for room
            self.thread.join()
