"""Injected runtime: host staging of one batch (features `train_prefetch`), shared by
`templates/prefetch_lean.py` and `templates/prefetch_loader.py`.

A batch built ahead is copied into fresh host memory, pinned when it goes to CUDA, so
that its H2D copy can run asynchronously on the copy stream and a loader that reuses
its buffers cannot change a batch already queued.
"""

import torch


def _each_tensor(item, fn):
    """`item` (a tensor, or tuples and lists of them and of other values) with `fn` applied to each tensor."""
    if isinstance(item, torch.Tensor):
        return fn(item)
    if isinstance(item, (tuple, list)):
        return type(item)(_each_tensor(t, fn) for t in item)
    return item


def _stage(item, pin, host_copy=True):
    """The host tensors of one batch in fresh (pinned when `pin`) memory.

    A copy, so that a loader that reuses its buffers cannot change a queued batch;
    with `host_copy=False` and no pinning the batch is returned as it is.
    """
    if not (pin or host_copy):
        return item
    return _each_tensor(item, lambda t: t if t.device.type != "cpu" else torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t))
