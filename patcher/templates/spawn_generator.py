"""Injected runtime: a data-loader generator run ahead in a spawned process (module mode: the producer of a "module" family's loader generators).

`patch-prefetch nanochat/dataloader.py` keeps the module's loader generator as
`_original_<name>` and defines `<name>` again, with the same parameters, as
`yield from _spawn_generator(_original_<name>, {every argument by name}, "device", ...)`.

Why a spawned process: nanochat's loader tokenizes (the tokenizer runs its own
threads) and packs documents by best fit in pure Python; on a thread of the training
process that Python would take the GIL from the training loop, and a forked child
would inherit neither the tokenizer's nor pyarrow's threads. A spawned child
(`multiprocessing` "spawn" context) imports the module by name, calls the original
generator with the same arguments (its own resume state among them) but
`device="cpu"`, and hands each batch over `queue_depth` batches ahead, as the lean
runtime (`prefetch_lean.py`) does for a forked loader: its tensors are written into
shared-memory slot `n % queue_depth`, and a small message on a socket pair carries the
batch's structure, its non-tensor values (the state dict of THAT batch) and the slot's
number. The parent copies the slot out (into its pinned buffer on CUDA: the H2D source)
and frees it with one byte back on the same socket pair (one byte a free slot, as many
as `queue_depth` written before the start); it does the H2D itself, on the current
stream, as the original does. Nothing has a name in /dev/shm: the slots are an anonymous
file (memfd), and the free slots are counted by bytes on the socket, not by a named
semaphore (`sem_open`, /dev/shm/sem.mp-*), which a full /dev/shm refuses, and which
outlives a run killed with SIGKILL together with the resource tracker that unlinks it
(killed alone, that tracker warns of it at its exit).

The hand-out. Sent whole through a `multiprocessing.Queue`, a batch of nanochat's
default packing sizes (two int64 [8, 512] tensors, 64 KiB) was larger than a pipe's
buffer: each `next()` read half of it and waited for the child to be scheduled to
write the rest (0.7-0.8 ms median with the child ahead, up to 31 ms, on a loaded
2-core host), then unpickled it. Through the slots it is one small read and two copies
(0.35-0.46 ms median, same host). The child runs at nice +10: on a host
without a core to spare, a woken child that has slept preempts the training process
(the kernel favours sleepers), which then waited out the child's batch inside its own
`next()` (about one involuntary switch a hand-out); niced, it yields to the training
loop and takes what the loop leaves. Where cores are free, niceness changes nothing.

Lifetime: the original yields views of one reused device buffer (valid until the next
`next()`); here each batch is a fresh device tensor, copied from the slot into pinned
memory and from there to the device (`_staged_h2d`, the staging every producer shares,
`patcher/templates/staging.py`), so a batch stays valid as long as it is held. torch's caching
host allocator hands a pinned block out again only after the CUDA event recorded behind
its last H2D has completed (the original refills its one pinned buffer without waiting
for the previous non-blocking copy, a possible race this removes by construction). The
H2D is queued on the current stream, as the original's. On the CPU the batch is a fresh
tensor per batch.

Where the child cannot be used (the module runs as `__main__`, the arguments do not
pickle, no descriptors or processes to spare, the child cannot import the module or find
the function, an argument does not unpickle there, the child dies before its first
batch), the original runs in this process, exactly, with one line on stderr saying why. `TRAIN_PREFETCH=0` (the
`prefetch` argument) restores the original path. Only the training split's loader
spawns (`split_param` / `train_split`, where the loader names its splits): a loader of
another split, such as the val loader a training script rebuilds at every evaluation,
runs the original in this process, silently, since a child's start (4.6-6.8 s on a
loaded 2-core host, nearly all importing torch and pyarrow) would cost each evaluation
more than it gives back; `TRAIN_PREFETCH_EVERY_SPLIT=1` (`every_split`) spawns for
every split. The child's exception is raised here
at the batch where it happened, with the child's formatted traceback as its cause
(an exception that does not pickle arrives as RuntimeError naming its type). The
child is a daemon: `multiprocessing` terminates it at exit; closing the generator
(or dropping it) terminates it at once; the child has default signal handlers, as every
producer process (`_producer_setup`), and leaves by itself when the parent has gone.
"""

import importlib
import mmap
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import select
import sys
import traceback
import types

import torch

from patcher.templates.staging import _POLL_S, _STOP_WAIT_S, _each_leaf, _producer_error, _producer_setup, _rebuilt, _staged_h2d

# The producer's niceness: it yields the CPU to the training loop (the module docstring says why).
_PRODUCER_NICE = 10
# Tensors start at multiples of this in a slot: any dtype's view of the slot's bytes is aligned.
_SLOT_ALIGN = 64
# The producers this process spawned, as keys (`_forget_spawned`), and whether the
# fork hook that forgets them is registered (once a process).
_spawned = {}
_fork_hook = []


def _forget_spawned():
    """In a process the script forks from the training process: forget the producers
    it spawned. The fork inherits multiprocessing's list of children; its exit
    (`sys.exit`) would terminate them as its own daemons and then fail to join them ("can
    only join a child process"). They are the training process's, as a forked producer
    is (patcher/templates/prefetch_lean.py acts only in the process that forked it)."""
    multiprocessing.process._children.difference_update(_spawned)
    _spawned.clear()


class _HostTensor:
    """A tensor as it crosses the process boundary: dtype, shape, and where its bytes are:
    at `offset` in the batch's shared-memory slot (`data` None), or in `data` (a numpy
    uint8 array, pickled with the message) where the slot has no room for it."""

    __slots__ = ("dtype", "shape", "data", "offset")

    def __init__(self, tensor, slot=None, offset=0):
        tensor = tensor.detach()
        self.dtype, self.shape, self.offset, self.data = tensor.dtype, tuple(tensor.shape), offset, None
        if slot is not None:
            _view(slot, offset, tensor.dtype, tensor.shape).copy_(tensor)
        else:  # a copy: the loader refills its buffers after the yield
            self.data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().copy()

    def tensor(self, slot):
        """The tensor: a view of `slot` (valid until the slot is freed), or its own memory."""
        if self.data is None:
            return _view(slot, self.offset, self.dtype, self.shape)
        return torch.from_numpy(self.data).view(self.dtype).view(self.shape)


def _slot_bytes(tensor):
    """The bytes `tensor` takes in a slot: its own, rounded up to `_SLOT_ALIGN`."""
    return -(-tensor.numel() * tensor.element_size() // _SLOT_ALIGN) * _SLOT_ALIGN


def _view(slot, offset, dtype, shape):
    """The tensor of `dtype` and `shape` whose bytes start at `offset` of `slot` (uint8)."""
    size = torch.Size(shape).numel() * dtype.itemsize
    return slot[offset : offset + size].view(dtype).view(shape)


def _spawn_generator(function, arguments, device_param="device", prefetch=True, queue_depth=2, split_param=None, train_split=None, every_split=False):
    """Yield what `function(**arguments)` yields, built ahead by a spawned process.

    Takes: function: a module-level generator function of an importable module (the
    loader, e.g. yielding `inputs, targets: int64 [B, T]` on `device` and a state dict
    `{pq_idx, rg_idx, epoch}`); arguments: its arguments by parameter name, defaults
    applied; device_param: the name of its device parameter (the child gets "cpu");
    prefetch: bool (`TRAIN_PREFETCH`); queue_depth: batches built ahead (>= 1);
    split_param, train_split: the parameter naming the split and its training value
    (`"split"`, `"train"`): a build whose split is another (`"val"`) runs `function` here,
    as the original, unless every_split (`TRAIN_PREFETCH_EVERY_SPLIT`); None: every
    build spawns.
    Yields: each batch of the original, equal bit for bit, in order, with the same
    structure; tensors on `arguments[device_param]`.
    Raises: the child's exception at its batch (cause: the child's traceback);
    RuntimeError when the child dies without a word after the first batch.
    """
    if not prefetch or (split_param is not None and not every_split and arguments.get(split_param) != train_split):
        # Another split's loader (nanochat rebuilds the val loader at every evaluation and
        # draws a few dozen batches from it): a child's start, seconds of importing torch
        # and pyarrow, would cost more than running ahead gives back.
        yield from function(**arguments)
        return
    module_name = getattr(sys.modules.get(function.__module__), "__spec__", None)
    module_name = module_name.name if module_name is not None else function.__module__
    if module_name in ("__main__", "__mp_main__") or getattr(sys.modules.get(module_name), function.__name__, None) is not function:
        yield from _run_here(function, arguments, f"module {function.__module__} cannot be imported by name in a spawned process")
        return
    spawn = multiprocessing.get_context("spawn")
    depth = max(1, int(queue_depth))
    main, sender, refused = sys.modules["__main__"], None, None
    # Spawn re-runs the main script in the child unless it is guarded; a training script
    # that trains at top level would train there. The child needs only this module.
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        # Each argument pickled here and unpickled by the child itself, which can then say
        # which one fails there (unpickled by multiprocessing, it would end the child first).
        pickled = {name: pickle.dumps(value) for name, value in dict(arguments, **{device_param: "cpu"}).items()}
        receiver, sender = spawn.Pipe(True)  # a socket pair: it carries the slots' file descriptor too
        os.write(receiver.fileno(), bytes(depth))  # the free slots: one byte each, the child takes one a batch
        child = spawn.Process(target=_spawn_producer, args=(module_name, function.__name__, pickled, sender, depth), daemon=True, name=f"prefetch {function.__name__}")
        child.start()
    except Exception as error:  # an argument does not pickle, no descriptors or processes to spare
        refused = f"no spawned producer ({type(error).__name__}: {error})"
        if sender:
            receiver.close()
    finally:
        sys.modules["__main__"] = main  # before any batch: the fallback runs with the script's own
        if sender:
            sender.close()  # the child's end: closed here, so that the child's exit is an end of file
    if refused:
        yield from _run_here(function, arguments, refused)
        return
    if not _fork_hook:
        _fork_hook.append(os.register_at_fork(after_in_child=_forget_spawned))
    owner = os.getpid()
    _spawned[child] = owner
    device = torch.device(arguments[device_param])
    pin = device.type == "cuda" and torch.cuda.is_available()
    slots, first = None, True  # first: no batch received yet
    readable = select.poll()  # one poll object: a `Connection.poll` builds a selector per call
    readable.register(receiver, select.POLLIN)
    try:
        while True:
            message = _receive(receiver, readable, child, first)
            if message[0] == "slots":  # once, before the first batch: the size of a slot (0: no slots)
                slots = _map_slots(multiprocessing.reduction.recv_handle(receiver), message[1], depth) if message[1] else None
                continue
            if message[0] == "setup":  # the child could not build the generator: nothing was yielded yet
                yield from _run_here(function, arguments, message[1])
                return
            if message[0] == "end":
                return
            if message[0] == "error":
                raise _rebuilt(message[1]) from RuntimeError(message[2])
            first = False
            shared = slots[message[2]] if slots is not None else None
            leaves = []
            _each_leaf(message[1], lambda v: leaves.append(v) if isinstance(v, _HostTensor) else None)
            host = [leaf.tensor(shared) for leaf in leaves]
            if pin:  # out of the shared slot straight into pinned memory, then the H2D, on the current stream as the original's
                handed = iter([_staged_h2d(t, device, copy_stream=False) for t in host])
            elif device.type == "cpu":  # fresh memory per batch: a view of the shared slot is copied out
                handed = iter([t.clone() if leaf.data is None else t for leaf, t in zip(leaves, host)])
            else:
                handed = iter([t.to(device) for t in host])
            try:
                os.write(receiver.fileno(), b"\0")  # the slot is copied out: the child may refill it
            except OSError:  # the child has ended after its last batch: its last messages are still to read
                pass
            yield _each_leaf(message[1], lambda v: next(handed) if isinstance(v, _HostTensor) else v)
    finally:
        if os.getpid() == owner:  # not in a process the script forked (`_forget_spawned`)
            _spawned.pop(child, None)
            child.terminate()
            child.join(_STOP_WAIT_S)
            if child.exitcode is None:
                child.kill()
                child.join()
        receiver.close()


def _receive(receiver, readable, child, first):
    """The child's next message; when the child has died without one, a "setup" message
    saying so before the `first` batch (the original runs here), else RuntimeError.

    readable: a `select.poll` object with `receiver` registered."""
    while not readable.poll(_POLL_S * 1000):
        if not child.is_alive() and not receiver.poll():
            break
    try:
        return receiver.recv()
    except (EOFError, ConnectionResetError):  # the child is gone (reset: it left bytes of free slots unread)
        child.join(_STOP_WAIT_S)
        if first:  # it died unpickling its own start (its traceback is on stderr), or killed
            return "setup", f"its spawned producer died before its first batch (exit code {child.exitcode})"
        raise RuntimeError(f"prefetch: the producer of this loader died (exit code {child.exitcode})") from None


def _run_here(function, arguments, reason):
    """The original generator, in this process, after one line on stderr saying why."""
    print(f"prefetch: {function.__name__} runs in the training process: {reason} (TRAIN_PREFETCH=0 silences this)", file=sys.stderr)
    yield from function(**arguments)


def _spawn_producer(module_name, function_name, pickled, sender, depth):
    """The spawned child: run `module.function(**arguments)` and hand every batch over, in order.

    pickled: the arguments by name, each pickled. Batch n's tensors are written into
    shared-memory slot `n % depth` (`_make_slots`: allocated after the first batch, sized
    by it), after the byte of a free slot is read from `sender`; the
    message that follows carries the batch's structure, its non-tensor values (the state
    dict of THAT batch) and the slot's number, a few hundred bytes that one write of the
    pipe delivers (a batch of 64 KiB pickled filled the pipe, and each hand-out then
    waited for the child to be scheduled to write the rest). A tensor the slot has no
    room for (a batch larger than the first) travels in the message. Messages: ("slots", slot bytes) once, then the descriptor;
    ("batch", batch with tensors as `_HostTensor`s, slot); ("setup", reason) when an
    argument does not unpickle here or the generator cannot be built; ("error", exception, traceback text) at the batch where
    the generator raised; ("end",) when it returns. Leaves when the parent has gone.
    """
    _producer_setup()  # default signal handlers, one torch thread
    os.nice(_PRODUCER_NICE)  # before the loader starts its threads: they inherit it
    parent = multiprocessing.parent_process()
    arguments = {}
    try:
        for name, value in pickled.items():  # one by one, to name the one that fails
            reason = f"its argument {name} does not unpickle in a spawned producer"
            arguments[name] = pickle.loads(value)
        reason = "a spawned producer cannot build it"
        batches = getattr(importlib.import_module(module_name), function_name)(**arguments)
    except Exception as error:
        return _send(sender, ("setup", f"{reason} ({type(error).__name__}: {error})"))
    slots, size, n = None, 0, 0
    try:
        while True:
            while not sender.poll(_POLL_S):  # a free slot: a byte from the parent
                if parent is not None and not parent.is_alive():
                    os._exit(0)
            if not os.read(sender.fileno(), 1):  # an end of file: the parent has gone (a reset raises, and so ends too)
                os._exit(0)
            batch = next(batches, _END)
            if batch is _END:
                break
            if n == 0:  # the first batch sizes the slots
                tensors = []
                _each_leaf(batch, lambda v: tensors.append(v) if isinstance(v, torch.Tensor) else None)
                size = sum(_slot_bytes(t) for t in tensors)
                slots = _make_slots(sender, size, depth) if size else None
            slot, offset = slots[n % depth] if slots is not None else None, [0]

            def host(value):
                if not isinstance(value, torch.Tensor):
                    return value
                start = offset[0]
                offset[0] += _slot_bytes(value)
                return _HostTensor(value, slot if slot is not None and offset[0] <= size else None, start)

            _send(sender, ("batch", _each_leaf(batch, host), n % depth))
            n += 1
    except BaseException as error:  # re-raised in the parent, as itself, its traceback its cause
        _send(sender, ("error", _producer_error(error), traceback.format_exc()))
    else:
        _send(sender, ("end",))


_END = object()


def _make_slots(sender, size, depth):
    """`depth` slots of `size` bytes in one anonymous shared file (memfd), its descriptor
    sent to the parent after the message ("slots", size); ("slots", 0) and None where there
    is no such file (not Linux, no memory): the tensors then travel in the messages. The
    file has no name and goes when both processes have unmapped it."""
    try:
        fd = os.memfd_create("prefetch-slots")
    except (AttributeError, OSError):
        return _send(sender, ("slots", 0))
    try:
        os.ftruncate(fd, size * depth)
    except OSError:
        os.close(fd)
        return _send(sender, ("slots", 0))
    _send(sender, ("slots", size))
    try:
        multiprocessing.reduction.send_handle(sender, fd, os.getppid())
    except OSError:  # the parent has gone
        os._exit(0)
    return _map_slots(fd, size, depth)


def _map_slots(fd, size, depth):
    """The file `fd` mapped as `depth` uint8 tensors of `size` bytes; closes `fd` (the
    mapping keeps the file). The parent maps the descriptor it receives with this too."""
    try:
        memory = mmap.mmap(fd, size * depth)
    finally:
        os.close(fd)
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    return [whole[i * size : (i + 1) * size] for i in range(depth)]


def _send(sender, message):
    """Send `message`; exit at once when the parent process is gone (its end is closed)."""
    try:
        sender.send(message)
    except (BrokenPipeError, ConnectionResetError):
        os._exit(0)
