"""Injected runtime: a data-loader generator run ahead in a spawned process (module mode, family `bestfit_packing`).

`patch-prefetch nanochat/dataloader.py` keeps the module's loader generator as
`_original_<name>` and defines `<name>` again, with the same parameters, as
`yield from _spawn_generator(_original_<name>, {every argument by name}, "device", ...)`.

Why a spawned process: nanochat's loader tokenizes (the tokenizer runs its own
threads) and packs documents by best fit in pure Python; on a thread of the training
process that Python would take the GIL from the training loop, and a forked child
would inherit neither the tokenizer's nor pyarrow's threads. A spawned child
(`multiprocessing` "spawn" context) imports the module by name, calls the original
generator with the same arguments (its own resume state among them) but
`device="cpu"`, and sends each batch's host tensors and non-tensor values (the state
dict of THAT batch) through a bounded queue, `queue_depth` batches ahead. The parent
does the pinned copy and the H2D itself, on the current stream, as the original does.

Lifetime: the original yields views of one reused device buffer (valid until the next
`next()`); here each batch has its own pinned staging buffer and device buffer out of a
ring of two, so a batch stays valid for one more `next()` than the original promises.
A pinned buffer is rewritten only after the CUDA event recorded behind its last H2D has
completed (the original refills its one pinned buffer without waiting for the previous
non-blocking copy, a possible race this removes by construction). On the CPU the batch
is a fresh tensor per batch.

Where the child cannot be used (the module runs as `__main__`, the arguments do not
pickle, the child cannot import the module or find the function), the original runs in
this process, exactly, with one line on stderr saying why. `TRAIN_PREFETCH=0` (the
`prefetch` argument) restores the original path. The child's exception is raised here
at the batch where it happened, with the child's formatted traceback as its cause
(an exception that does not pickle arrives as RuntimeError naming its type). The
child is a daemon: `multiprocessing` terminates it at exit; closing the generator
(or dropping it) terminates it at once; the child ignores SIGINT (Ctrl-C reaches the
parent, whose exit ends it) and leaves by itself when the parent has gone.
"""

import importlib
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import traceback
import types

import torch

from templates.staging import _each_leaf


class _HostTensor:
    """A tensor as it crosses the process boundary: dtype, shape, and its bytes (a numpy uint8 array)."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, tensor):
        tensor = tensor.detach().contiguous()
        self.dtype, self.shape = tensor.dtype, tuple(tensor.shape)
        # A copy: the loader refills its buffers after the yield, and the queue pickles later.
        self.data = tensor.reshape(-1).view(torch.uint8).numpy().copy()

    def tensor(self):
        """The tensor itself, in fresh memory of its own (no copy beyond unpickling)."""
        return torch.from_numpy(self.data).view(self.dtype).view(self.shape)


def _spawn_generator(function, arguments, device_param="device", prefetch=True, queue_depth=2):
    """Yield what `function(**arguments)` yields, built ahead by a spawned process.

    Takes: function: a module-level generator function of an importable module (the
    loader, e.g. yielding `inputs, targets: int64 [B, T]` on `device` and a state dict
    `{pq_idx, rg_idx, epoch}`); arguments: its arguments by parameter name, defaults
    applied; device_param: the name of its device parameter (the child gets "cpu");
    prefetch: bool (`TRAIN_PREFETCH`); queue_depth: batches built ahead (>= 1).
    Yields: each batch of the original, equal bit for bit, in order, with the same
    structure; tensors on `arguments[device_param]`.
    Raises: the child's exception at its batch (cause: the child's traceback);
    RuntimeError when the child dies without a word.
    """
    if not prefetch:
        yield from function(**arguments)
        return
    module_name = getattr(sys.modules.get(function.__module__), "__spec__", None)
    module_name = module_name.name if module_name is not None else function.__module__
    if module_name in ("__main__", "__mp_main__") or getattr(sys.modules.get(module_name), function.__name__, None) is not function:
        yield from _run_here(function, arguments, f"module {function.__module__} cannot be imported by name in a spawned process")
        return
    spawn = multiprocessing.get_context("spawn")
    channel = spawn.Queue(max(1, int(queue_depth)))
    child_arguments = dict(arguments, **{device_param: "cpu"})
    child = spawn.Process(target=_spawn_producer, args=(module_name, function.__name__, child_arguments, channel), daemon=True, name=f"prefetch {function.__name__}")
    main = sys.modules["__main__"]
    # Spawn re-runs the main script in the child unless it is guarded; a training script
    # that trains at top level would train there. The child needs only this module.
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        child.start()
    except Exception as error:  # the arguments do not pickle, no processes to spare
        channel.close()
        yield from _run_here(function, arguments, f"no spawned producer ({type(error).__name__}: {error})")
        return
    finally:
        sys.modules["__main__"] = main
    device = torch.device(arguments[device_param])
    pin = device.type == "cuda" and torch.cuda.is_available()
    ring = [[None, None, None, None], [None, None, None, None]]  # per slot: pinned buffers, device buffers, the event after their H2D, the hand-out
    taken = 0
    try:
        while True:
            message = _receive(channel, child)
            if message[0] == "setup":  # the child could not build the generator: nothing was yielded yet
                yield from _run_here(function, arguments, message[1])
                return
            if message[0] == "end":
                return
            if message[0] == "error":
                raise message[1] from RuntimeError(message[2])
            slot = ring[taken % 2]
            taken += 1
            if pin:
                slot[0:2] = _to_device(message[1], device, slot)
                slot[3] = iter(list(slot[1]))
                slot[2] = torch.cuda.Event()
                slot[2].record()
            yield _each_leaf(message[1], lambda v: _fetch(v, device, slot, pin))
    finally:
        child.terminate()
        child.join(5)
        if child.exitcode is None:
            child.kill()
            child.join()
        channel.close()
        channel.cancel_join_thread()


def _to_device(batch, device, slot):
    """Issue the H2D copies of `batch`'s tensors through this slot's pinned buffers.

    Waits first for the event of the slot's previous H2D: its pinned buffers are not
    rewritten before that copy has read them. Returns (pinned, device) buffer lists.
    """
    if slot[2] is not None:
        slot[2].synchronize()
    pinned, on_device = slot[0] or [], slot[1] or []
    leaves = []
    _each_leaf(batch, lambda v: leaves.append(v) if isinstance(v, _HostTensor) else None)
    for index, leaf in enumerate(leaves):
        host = leaf.tensor()
        if index >= len(pinned) or pinned[index].shape != host.shape or pinned[index].dtype != host.dtype:
            pinned[index:] = [torch.empty(host.shape, dtype=host.dtype, pin_memory=True)]
            on_device[index:] = [torch.empty(host.shape, dtype=host.dtype, device=device)]
        pinned[index].copy_(host)
        on_device[index].copy_(pinned[index], non_blocking=True)
    return pinned, on_device[: len(leaves)]


def _fetch(value, device, slot, pin):
    """One leaf of a received batch as handed out: a tensor on `device`, else the value itself."""
    if not isinstance(value, _HostTensor):
        return value
    if pin:
        return next(slot[3])
    tensor = value.tensor()
    return tensor if device.type == "cpu" else tensor.to(device)


def _receive(channel, child):
    """The child's next message; RuntimeError when the child has died without one."""
    while True:
        try:
            return channel.get(timeout=0.5)
        except queue.Empty:
            if not child.is_alive() and channel.empty():
                raise RuntimeError(f"prefetch: the producer of this loader died (exit code {child.exitcode})") from None


def _run_here(function, arguments, reason):
    """The original generator, in this process, after one line on stderr saying why."""
    print(f"prefetch: {function.__name__} runs in the training process: {reason} (TRAIN_PREFETCH=0 silences this)", file=sys.stderr)
    yield from function(**arguments)


def _spawn_producer(module_name, function_name, arguments, channel):
    """The spawned child: run `module.function(**arguments)` and send every batch, in order.

    Messages: ("setup", reason) when the generator cannot be built; ("batch", batch with
    tensors as `_HostTensor`s); ("error", exception, traceback text) at the batch where
    the generator raised; ("end",) when it returns. Leaves when the parent has gone.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    parent = multiprocessing.parent_process()
    try:
        batches = getattr(importlib.import_module(module_name), function_name)(**arguments)
    except Exception as error:
        return _send(channel, parent, ("setup", f"a spawned producer cannot build it ({type(error).__name__}: {error})"))
    try:
        for batch in batches:
            _send(channel, parent, ("batch", _each_leaf(batch, lambda v: _HostTensor(v) if isinstance(v, torch.Tensor) else v)))
    except BaseException as error:
        text = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:  # rebuilt in the parent only where it pickles both ways
            error = RuntimeError(f"{type(error).__name__}: {error}")
        _send(channel, parent, ("error", error, text))
    else:
        _send(channel, parent, ("end",))
    channel.close()
    channel.join_thread()


def _send(channel, parent, message):
    """Put `message`, waiting for room; exit at once when the parent process is gone."""
    while True:
        try:
            return channel.put(message, timeout=0.5)
        except queue.Full:
            if parent is not None and not parent.is_alive():
                os._exit(0)
