"""The host model of asynchronous H2D copies (`patcher.proof.host_cuda.AsyncCopies`): a
copy from pinned memory reads its source as late as a GPU the host runs ahead of may,
so that a pinned buffer rewritten too early changes a batch on a CPU as it would on a GPU."""
from __future__ import annotations

import pytest
import torch

from patcher.proof import host_cuda
from patcher.proof.compare import InFlight, first_difference
from patcher.proof.host_cuda import active_copies, cuda_on_host


def test_a_copy_from_pageable_memory_reads_its_source_at_the_call():
    with cuda_on_host(run_ahead=2):
        src = torch.arange(4)
        dst = src.to("cuda", non_blocking=True)
        src.fill_(-1)
        assert dst.tolist() == [0, 1, 2, 3] and not active_copies().pending


def test_a_copy_from_pinned_memory_reads_its_source_when_the_gpu_reaches_it():
    with cuda_on_host(run_ahead=2):
        src = torch.arange(4).pin_memory()
        dst = src.to("cuda", non_blocking=True)
        src.fill_(7)  # the host rewrites the buffer before the copy ran
        host_cuda.tick()  # the end of the copy's own micro-step
        host_cuda.tick()  # one micro-step on
        assert len(active_copies().pending) == 1  # the host is 2 micro-steps ahead: still in flight
        host_cuda.tick()
        assert not active_copies().pending
        src.fill_(9)  # after the copy ran: no effect
        assert dst.tolist() == [7, 7, 7, 7]


def test_a_blocking_copy_from_pinned_memory_reads_at_the_call():
    with cuda_on_host(run_ahead=2):
        src = torch.arange(4).pin_memory()
        dst = src.to("cuda")
        src.fill_(7)
        assert dst.tolist() == [0, 1, 2, 3]


def test_a_device_op_on_the_destination_is_queued_behind_its_copy_not_run_before_it():
    # On a GPU `view * 2` is stream-ordered after the copy and the host does not wait for
    # it: a source rewritten before the GPU reaches both changes both.
    with cuda_on_host(run_ahead=5):
        src = torch.arange(6).pin_memory()
        dst = src.to("cuda", non_blocking=True)
        view = dst.view(2, 3)[1]  # no element read
        doubled = view * 2
        gathered = dst[torch.tensor([5, 0])]  # a gather reads too
        assert len(active_copies().pending) == 3 and doubled.shape == (3,)
        src.fill_(1)
        assert doubled.tolist() == [2, 2, 2] and gathered.tolist() == [1, 1] and dst.tolist() == [1] * 6


def test_an_in_place_op_or_a_host_read_runs_the_copy_first():
    with cuda_on_host(run_ahead=5):
        src = torch.arange(3).pin_memory()
        dst = src.to("cuda", non_blocking=True)
        dst.add_(1)  # writes the destination: after the copy
        assert not active_copies().pending
        src.fill_(0)
        other = torch.arange(3).pin_memory().to("cuda", non_blocking=True)
        assert bool((other == 2).any())  # the host reads a value: it waits
        assert dst.tolist() == [1, 2, 3]


@pytest.mark.parametrize("wait", ["event", "synchronize", "stream", "item"])
def test_the_host_waiting_runs_the_copies_before_it(wait):
    with cuda_on_host(run_ahead=5):
        src = torch.arange(3).pin_memory()
        dst = src.to("cuda", non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream())
        later = torch.arange(3).pin_memory().to("cuda", non_blocking=True)  # issued after the event
        {"event": done.synchronize, "synchronize": torch.cuda.synchronize, "stream": torch.cuda.current_stream().synchronize, "item": lambda: later[0].item()}[wait]()
        assert len(active_copies().pending) == (1 if wait == "event" else 0)  # the event waits for what was issued before it only
        src.fill_(-1)
        assert dst.tolist() == [0, 1, 2]


def test_the_reference_side_copies_at_the_call_and_leaves_the_other_sides_copies_in_flight():
    with cuda_on_host(run_ahead=2):
        patched_src = torch.arange(3).pin_memory()
        patched = patched_src.to("cuda", non_blocking=True)
        with host_cuda.reference_side():
            src = torch.arange(3).pin_memory()
            dst = src.to("cuda", non_blocking=True)
        assert len(active_copies().pending) == 1
        src.fill_(-1)
        patched_src.fill_(5)
        assert dst.tolist() == [0, 1, 2] and patched.tolist() == [5, 5, 5]


def test_a_copy_into_device_memory_the_script_holds_is_modelled_too():
    # nanochat's loader: one pinned staging buffer, one device buffer, `gpu.copy_(cpu, non_blocking=True)`.
    with cuda_on_host(run_ahead=1):
        cpu = torch.empty(3, dtype=torch.long, pin_memory=True)
        gpu = torch.empty(3, dtype=torch.long, device="cuda")
        cpu.copy_(torch.tensor([1, 2, 3]))
        gpu.copy_(cpu, non_blocking=True)
        host_cuda.tick()
        cpu.copy_(torch.tensor([4, 5, 6]))  # the next micro-step refills the staging buffer
        assert gpu.tolist() == [4, 5, 6]


def test_a_blocking_copy_behind_copies_in_flight_is_counted_as_a_wait():
    with cuda_on_host(run_ahead=2):
        torch.arange(3).pin_memory().to("cuda", non_blocking=True)
        torch.arange(3).to("cuda")  # pageable: the host waits for the stream first
        assert active_copies().waits == 1 and not active_copies().pending


class Ring:
    """A hand-written pinned ring: `depth` pinned slots reused in turn, each fenced by a
    CUDA event (the host waits for a slot's last copy before refilling it) unless `fenced` is False."""

    def __init__(self, depth: int, fenced: bool):
        self.slots = [torch.empty(4, dtype=torch.long, pin_memory=True) for _ in range(depth)]
        self.events = [None] * depth
        self.fenced, self.n = fenced, 0

    def next_batch(self):
        i = self.n % len(self.slots)
        if self.fenced and self.events[i] is not None:
            self.events[i].synchronize()
        self.slots[i].copy_(torch.arange(4) + 10 * self.n)
        out = self.slots[i].to("cuda", non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record(torch.cuda.current_stream())
        self.n += 1
        return out


def first_ring_difference(depth: int, fenced: bool, run_ahead: int, batches: int = 8):
    """Drive a `Ring` as a training loop does, one micro-step a batch: (batch, what) of the
    first batch that differs from what it was built from, or None."""
    with cuda_on_host(run_ahead=run_ahead):
        ring, window = Ring(depth, fenced), InFlight()
        for n in range(batches):
            for m, got in window.drawn(n, ring.next_batch()):
                diff = first_difference(torch.arange(4) + 10 * m, got)
                if diff:
                    return m, diff[1]
        for m, got in window.landed():
            diff = first_difference(torch.arange(4) + 10 * m, got)
            if diff:
                return m, diff[1]
    return None


@pytest.mark.parametrize("depth, run_ahead", [(1, 2), (3, 2), (1, 5)])
def test_a_fenced_ring_passes_at_any_depth_and_run_ahead(depth, run_ahead):
    assert first_ring_difference(depth, fenced=True, run_ahead=run_ahead) is None


def test_an_unfenced_ring_deeper_than_the_run_ahead_passes():
    assert first_ring_difference(3, fenced=False, run_ahead=2) is None


@pytest.mark.parametrize("depth", [1, 2])
def test_an_unfenced_ring_at_or_below_the_run_ahead_changes_its_first_batch(depth):
    # Batch 0's slot is refilled every `depth` micro-steps; its copy runs at the end of
    # micro-step 2 and reads what batch 2 wrote there.
    assert first_ring_difference(depth, fenced=False, run_ahead=2) == (0, "bytes differ: first at [0]: 0 vs 20")


def test_without_run_ahead_an_unfenced_ring_of_one_passes():
    assert first_ring_difference(1, fenced=False, run_ahead=0) is None


def test_our_staging_passes_at_any_run_ahead():
    # The runtime's H2D (templates/staging.py): a fresh pinned block per copy, as
    # torch's caching host allocator hands a block out again only once its copy ran.
    from patcher.templates.staging import _staged_h2d

    with cuda_on_host(run_ahead=6):
        window, source = InFlight(), torch.empty(4, dtype=torch.long)
        for n in range(10):
            source.copy_(torch.arange(4) + 10 * n)  # the loader refills its own buffer at once
            for m, got in window.drawn(n, _staged_h2d(source, "cuda")):
                assert first_difference(torch.arange(4) + 10 * m, got) is None
        assert all(first_difference(torch.arange(4) + 10 * m, got) is None for m, got in window.landed())


def test_a_negative_run_ahead_is_refused():
    with pytest.raises(ValueError, match="run_ahead must be 0 or more"):
        host_cuda.AsyncCopies(-1)
