"""Injected runtime: a data generator's H2D copies made asynchronous through pinned memory (feature `pinned_staging`).

For a generator that builds each batch on the training thread and sends it to the GPU
itself (modded-nanogpt's `distributed_data_generator`, 2026: shards loaded by its own
threads, batches built inline), each

    _inputs.to(device="cuda", non_blocking=True)

becomes

    _pinned_h2d(_inputs, device="cuda", staging=..., copy_stream=...)

(the target passed as the original passes it: positionally or as `device=`).

Why: a `.to("cuda", non_blocking=True)` from pageable memory is not asynchronous: the
host stages the bytes through a driver buffer and waits for the copy, which waits
behind every kernel already queued on the stream, so once per batch the CPU stops
running ahead of the GPU. Here the tensor is copied (on the host) into pinned memory
and the H2D copy from it is queued on the copy stream: the host does not wait. The
compute stream `wait_stream`s on the copy stream and `record_stream` keeps the caching
allocator from reusing the result early.

Buffers: the staging every producer shares (`_staged_h2d`, `templates/staging.py`):
blocks of torch's caching host allocator, which records an event behind each copy from
a block and hands the block out again only once that event has completed, so a buffer
is never rewritten while its copy may still read it, whatever the batch size after a
`.send(...)`.

Exact: the generator runs where and when the original does, in the same order; the
values copied are the tensor's. Anything else is the original
`value.to(*args, non_blocking=True, **kwargs)`, with the call's own arguments: a
receiver that is not a plain `torch.Tensor` (a batch object with its own `.to()`, a
tensor subclass), a target that is not a device (a dtype or a tensor, where the rewrite
could not tell), `staging=False`; and, inside `_staged_h2d`, a tensor not on the CPU,
a device other than CUDA, or CUDA not available.
"""

import torch

from patcher.templates.staging import _staged_h2d


def _pinned_h2d(value, *args, staging=True, copy_stream=True, **kwargs):
    """`value.to(*args, non_blocking=True, **kwargs)`, through pinned memory on CUDA.

    Takes: value: what the original `.to(...)` was called on; args, kwargs: that call's
    arguments other than non_blocking, its target alone (positional, or `device=`);
    staging: bool (`TRAIN_PINNED_STAGING`); copy_stream: bool (`TRAIN_COPY_STREAM`),
    the copy on the dedicated copy stream, else on the current stream.
    Returns: for a plain tensor and a device (a str or a `torch.device`), a tensor on
    it with the same dtype, shape and values; for anything else, with staging off, or
    on a host without CUDA, whatever the original call returns (it raises what that
    call raises).
    """
    # One target, whichever way it was passed (the rewrite passes no other).
    device, = args or kwargs.values()
    if staging and type(value) is torch.Tensor and isinstance(device, (str, torch.device)):
        return _staged_h2d(value, device, copy_stream)
    return value.to(*args, non_blocking=True, **kwargs)
