"""Injected runtime: host staging of one batch (features `train_prefetch`), shared by
`templates/prefetch_lean.py` and `templates/prefetch_loader.py`; and the rebuild of an
exception that a producer process sent (`_rebuilt`), shared by the process producers.

A batch built ahead is copied into fresh host memory, pinned when it goes to CUDA, so
that its H2D copy can run asynchronously on the copy stream and a loader that reuses
its buffers cannot change a batch already queued.
"""

import dataclasses

import torch


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


def _stage(item, pin, host_copy=True):
    """The host tensors of one batch in fresh (pinned when `pin`) memory.

    A copy, so that a loader that reuses its buffers cannot change a queued batch;
    with `host_copy=False` and no pinning the batch is returned as it is.
    """
    if not (pin or host_copy):
        return item
    return _each_tensor(item, lambda t: t if t.device.type != "cpu" else torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t))


def _rebuilt(error):
    """The producer's exception from its (class, args, __dict__), made without calling
    `__init__` (which may take other arguments than its args), so that the script's
    own `except ShardError:` still catches it."""
    kind, args, state = error
    error = kind.__new__(kind, *args)  # BaseException's (or OSError's) __new__ sets args
    error.__dict__.update(state)
    return error
