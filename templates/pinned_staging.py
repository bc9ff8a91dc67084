"""Injected runtime: a data generator's H2D copies made asynchronous through pinned memory (feature `pinned_staging`).

For a generator that builds each batch on the training thread and sends it to the GPU
itself (modded-nanogpt's `distributed_data_generator`, 2026: shards loaded by its own
threads, batches built inline), each

    _inputs.to(device="cuda", non_blocking=True)

becomes

    _pinned_h2d(_inputs, "cuda", staging=..., copy_stream=...)

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
values copied are the tensor's. Anything that is not a CPU tensor, a device other than
CUDA, CUDA not available, or `staging=False`: the original
`value.to(device=device, non_blocking=True)`.
"""

import torch

from templates.staging import _each_leaf, _staged_h2d


def _pinned_h2d(value, device, staging=True, copy_stream=True):
    """`value.to(device=device, non_blocking=True)`, through pinned memory on CUDA.

    Takes: value: a tensor (or a batch of any structure, see `_each_leaf`: its tensors
    are copied, other leaves returned as they are); device: what `.to(device=...)`
    takes; staging: bool (`TRAIN_PINNED_STAGING`); copy_stream: bool
    (`TRAIN_COPY_STREAM`), the copy on the dedicated copy stream, else on the current
    stream.
    Returns: the same structure, each tensor on `device` with the same dtype, shape and
    values. On a host without CUDA, for another device or with staging off: exactly
    the original call.
    """
    return _each_leaf(value, lambda t: (_staged_h2d(t, device, copy_stream) if staging else t.to(device=device, non_blocking=True)) if isinstance(t, torch.Tensor) else t)
