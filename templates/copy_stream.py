"""Injected runtime: host-to-device (H2D) copies on a dedicated CUDA copy stream.

`patch-prefetch` renders the body of this module into a training script (feature
`copy_stream`). It is also a plain module so that it can be imported and tested.

Why: `tensor.to("cuda", non_blocking=True)` issued on the compute stream queues the
copy behind every kernel already launched, so the batch for step k+1 cannot move
while step k computes. On a side stream the copy starts at once; the compute stream
then `wait_stream`s on the copy stream, and `record_stream` tells the caching
allocator that the compute stream uses the result, so the block is not handed out
again before the compute stream is done with it. Pattern after NVIDIA Apex's
data_prefetcher and timm's PrefetchLoader, plus `record_stream`, which those omit.
"""

import torch

_copy_streams = {}
# Step timers timing H2D copies (TRAINING_TIMING_BREAKDOWN=1, templates/step_timing.py).
_h2d_timers = []
# Step timers counting the process producer's hand-outs, and those that found no batch
# built (TRAINING_TIMING_BREAKDOWN=2: `_StepTimer.ring`, templates/prefetch_lean.py).
_ring_timers = []
# Filled only where templates/step_timing.py is injected (patcher/render/cut.py cuts the hooks).
_CUT_HOOKS = {"_h2d_timers": "step_timing", "_ring_timers": "step_timing"}


def _h2d(tensor, device, copy_stream=True):
    """Copy one tensor to `device` like `tensor.to(device, non_blocking=True)`.

    Takes: tensor: any dtype and shape, on the host (pinned or pageable memory);
    device: a `torch.device` or anything `torch.device()` accepts; copy_stream: bool,
    the `TRAIN_COPY_STREAM` toggle.
    Returns: the tensor on `device`, same dtype, shape and bytes. With
    `copy_stream=False`, or when `device` is not CUDA, this is exactly
    `tensor.to(device, non_blocking=True)`, the original script's call.
    """
    if _h2d_timers and not _h2d_timers[-1].inside("h2d"):
        with _h2d_timers[-1].phase("h2d"):
            return _h2d(tensor, device, copy_stream)
    device = torch.device(device)
    if not copy_stream or device.type != "cuda":
        return tensor.to(device, non_blocking=True)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _copy_stream_of(device)
    compute = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        out = tensor.to(device, non_blocking=True)
    compute.wait_stream(stream)
    # The block was allocated on the copy stream; keep it alive for the compute stream.
    out.record_stream(compute)
    return out


def _copy_stream_of(device):
    """The copy stream of CUDA `device` (a `torch.device` with an index), made on first use."""
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device=device)
    return _copy_streams[device]
