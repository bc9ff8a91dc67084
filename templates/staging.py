"""Injected runtime: the staging piece every producer shares (features `train_prefetch`,
`pinned_staging`): the process producer and the thread producer
(`templates/prefetch_lean.py`), the per-step-argument thread
(`templates/prefetch_loader.py`), pinned staging of
generators (`templates/pinned_staging.py`) and the spawned generator
(the same process producer started by spawn).

- The structure walk (`_each_leaf`, `_each_tensor`): a batch of any structure;
  `_spans`: the bytes its tensors cover, one span for those that overlap.
- The H2D of a host tensor (`_staged_h2d`): copied into pinned memory that torch's
  caching host allocator reuses only once the CUDA event behind its last copy has
  completed, then queued on the copy stream (`wait_stream`, `record_stream`); `_stage`:
  a fresh (pinned) host copy for a batch queued on a thread.
- A producer's life: its signal handlers and threads (`_producer_setup`), how its
  exception travels (`_producer_error` there, `_rebuilt` here), how often a waiter
  wakes to see whether the other side is still there (`_POLL_S`), and how long a
  producer told to stop is waited for (`_STOP_WAIT_S`).
"""

import dataclasses
import pickle
import signal

import torch

from patcher.templates.copy_stream import _h2d

# Every producer and its caller: a wait for a batch, or for room, wakes this often (s)
# to see whether the other side is still there (an idle producer wakes 20 times a second).
_POLL_S = 0.05
# The most a producer told to stop is waited for (s): a thread at exit (a daemon thread
# still inside a torch op when Python finalizes aborts the process: std::terminate, exit
# code 134), a spawned child before it is killed. Long enough for a batch or a shard load
# in progress, short enough that Ctrl-C with a producer stuck in a read still ends the
# process promptly.
_STOP_WAIT_S = 3


def _each_leaf(item, fn):
    """`item` rebuilt with `fn` applied to each leaf.

    A batch is whatever the loader returns: tuples, lists, dicts, namedtuples and
    dataclass instances are walked (rebuilt with their own type, as torch.utils.data's
    pin_memory and collate code does); anything else (a tensor, a numpy array, a Python
    scalar, a string, None) is a leaf.
    """
    if isinstance(item, dict):
        return type(item)((k, _each_leaf(v, fn)) for k, v in item.items())
    if isinstance(item, tuple) and hasattr(item, "_fields"):  # a namedtuple
        return type(item)(*(_each_leaf(v, fn) for v in item))
    if isinstance(item, (tuple, list)):
        return type(item)(_each_leaf(v, fn) for v in item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return dataclasses.replace(item, **{f.name: _each_leaf(getattr(item, f.name), fn) for f in dataclasses.fields(item) if f.init})
    return fn(item)


def _each_tensor(item, fn):
    """`item` (a batch of any structure, see `_each_leaf`) with `fn` applied to each tensor."""
    return _each_leaf(item, lambda v: fn(v) if isinstance(v, torch.Tensor) else v)


def _spans(tensors):
    """The bytes to carry for `tensors` (a batch's, CPU): [storage address, first byte,
    end byte, the tensors over them] each, in order of storage and first byte: one span for
    tensors whose bytes overlap in one storage, else one a tensor. The first byte rounded
    down to a multiple of 64, so that a span keeps its storage's alignment in a slot."""
    spans = []
    for t in sorted(tensors, key=lambda t: (t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size())):
        p, lo = t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size()
        hi = lo + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size() * (t.numel() > 0)
        if spans and spans[-1][0] == p and lo < spans[-1][2]:
            spans[-1][2:] = max(spans[-1][2], hi), spans[-1][3] + [t]
        else:
            spans.append([p, lo - lo % 64, hi, [t]])
    return spans


def _stage(item, pin, host_copy=True):
    """The host tensors of one batch in fresh (pinned when `pin`) memory.

    A copy, so that a loader that reuses its buffers cannot change a queued batch;
    tensors whose bytes overlap in one storage (`x, y = t[:-1], t[1:]`) are copied as one
    span (`_spans`) and overlap the same way in the copy, with their strides. With
    `host_copy=False` and no pinning the batch is returned as it is.
    """
    if not (pin or host_copy):
        return item
    tensors = []
    _each_tensor(item, lambda t: t.device.type == "cpu" and tensors.append(t))
    copies = _span_copies(_spans(tensors), pin)
    return _each_tensor(item, lambda t: copies.get(id(t), t))


def _span_copies(spans, pin=False):
    """{id(tensor): its copy} for the tensors of `spans` (`_spans`): each span copied once
    (into pinned memory when `pin`), its tensors views of the copy at the same distances
    and strides, so tensors that overlap in the original overlap the same way."""
    copies = {}
    for _, lo, hi, over in spans:
        span = torch.empty((hi - lo,), dtype=torch.uint8, pin_memory=pin).copy_(torch.empty(0, dtype=torch.uint8).set_(over[0].untyped_storage(), lo, (hi - lo,)))
        copies.update((id(t), torch.empty(0, dtype=t.dtype).set_(span.untyped_storage(), (t.storage_offset() * t.element_size() - lo) // t.element_size(), t.shape, t.stride())) for t in over)
    return copies


def _staged_h2d(tensor, device, copy_stream=True):
    """`tensor.to(device, non_blocking=True)` for a CPU tensor and a CUDA `device`, made
    asynchronous: a new device tensor, equal to `tensor`.

    The tensor is copied (on the host) into a new block of pinned memory from torch's
    caching host allocator (`pin_memory=True`: a copy even of a tensor that is pinned
    already, which its loader may rewrite), and the H2D copy is queued from there (`_h2d`: on the
    copy stream when `copy_stream`, which the compute stream `wait_stream`s on, with
    `record_stream` keeping the result from early reuse); the host does not wait. The
    allocator records an event behind each copy from one of its blocks and hands the
    block out again only once that event has completed: a pinned buffer is never
    rewritten while its copy may still read it, and the source may change right after
    the call (a shared-memory slot the producer refills, a buffer the loader reuses).
    Anything else (not a CPU tensor, not CUDA, CUDA not available): `tensor.to(device,
    non_blocking=True)`, the original call.
    Pattern: torch.utils.data's pin-memory thread, with the copy on a side stream as in
    NVIDIA Apex's data_prefetcher.
    """
    if tensor.device.type != "cpu" or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return tensor.to(device, non_blocking=True)
    return _h2d(torch.empty_like(tensor, pin_memory=True).copy_(tensor), device, copy_stream)


def _producer_setup():
    """First thing in a producer process (forked or spawned): the script's signal
    handlers must not run there (one that ignores SIGTERM would keep the child alive),
    and torch runs on one thread (a forked OpenMP team does not exist in the child; the
    loader's tensor work is small copies). SIGINT too: Ctrl-C reaches the whole
    foreground process group, and the training process handles its own; Python's
    default would raise KeyboardInterrupt inside the loader, to come back as the
    loader's error. The training process ends its producer at exit."""
    for signum in signal.SIGTERM, signal.SIGINT, signal.SIGHUP:
        signal.signal(signum, signal.SIG_DFL)
    torch.set_num_threads(1)


def _producer_error(error):
    """The exception `error`, as a producer process sends it: (class, its first built-in
    class, args, state), rebuilt in the training process by `_rebuilt`. The args and
    state are those the built-in class pickles (its `__reduce__`): a FileNotFoundError's
    filename, an ImportError's name, the `__dict__` of a script's own class travel; a
    script's own `__reduce__` is not used (it may expect its own `__init__`). As
    torch.utils.data's ExceptionWrapper, its formatted traceback travels beside it. One
    whose parts do not pickle (a local class, a lock among its attributes) travels as a
    RuntimeError naming its type and args."""
    kind = type(error)
    base = next(c for c in kind.__mro__ if c.__module__ == "builtins")
    sent = (kind, base, *base.__reduce__(error)[1:], {})[:4]
    try:
        pickle.dumps(sent)
    except Exception:
        sent = RuntimeError, RuntimeError, (f"prefetch: {kind.__qualname__} in the producer: {' '.join(map(str, error.args))}",), {}
    return sent


def _rebuilt(error):
    """The producer's exception from its (class, built-in class, args, state)
    (`_producer_error`), as pickle rebuilds it, but with the built-in class's
    `__init__`, not its own (a script's `ShardError.__init__(self, shard, call)` takes
    other arguments than its args): the script's own `except ShardError:` still catches
    it, and the fields a built-in class sets in its constructor from its args are there
    (SystemExit.code: the exit status and message; StopIteration.value; OSError's errno,
    strerror, filename, filename2; UnicodeDecodeError's text and range), so that the
    last line the user reads is the original's."""
    kind, base, args, state = error
    error = kind.__new__(kind, *args)  # BaseException's (or OSError's) __new__ sets args
    base.__init__(error, *args)
    error.__setstate__(state)  # as pickle: each attribute set (ImportError's name and path are not in __dict__)
    return error
