"""Injected runtime: a data generator's H2D copies through reused pinned buffers (feature `pinned_staging`).

For a generator that builds each batch on the training thread and sends it to the GPU
itself (modded-nanogpt's `distributed_data_generator`, 2026: shards loaded by its own
threads, batches built inline), each

    _inputs.to(device="cuda", non_blocking=True)

becomes

    _pinned_h2d(_inputs, "cuda", 0, staging=..., copy_stream=...)

Why: a `.to("cuda", non_blocking=True)` from pageable memory is not asynchronous: the
host stages the bytes through a driver buffer and waits for the copy, which waits
behind every kernel already queued on the stream, so once per batch the CPU stops
running ahead of the GPU. Here the tensor is copied (on the host) into a pinned buffer
that is kept and reused, and the H2D copy from it is queued on the copy stream: the
host does not wait. The compute stream `wait_stream`s on the copy stream and
`record_stream` keeps the caching allocator from reusing the result early.

Buffers: each call site (`slot`) and each tensor leaf of what it copies has a ring of
`_RING` pinned buffers, used in turn, made on first use and made again when the shape
or dtype changes (a new batch size after `.send(...)`). A CUDA event recorded after
each H2D copy fences its buffer: before the buffer is written again the host waits
for that event, so a buffer is never rewritten while its copy may still read it.

Exact: the generator runs where and when the original does, in the same order; the
values copied are the tensor's. Anything that is not a contiguous CPU tensor, a
device other than CUDA, CUDA not available, or `staging=False`: the original
`value.to(device=device, non_blocking=True)`.
"""

import itertools

import torch

from templates.copy_stream import _copy_stream_of
from templates.staging import _each_leaf

# Pinned buffers per call site and leaf: a buffer is written again only after the
# `_RING - 1` copies queued after its own.
_RING = 3
_staging_rings = {}


def _pinned_h2d(value, device, slot, staging=True, copy_stream=True):
    """`value.to(device=device, non_blocking=True)`, through reused pinned buffers on CUDA.

    Takes: value: a tensor (or a batch of any structure, see `_each_leaf`: its tensors
    are copied, other leaves returned as they are); device: what `.to(device=...)`
    takes; slot: a key naming the call site (its buffers); staging: bool
    (`TRAIN_PINNED_STAGING`); copy_stream: bool (`TRAIN_COPY_STREAM`), the copy on
    the dedicated copy stream, else on the current stream.
    Returns: the same structure, each tensor on `device` with the same dtype, shape and
    values. On a host without CUDA, for another device or with staging off: exactly
    the original call.
    """
    device = torch.device(device)
    if not staging or device.type != "cuda" or not torch.cuda.is_available():
        return _each_leaf(value, lambda t: t.to(device=device, non_blocking=True) if isinstance(t, torch.Tensor) else t)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    leaves = itertools.count()
    return _each_leaf(value, lambda t: _staged(t, device, (slot, next(leaves)), copy_stream) if isinstance(t, torch.Tensor) else t)


def _staged(tensor, device, key, copy_stream):
    """One tensor to CUDA `device` (with an index) through the ring of buffers `key`."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return tensor.to(device=device, non_blocking=True)
    ring = _staging_rings.setdefault(key, [0] + [None] * _RING)
    turn = ring[0] % _RING + 1
    ring[0] = turn
    held = ring[turn]
    if held is not None:
        held[1].synchronize()  # fence: the last copy from this buffer has finished
    if held is None or held[0].shape != tensor.shape or held[0].dtype != tensor.dtype:
        held = ring[turn] = (torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True), torch.cuda.Event())
    buffer, fence = held
    buffer.copy_(tensor)
    compute = torch.cuda.current_stream(device)
    stream = _copy_stream_of(device) if copy_stream else compute
    with torch.cuda.stream(stream):
        out = buffer.to(device=device, non_blocking=True)
        fence.record(stream)
    if stream is not compute:
        compute.wait_stream(stream)
        # The block was allocated on the copy stream; keep it alive for the compute stream.
        out.record_stream(compute)
    return out
