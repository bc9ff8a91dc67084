"""Injected runtime: validation batches built one ahead, H2D on the copy stream (feature `val_prefetch`).

The evaluation loops of parameter-golf scripts slice one CPU tensor of validation
tokens per batch and copy the slice to the GPU on the training thread:

    for batch_seq_start in range(seq_start, seq_end, local_batch_seqs):
        batch_seq_end = min(batch_seq_start + local_batch_seqs, seq_end)
        raw_start = batch_seq_start * args.train_seq_len
        raw_end = batch_seq_end * args.train_seq_len + 1
        local = val_tokens[raw_start:raw_end].to(device=device, dtype=torch.int64, non_blocking=True)
        ...

`patch-prefetch` moves the slice into a function of the batch start (the statements
it needs, copied) and rewrites the loop as

    def _val_slice(batch_seq_start):
        batch_seq_end = min(batch_seq_start + local_batch_seqs, seq_end)
        raw_start = ...; raw_end = ...
        return val_tokens[raw_start:raw_end]
    for batch_seq_start, _val_batch in _val_prefetch(range(...), _val_slice, dict(device=device, dtype=torch.int64, non_blocking=True), prefetch=..., copy_stream=...):
        ...
        local = _val_batch

Batch k+1 is built one ahead: its slice is staged in pinned memory and its H2D copy
queued on the copy stream before batch k is handed out, so the copy overlaps batch
k's compute (double buffering); the compute stream waits on a CUDA event recorded
after the copy and `record_stream` keeps the caching allocator from reusing the block
early. The dtype conversion (`dtype=torch.int64`) then runs on the device, so the H2D
moves the slice's own dtype (uint16: a quarter of the bytes). No thread: the slice is
a view and staging it costs a copy of the batch on the host, while a worker thread
would take the GIL from the loop that launches the model's kernels; what the loop
gains is the copy that no longer blocks it (a pageable `.to(device)` waits for the
copy, which waits for the kernels already queued).

Exactness: the slice is a pure function of the batch start (the survey checks that
the statements it needs read only the loop variable and names the loop never
assigns), so building it early gives the same tensor; the handed-out batch has the
original's dtype, shape, device and values. On the CPU, or with a source tensor
that is not on the host, each batch is the script's own `slice.to(**to_kwargs)`,
still built one ahead; with `prefetch` off, built when its turn comes. An error while building batch k+1 reaches the loop after batch k, where the original
raises it.
"""

import torch

from patcher.templates.copy_stream import _copy_stream_of


def _val_prefetch(starts, make_slice, to_kwargs, prefetch=True, copy_stream=True):
    """The validation batches of one evaluation loop, built ahead: `(start, batch)` per start.

    Takes: starts: the loop's iterable of batch starts (ints; a `range`); make_slice:
    `start -> tensor`, the script's slice (e.g. uint16 `[n + 1]` on the host);
    to_kwargs: the keyword arguments of the script's `.to(...)` (device, dtype,
    non_blocking); prefetch: bool (`VAL_PREFETCH`); copy_stream: bool
    (`VAL_COPY_STREAM`).
    Yields `(start, make_slice(start).to(**to_kwargs))` for each start, in order
    (e.g. `int64 [n + 1]` on the device). An exception raised by `make_slice` reaches
    the loop at its batch. With `prefetch` off, each batch is the script's own
    `.to(...)`, built when its turn comes; without CUDA, the same, one ahead.
    """
    if not prefetch:
        yield from ((start, make_slice(start).to(**to_kwargs)) for start in starts)
        return
    device = torch.device(to_kwargs.get("device") or "cpu")
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if cuda:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        # Without the copy stream the copy is queued on the compute stream: the event
        # and record_stream below are then no-ops, and the pinned source frees the host.
        stream = _copy_stream_of(device) if copy_stream else torch.cuda.current_stream(device)
    pending = None  # (start, copy in flight, its event) of the batch handed out next
    for start in starts:
        try:
            piece = make_slice(start)
        except Exception:
            if pending:
                yield _val_take(*pending, to_kwargs.get("dtype"))
            raise
        if cuda and piece.device.type == "cpu":
            host = piece.pin_memory()
            with torch.cuda.stream(stream):
                out = host.to(device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
            built = start, out, ready
        else:
            built = start, piece.to(**to_kwargs), None  # the script's own `.to(...)`
        if pending:
            yield _val_take(*pending, to_kwargs.get("dtype"))
        pending = built
    if pending:
        yield _val_take(*pending, to_kwargs.get("dtype"))


def _val_take(start, out, ready, dtype):
    """`(start, batch)` as the script's `.to(...)` returns it, usable on the current stream."""
    if ready is not None:
        compute = torch.cuda.current_stream(out.device)
        compute.wait_event(ready)
        # The block was allocated on the copy stream; keep it alive for the compute stream.
        out.record_stream(compute)
        if dtype is not None:
            out = out.to(dtype=dtype)
    return start, out
