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
in that state, keeps calling its `next_batch` with the same arguments and writes batch
n into shared-memory slot `n % queue_depth`. Two semaphores count the filled slots and
the free ones. `next_batch` takes the next filled slot, copies it into fresh memory
(pinned when the batch goes to CUDA), frees the slot and does the H2D copy (`_h2d`: on
the copy stream when enabled). Only the child advances the loader, with exactly the
calls the original makes, so the batches are bit-identical.

Why a process, and why no thread in the training process: a host-bound training loop
launches thousands of kernels a step, each a torch call that releases and re-takes
the GIL. A producer thread running the loader's Python between them delays every
launch, so the loop's wait falls while its step grows (bench `--main-thread op-bound`:
a thread running the loader recovered 25-45 % of the original's data time as a
shorter step; a thread that only pinned the child's batches still slowed the op loop
by 2-4 %). The child holds no GIL of the training process. The hand-out costs one
semaphore operation each way (an atomic operation, no system call while the batch is
ready and the child is not asleep on it) and one copy of the batch. The child waits
for a free slot by polling every 0.5 ms rather than sleeping on the semaphore: a
sleeping waiter would make every hand-out a system call to wake it (measured in bench
op-bound mode on a ShuffledSequenceLoader record: 0.11 ms a hand-out against 0.08),
and the child is `queue_depth` batches ahead, so the delay costs nothing. The semaphores order the
memory too: a slot is read only after the child filled it and rewritten only after
the copy. This is the design of PyTorch's DataLoader (forked workers into shared
memory), for a loader whose order must not change.

Contracts: at most `queue_depth` batches are built ahead (in the slots); a child's
exception is re-raised in the caller at the batch where it happened, with the child's
traceback as its cause (an exception that cannot be rebuilt in the caller arrives as
a RuntimeError naming its type, with that cause); a child that dies (killed, out of memory) raises RuntimeError
with its exit code; building the loader again for the same variable (the warm-up
reset) kills the previous child first; children are daemons, terminated at exit, and
leave by themselves when the training process is gone. Arguments that differ from the
first call's, a batch whose tensor shapes differ from the first batch's, or a
`next_batch` after `shutdown()` raise RuntimeError: they cannot happen where this
runtime is injected, and would otherwise hand out wrong batches. The child never
touches CUDA (the loader is built on the CPU) and runs torch on one thread (a forked
OpenMP team would hang). Needs the `fork` start method (Linux).
Scripts with per-step arguments, attribute reads or the producer tuning toggles get
`templates/prefetch_loader.py` instead.
"""

import itertools
import multiprocessing
import os
import pickle
import time
import traceback

import torch

from templates.copy_stream import _h2d
from templates.staging import _each_leaf, _each_tensor

# One live prefetcher per loader variable: building a new one shuts the old one down.
_live_prefetchers = {}


def _make_train_loader(make_loader, device, prefetch=True, queue_depth=2, copy_stream=True, name="train_loader"):
    """Build the training loader, prefetching when `prefetch` is on.

    Takes: make_loader: `device -> loader`, the script's own construction expression;
    device: where batches must end up; prefetch: bool (`TRAIN_PREFETCH`); queue_depth:
    int >= 1, batches built ahead (`TRAIN_PREFETCH_QUEUE`); copy_stream: bool
    (`TRAIN_COPY_STREAM`); name: the variable's name, so that a rebuild shuts the
    previous producer down first.
    Returns: `make_loader(device)` itself when prefetch is off (the original
    behaviour), else a `_PrefetchLoader`.
    """
    old = _live_prefetchers.pop(name, None)
    if old:
        old.shutdown()
    if not prefetch:
        return make_loader(device)
    loader = _live_prefetchers[name] = _PrefetchLoader(make_loader(torch.device("cpu")), torch.device(device), queue_depth, copy_stream)
    return loader


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
        self.depth, self.taken = max(1, int(queue_depth)), 0

    def next_batch(self, *args):
        if self.process is None:  # the first call (shutdown() leaves False)
            self.args = args
            batch = self.loader.next_batch(*args)  # the first batch here; the child goes on from this state
            self.slots = [_each_tensor(batch, lambda t: torch.empty_like(t).share_memory_()) for _ in range(self.depth)]
            self.values = []  # the first batch's non-tensor leaves: none means no batch has any
            self.layout = _layout(batch, self.values)
            fork = multiprocessing.get_context("fork")
            self.filled, self.free, (self.conn, self.sender), (self.value_conn, self.value_sender) = fork.Semaphore(0), fork.Semaphore(self.depth), fork.Pipe(False), fork.Pipe(False)
            self.process = fork.Process(target=self._produce, args=(os.getpid(),), daemon=True)
            self.process.start()
            self.sender.close()  # the child's ends: closed here, so the child's exit is an end of file
            self.value_sender.close()
        elif args != self.args or not self.process:
            raise RuntimeError(f"prefetch: next_batch{args} after next_batch{self.args} or shutdown")
        else:
            while not self.filled.acquire(timeout=0.1):
                code = self.process.exitcode  # before the poll: a child that is gone has sent all it will
                try:
                    error = self.conn.poll() and self.conn.recv()
                except EOFError:  # gone without a word
                    error = None
                if error or code is not None:
                    self.shutdown()
                    if error:  # (the exception, the child's formatted traceback)
                        raise error[0] from RuntimeError(error[1])
                    raise RuntimeError(f"prefetch: producer exit code {code}")
            pin = self.device.type == "cuda" and torch.cuda.is_available()
            # Each batch's own non-tensor values (a counter, a state dict's ints, a
            # string) come through a pipe, in order, beside its tensors in the slot.
            values = iter(self.value_conn.recv() if self.values else ())
            batch = _each_leaf(self.slots[self.taken % self.depth], lambda v: (v.pin_memory() if pin else v.clone()) if isinstance(v, torch.Tensor) else next(values))
            self.taken += 1
            self.free.release()
        return _each_tensor(batch, lambda t: _h2d(t, self.device, self.copy_stream))

    def _produce(self, parent):
        """The child process: `next_batch(*self.args)` into the slots in turn, forever.

        Takes a free slot (`free`), fills it, counts it filled (`filled`). An exception is
        sent on the pipe instead, with its traceback, and ends the child; so does the
        training process's exit (the child's parent is no longer `parent`).
        """
        torch.set_num_threads(1)  # the parent's OpenMP team does not exist in a forked child
        try:
            for slot in itertools.cycle(self.slots):
                while not self.free.acquire(False):
                    if os.getppid() != parent:
                        return
                    time.sleep(0.0005)
                batch, values, into, built = self.loader.next_batch(*self.args), [], [], []
                layout = _layout(batch, values)
                if layout != self.layout:
                    raise RuntimeError(f"prefetch: batch structure {layout} is not the first batch's {self.layout}; set TRAIN_PREFETCH=0")
                _each_tensor(slot, into.append)
                _each_tensor(batch, built.append)
                for tensor, new in zip(into, built):
                    tensor.copy_(new)
                self.filled.release()
                if self.values:  # after the release: the caller reads it then (a value larger than the pipe's buffer cannot block the child)
                    self.value_sender.send(values)
        except BaseException as error:  # re-raised in the training process
            # As torch.utils.data's ExceptionWrapper: the exception travels with its
            # formatted traceback, which becomes its cause there. One that the caller
            # could not rebuild (it does not pickle, or its class cannot be rebuilt from
            # its args: an `__init__` with other required arguments) travels as a
            # RuntimeError naming its type, not as an error of the pipe.
            try:
                pickle.loads(pickle.dumps(error))
            except Exception:
                error = RuntimeError(f"prefetch: {type(error).__qualname__} in the producer")
            self.sender.send((error, traceback.format_exc()))  # the exception this block handles

    def shutdown(self):
        """Kill the child process and wait for it."""
        process, self.process = self.process, False
        if process:
            process.kill()
            process.join()


def _layout(batch, values):
    """The layout of a batch, which every batch must share with the first: its
    structure with each tensor as (dtype, shape) and each other leaf as its type. Its
    non-tensor leaves, which each batch carries for itself, are appended to `values`."""
    return _each_leaf(batch, lambda v: (v.dtype, v.shape) if isinstance(v, torch.Tensor) else values.append(v) or type(v))
