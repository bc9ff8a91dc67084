"""The GPU proof's registered-slot stage (`bench/gpu_proof.py`, stage 3): the process
producer's hand-out on CUDA with `pinned_slots` (templates/prefetch_lean.py
`_hand_out_pinned`: H2D straight from slot memory registered as pinned with
`cudaHostRegister`; an option no patch passes yet, for its bytes), checked on a real
device, and timed against the default hand-out (a pinned copy first).

1. exact: a loader's batches through `_make_train_loader` on CUDA, each handed out
   behind a queued GPU load (the host ahead of the GPU, as in training) and held;
   compared with the loader's own batches after one synchronize.
2. registered: the slots' memory was registered (no "not pinned" line), each H2D source
   is pinned memory (`is_pinned()` of a slot view), and a slot whose batch's copies sit
   behind the load stays lent until its event completes (polled as the hand-out does).
3. a failed registration stays on its thread: registering the same memory again fails
   there (cudaErrorHostMemoryAlreadyRegistered), and a kernel launched on the training
   thread afterwards raises nothing; the same call on the training thread is the control,
   whose error torch's next kernel-launch check raises.
4. host ms: a hand-out p50/p90 through the registered path, through the default one (a
   pinned host copy first), and the original's pageable `.to(device, non_blocking=True)`
   of the same batch, each behind the same load.
5. the copy stream by size (issue 58 part 3): host ms of one H2D from registered memory
   on the copy stream (`_h2d`) against a `.to()` on the compute stream, behind the load,
   at 64 KB, 1 MB and 8 MB.

On a CPU (`--dry-run`) the same code runs inside `cuda_on_host` at tiny sizes; the
figures then only show that the code runs.
"""

from __future__ import annotations

import contextlib
import io
import os
import time

import numpy as np
import torch

from patcher.templates.copy_stream import _h2d
from patcher.templates.prefetch_lean import _make_train_loader, _map_slots, _pinned, _register, _registered


class TokenLoader:
    """A TokenStream-like loader: `next_batch(batch, seq_len)` -> `x, y: int64 [batch,
    seq_len]`, overlapping views of one span of a token array, cycling through it."""

    def __init__(self, device, tokens: int = 1 << 20):
        self.tokens = torch.from_numpy((np.arange(tokens, dtype=np.int64) * 7919 + 13) % 50257)
        self.device, self.pos = device, 0

    def next_batch(self, batch: int, seq_len: int):
        n = batch * seq_len + 1
        if self.pos + n > len(self.tokens):
            self.pos = 0
        span = self.tokens[self.pos : self.pos + n]
        self.pos += n
        return span[:-1].view(batch, seq_len).to(self.device, non_blocking=True), span[1:].view(batch, seq_len).to(self.device, non_blocking=True)


def run(device: torch.device, load, batches: int, shape: tuple[int, int], sizes: dict[str, int], reps: int, real: bool = True) -> dict:
    """The stage's checks and figures (see the module's text). `load.queue()` queues
    about a step of GPU work; `shape`: (batch, seq_len) of each batch; `real`: a real
    GPU (on host memory an event completes whenever it is polled, so the lent-slot check
    is left out). Returns figures with "problems" (a list, empty when every check held)."""
    problems: list[str] = []
    figures: dict = {"batch_bytes": 2 * shape[0] * shape[1] * 8}
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        figures["exact"], loader = _exact(device, load, batches, shape, problems)
        figures["lent_until_event"] = _lent_until_event(loader, load, shape, problems if real else [])
        loader.shutdown()
        figures["failure_isolated"] = _failure_isolated(device, problems)
        figures["hand_out_ms"] = _hand_out_ms(device, load, shape, reps)
    figures["stderr_lines"] = [line for line in stderr.getvalue().splitlines() if line.startswith("prefetch:")]  # the deliberate failure's among them
    figures["copy_stream_by_size_ms"] = _copy_stream_by_size(device, load, sizes, reps)
    figures["problems"] = problems
    return figures


def _exact(device, load, batches, shape, problems):
    """`batches` batches handed out behind the load and held, compared after one synchronize."""
    want_loader = TokenLoader(torch.device("cpu"))
    want = [want_loader.next_batch(*shape) for _ in range(batches)]
    loader = _make_train_loader(lambda d: TokenLoader(d), device, queue_depth=2, name="registered-proof", pinned_slots=True)
    got = []
    for _ in range(batches):
        load.queue()
        got.append(loader.next_batch(*shape))
    torch.cuda.synchronize()
    wrong = [n for n, (g, w) in enumerate(zip(got, want)) if not all(torch.equal(a.cpu(), b) for a, b in zip(g, w))]
    if wrong:
        problems.append(f"batches {wrong[:5]} (of {batches}) differ from the loader's own")
    pinned = _registered.get(id(loader.slots), (None, None))[1]
    if not pinned:
        problems.append("the slots' memory is not registered")
    elif not torch.from_numpy(loader.slots[0]).is_pinned():
        problems.append("cudaHostRegister returned success, but a view of a slot is not pinned memory")
    return {"batches": batches, "differ": len(wrong), "registered": bool(pinned)}, loader


def _lent_until_event(loader, load, shape, problems) -> dict:
    """A batch handed out behind a queued load: its slot is lent while the load runs,
    and free once the GPU has passed the hand-out (after a synchronize)."""
    torch.cuda.synchronize()
    load.queue()
    load.queue()
    loader.next_batch(*shape)
    waiting = sum(ref() is not None for ref in loader.lent.values())
    torch.cuda.synchronize()
    free_after = sum(ref() is None for ref in loader.lent.values())
    if not waiting:
        problems.append("no slot was lent behind a queued load: the give-back does not wait for the copy's event")
    if free_after != len(loader.lent):
        problems.append("a slot stayed lent after a synchronize")
    return {"lent_behind_load": waiting, "free_after_synchronize": free_after}


def _failure_isolated(device, problems) -> dict:
    """A registration that fails on `_pinned`'s thread leaves the training thread's
    kernel launches clean; the same failing call here is the control."""
    slots = _map_slots(_memfd(1 << 20), 1 << 18, 4)
    first = _pinned(slots)
    _register(slots, torch.cuda.current_device())  # the same memory again: fails on this thread
    again = _registered[id(slots)][1]
    figures = {"first_registration": first, "second_registration": again}
    try:
        torch.ones(8, device=device).add_(1)
        torch.cuda.synchronize()
        figures["launch_after_failure_on_its_thread"] = "clean"
    except RuntimeError as error:
        figures["launch_after_failure_on_its_thread"] = str(error)[:200]
        problems.append(f"a failed registration on its own thread broke the next kernel launch: {error}")
    if not first or again:
        problems.append(f"registration: first {first}, the same memory again {again} (expected True, then False)")
    error = torch.cuda.cudart().cudaHostRegister(slots[0].ctypes.data, slots[0].nbytes * len(slots), 1)
    try:
        torch.ones(8, device=device).add_(1)
        torch.cuda.synchronize()
        figures["control_launch_after_failure_here"] = f"clean (cudaHostRegister returned {int(error)})"
    except RuntimeError as raised:
        figures["control_launch_after_failure_here"] = f"raised: {str(raised)[:160]}"
    return figures


def _memfd(size: int) -> int:
    fd = os.memfd_create("registered-proof")
    os.ftruncate(fd, size)
    return fd


def _hand_out_ms(device, load, shape, reps) -> dict:
    """Host ms per batch behind the load: the registered hand-out, the default one (a
    pinned copy first, `_staged_h2d`), and the original's pageable `.to()`."""
    out = {}
    for name, pinned_slots in (("registered", True), ("default_pinned_copy", False)):
        loader = _make_train_loader(lambda d: TokenLoader(d), device, queue_depth=2, name=f"registered-proof-{name}", pinned_slots=pinned_slots)
        out[name] = _timed(lambda: loader.next_batch(*shape), load, reps)
        loader.shutdown()
    original = TokenLoader(device)
    out["original_pageable_to"] = _timed(lambda: original.next_batch(*shape), load, reps)
    return out


def _copy_stream_by_size(device, load, sizes, reps) -> dict:
    """Host ms of one H2D from registered memory behind the load: on the copy stream
    (`_h2d`) and a `.to()` on the compute stream."""
    table = {}
    for name, nbytes in sizes.items():
        slots = _map_slots(_memfd(nbytes), nbytes, 1)
        registered = _pinned(slots)
        source = torch.from_numpy(slots[0])
        table[name] = {
            "registered": registered,
            "copy_stream": _timed(lambda: _h2d(source, device, True), load, reps),
            "compute_stream": _timed(lambda: source.to(device, non_blocking=True), load, reps),
        }
    return table


def _timed(call, load, reps: int) -> dict:
    """{"p50", "p90"} host ms of `call()` with the load queued before each, after two untimed calls."""
    samples = []
    for rep in range(reps + 2):
        torch.cuda.synchronize()
        load.queue()
        began = time.perf_counter()
        call()
        if rep >= 2:
            samples.append((time.perf_counter() - began) * 1e3)
    torch.cuda.synchronize()
    samples.sort()
    return {"p50": round(samples[len(samples) // 2], 4), "p90": round(samples[min(len(samples) - 1, int(0.9 * len(samples)))], 4)}
