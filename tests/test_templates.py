"""Tests for the injected runtime templates: templates/copy_stream.py, templates/prefetch_loader.py.

The loaders here are small fakes in the style of the competition scripts'
DistributedTokenLoader/TokenStream: a deterministic token array read with a position
cursor, `next_batch(global_tokens, seq_len, grad_accum_steps) -> (x, y)` int64
`[-1, seq_len]`. Every expectation is a direct, unwrapped fake called with the same
arguments. The fakes' worker threads are steered with threading.Event, never sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processes import readable_within
import patcher.templates.copy_stream as copy_stream_mod
from patcher.templates.copy_stream import _h2d
from patcher.templates.prefetch_loader import _EMPTY, _Handoff, _live_prefetchers, _make_train_loader, _PrefetchLoader, _stage

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
WAIT_S = 5.0  # upper bound on any Event wait that is expected to succeed
ARGS = (512, 16, 2)  # global_tokens, seq_len, grad_accum_steps -> 128 local tokens per rank


# ---------------------------------------------------------------------------
# Fake loaders
# ---------------------------------------------------------------------------


class FakeTokenLoader:
    """TokenStream-like loader: a fixed token array, a cursor, wrap-around at the end.

    `calls` counts next_batch calls; `on_call(n)` (if set) runs at the start of call n
    (1-based) on whatever thread calls it, so tests can observe and steer the worker.
    """

    def __init__(self, n_tokens, device, rank=0, world_size=2, on_call=None, fail_at=None):
        # Distinct, non-monotone values so a skipped or repeated span changes the data.
        self.tokens = torch.from_numpy((np.arange(n_tokens, dtype=np.int64) * 7919 + 13) % 50257).to(torch.int32)
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.pos = 0
        self.wraps = 0
        self.calls = 0
        self.on_call = on_call
        self.fail_at = fail_at

    def take(self, n):
        chunks = []
        while n > 0:
            avail = self.tokens.numel() - self.pos
            if avail <= 0:
                self.pos = 0
                self.wraps += 1
                continue
            k = min(n, avail)
            chunks.append(self.tokens[self.pos : self.pos + k])
            self.pos += k
            n -= k
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _fake_build_batch(self, global_tokens, seq_len, grad_accum_steps):
        if self.fail_at is not None and self.calls == self.fail_at:
            raise ValueError("boom")
        local_tokens = global_tokens // (self.world_size * grad_accum_steps)
        span = local_tokens + 1
        chunk = self.take(span * self.world_size)
        local = chunk[self.rank * span : (self.rank + 1) * span].to(dtype=torch.int64)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        return self._fake_build_batch(global_tokens, seq_len, grad_accum_steps)


class BufferReusingLoader:
    """Returns the SAME two tensors on every call, overwritten in place (a reused buffer)."""

    def __init__(self, device, on_call=None):
        self.device = device
        self.x = torch.zeros(4, 8, dtype=torch.int64)
        self.y = torch.zeros(4, 8, dtype=torch.int64)
        self.calls = 0
        self.on_call = on_call

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        base = torch.arange(32, dtype=torch.int64).reshape(4, 8)
        self.x.copy_(base + 1000 * self.calls)
        self.y.copy_(base - 1000 * self.calls)
        return self.x, self.y


class CallGate:
    """`on_call` hook: sets reached[n] when call n starts; optionally blocks calls > block_after."""

    def __init__(self, upto, block_after=None):
        self.reached = {n: threading.Event() for n in range(1, upto + 1)}
        self.overrun = threading.Event()  # set when a call beyond `upto` starts
        self.release = threading.Event()
        self.block_after = block_after
        self.upto = upto

    def __call__(self, n):
        if n in self.reached:
            self.reached[n].set()
        if n > self.upto:
            self.overrun.set()
        if self.block_after is not None and n > self.block_after:
            self.release.wait()

    def wait(self, n):
        assert self.reached[n].wait(WAIT_S), f"loader call {n} never started"


# ---------------------------------------------------------------------------
# Helpers and fixtures
# ---------------------------------------------------------------------------


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "train-prefetch" and t.is_alive()]


def assert_batch_equal(got, want):
    assert type(got) is type(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, torch.Tensor)
        assert g.dtype == w.dtype
        assert g.shape == w.shape
        assert g.device == w.device
        assert torch.equal(g, w)


def direct_batches(make, arg_list):
    """What the unwrapped loader returns for these calls (cloned: the loader may reuse memory)."""
    loader = make(CPU)
    return [tuple(t.clone() for t in loader.next_batch(*a)) for a in arg_list], loader


@pytest.fixture(autouse=True)
def clean_prefetchers():
    """Every test starts and ends with no registered prefetcher and no live worker thread."""
    gates = []
    created = []
    _live_prefetchers.clear()
    yield gates, created
    for gate in gates:
        gate.release.set()
    for loader in list(_live_prefetchers.values()) + created:
        loader.shutdown()
    _live_prefetchers.clear()
    deadline = time.monotonic() + WAIT_S  # one budget for all: a broken shutdown fails, not hangs
    for t in prefetch_threads():
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    leftover = prefetch_threads()
    for t in leftover:  # do not let a stuck worker fail every later test too
        t.name = "train-prefetch-leaked"
    assert not leftover, "a prefetch worker thread outlived its test"


# ---------------------------------------------------------------------------
# 1. Exactness
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("queue_depth", [1, 2, 5])
def test_exact_sequence_50_calls(queue_depth, clean_prefetchers):
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(3001, d)  # 3001 tokens: wraps around mid-span several times
    want, direct = direct_batches(make, [ARGS] * 50)
    assert direct.wraps >= 2  # the wrap-around path is exercised
    wrapper = _make_train_loader(make, CPU, queue_depth=queue_depth)
    created.append(wrapper)
    assert isinstance(wrapper, _PrefetchLoader)
    for i in range(50):
        assert_batch_equal(wrapper.next_batch(*ARGS), want[i])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_tokens=st.integers(min_value=40, max_value=2000),
    seq_len=st.sampled_from([1, 2, 4, 8]),
    rows=st.integers(min_value=1, max_value=6),
    grad_accum=st.sampled_from([1, 2]),
    world_size=st.sampled_from([1, 2, 3]),
    queue_depth=st.integers(min_value=1, max_value=5),
    n_calls=st.integers(min_value=1, max_value=30),
)
def test_exact_sequence_property(n_tokens, seq_len, rows, grad_accum, world_size, queue_depth, n_calls):
    global_tokens = seq_len * rows * world_size * grad_accum
    args = (global_tokens, seq_len, grad_accum)
    make = lambda d: FakeTokenLoader(n_tokens, d, rank=world_size - 1, world_size=world_size)
    want, _ = direct_batches(make, [args] * n_calls)
    wrapper = _make_train_loader(make, CPU, queue_depth=queue_depth, name="hypothesis")
    try:
        for i in range(n_calls):
            assert_batch_equal(wrapper.next_batch(*args), want[i])
    finally:
        wrapper.shutdown()
        _live_prefetchers.clear()


# ---------------------------------------------------------------------------
# 2. prefetch=False
# ---------------------------------------------------------------------------


def test_prefetch_off_returns_plain_loader():
    built = []

    def make(d):
        built.append(d)
        return FakeTokenLoader(500, d)

    loader = _make_train_loader(make, CPU, prefetch=False)
    assert type(loader) is FakeTokenLoader
    assert built == [CPU]  # built once, with the caller's device
    assert "train_loader" not in _live_prefetchers
    assert not prefetch_threads()
    want, _ = direct_batches(lambda d: FakeTokenLoader(500, d), [ARGS] * 3)
    for w in want:
        assert_batch_equal(loader.next_batch(*ARGS), w)


def test_prefetch_off_still_shuts_down_the_previous_one_of_its_name():
    first = _make_train_loader(lambda d: FakeTokenLoader(500, d), CPU)
    first.next_batch(*ARGS)
    thread = first._worker.thread
    _make_train_loader(lambda d: FakeTokenLoader(500, d), CPU, prefetch=False)
    thread.join(timeout=WAIT_S)
    assert not thread.is_alive()
    assert "train_loader" not in _live_prefetchers


# ---------------------------------------------------------------------------
# 3. Rebuilding a loader variable shuts the previous worker down
# ---------------------------------------------------------------------------


def test_rebuild_same_name_shuts_previous_worker(clean_prefetchers):
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(1000, d)
    first = _make_train_loader(make, CPU, queue_depth=2)
    created.append(first)
    first.next_batch(*ARGS)
    old_thread = first._worker.thread
    assert old_thread.is_alive()

    second = _make_train_loader(make, CPU, queue_depth=2)
    created.append(second)
    old_thread.join(timeout=WAIT_S)
    assert not old_thread.is_alive()
    assert first._worker is None
    assert len(_live_prefetchers) == 1
    assert _live_prefetchers["train_loader"] is second

    # The rebuilt loader starts from the beginning (the warm-up reset) and is exact.
    want, _ = direct_batches(make, [ARGS] * 3)
    for w in want:
        assert_batch_equal(second.next_batch(*ARGS), w)
    assert len(prefetch_threads()) == 1
    assert prefetch_threads()[0] is second._worker.thread


def test_different_names_are_independent(clean_prefetchers):
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(1000, d)
    a = _make_train_loader(make, CPU, name="a")
    b = _make_train_loader(make, CPU, name="b")
    created += [a, b]
    want, _ = direct_batches(make, [ARGS] * 4)
    for w in want:
        assert_batch_equal(a.next_batch(*ARGS), w)
        assert_batch_equal(b.next_batch(*ARGS), w)
    assert set(_live_prefetchers) == {"a", "b"}
    assert len(prefetch_threads()) == 2


# ---------------------------------------------------------------------------
# 4. Worker exceptions reach the caller
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4])
def test_worker_exception_reraised_on_kth_call(k, clean_prefetchers):
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(1000, d, fail_at=k)
    want, _ = direct_batches(lambda d: FakeTokenLoader(1000, d), [ARGS] * (k - 1))
    wrapper = _make_train_loader(make, CPU, queue_depth=3)
    created.append(wrapper)
    for i in range(k - 1):
        assert_batch_equal(wrapper.next_batch(*ARGS), want[i])
    with pytest.raises(ValueError, match="^boom$") as info:
        wrapper.next_batch(*ARGS)
    text = "".join(traceback.format_exception(info.type, info.value, info.value.__traceback__))
    assert "_fake_build_batch" in text  # the worker's frame, where the error was raised
    assert "raise ValueError(\"boom\")" in text


# ---------------------------------------------------------------------------
# 5. shutdown() is prompt with a worker blocked on a full queue
# ---------------------------------------------------------------------------


def test_shutdown_prompt_with_full_queue(clean_prefetchers):
    gates, created = clean_prefetchers
    gate = CallGate(upto=3)
    gates.append(gate)
    wrapper = _make_train_loader(lambda d: FakeTokenLoader(1000, d, on_call=gate), CPU, queue_depth=1)
    created.append(wrapper)
    wrapper.next_batch(*ARGS)  # starts the worker; it then fills the queue (1) and blocks
    gate.wait(3)  # call 3 started: batch 2 queued, batch 3 about to wait on the full queue
    worker = wrapper._worker
    thread = worker.thread
    t0 = time.monotonic()
    wrapper.shutdown()
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0
    assert not thread.is_alive()  # stopped, not merely abandoned after a join timeout
    assert wrapper._worker is None  # the worker and its queued batches are dropped
    assert not gate.overrun.is_set()
    wrapper.shutdown()  # idempotent


def test_shutdown_before_any_batch_is_a_noop():
    wrapper = _make_train_loader(lambda d: FakeTokenLoader(100, d), CPU)
    assert not prefetch_threads()  # the worker starts on the first next_batch
    wrapper.shutdown()
    assert wrapper.close == wrapper.shutdown


# ---------------------------------------------------------------------------
# 6. Memory bound: at most queue_depth batches ahead
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_worker_builds_at_most_depth_plus_two(depth, clean_prefetchers):
    gates, created = clean_prefetchers
    gate = CallGate(upto=depth + 2)
    gates.append(gate)
    inner = []

    def make(d):
        inner.append(FakeTokenLoader(5000, d, on_call=gate))
        return inner[-1]

    wrapper = _make_train_loader(make, CPU, queue_depth=depth)
    created.append(wrapper)
    wrapper.next_batch(*ARGS)
    # One handed out, `depth` queued, one built and waiting for room: depth + 2 calls.
    gate.wait(depth + 1)
    gate.wait(depth + 2)
    worker = wrapper._worker
    deadline = time.monotonic() + WAIT_S
    while not worker.queue.full():  # bounded poll on queue state, not a sleep
        assert time.monotonic() < deadline, "queue never filled"
        gate.overrun.wait(0.01)
    assert worker.queue.qsize() == depth
    # A bounded wait for a call that must never come.
    assert not gate.overrun.wait(0.5), f"worker built more than {depth} + 2 batches"
    assert inner[0].calls == depth + 2


# ---------------------------------------------------------------------------
# 7. Argument change: resync replays exactly, with a warning
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("args_b", [(256, 16, 2), (512, 16, 1), (1024, 8, 2)])
def test_argument_change_resyncs_exactly(args_b, clean_prefetchers):
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(2003, d)
    arg_list = [ARGS] * 5 + [args_b] * 5
    want, _ = direct_batches(make, arg_list)
    wrapper = _make_train_loader(make, CPU, queue_depth=3, replay=True)
    created.append(wrapper)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(5):
            assert_batch_equal(wrapper.next_batch(*ARGS), want[i])
    with pytest.warns(RuntimeWarning, match="arguments changed"):
        assert_batch_equal(wrapper.next_batch(*args_b), want[5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only the first changed call warns
        for i in range(6, 10):
            assert_batch_equal(wrapper.next_batch(*args_b), want[i])
    assert len(prefetch_threads()) == 1


def test_argument_change_back_and_forth(clean_prefetchers):
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(2003, d)
    b = (256, 16, 2)
    arg_list = [ARGS] * 3 + [b] * 2 + [ARGS] * 4 + [b]
    want, _ = direct_batches(make, arg_list)
    wrapper = _make_train_loader(make, CPU, queue_depth=2, replay=True)
    created.append(wrapper)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for a, w in zip(arg_list, want):
            assert_batch_equal(wrapper.next_batch(*a), w)


def test_without_replay_a_changed_argument_or_a_use_after_shutdown_raises(clean_prefetchers):
    # The survey proved the arguments constant, so no replay code is injected: a change
    # it missed must fail loudly, never hand out a batch built with the old arguments.
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(2003, d)
    want, _ = direct_batches(make, [ARGS] * 2)
    wrapper = _make_train_loader(make, CPU, queue_depth=2)
    created.append(wrapper)
    assert_batch_equal(wrapper.next_batch(*ARGS), want[0])
    with pytest.raises(RuntimeError, match=r"arguments changed to \(256, 16, 2\)"):
        wrapper.next_batch(256, 16, 2)
    assert_batch_equal(wrapper.next_batch(*ARGS), want[1])  # the worker still serves the proved arguments
    wrapper.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        wrapper.next_batch(*ARGS)


# ---------------------------------------------------------------------------
# 8. reshape_arg: the reshape-only argument is applied at hand-out
# ---------------------------------------------------------------------------


def test_reshape_arg_change_is_exact_and_silent(clean_prefetchers):
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(1500, d)
    arg_list = [(512, 16, 2)] * 3 + [(512, 32, 2)] * 3 + [(512, 8, 2)] * 2
    want, _ = direct_batches(make, arg_list)
    wrapper = _make_train_loader(make, CPU, queue_depth=2, reshape_arg=1)
    created.append(wrapper)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning (a resync) fails the test
        for a, w in zip(arg_list, want):
            got = wrapper.next_batch(*a)
            assert got[0].shape == (128 // a[1], a[1])
            assert_batch_equal(got, w)


def test_reshape_arg_other_argument_still_resyncs(clean_prefetchers):
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(1500, d)
    arg_list = [(512, 16, 2)] * 3 + [(256, 32, 2)] * 3
    want, _ = direct_batches(make, arg_list)
    wrapper = _make_train_loader(make, CPU, queue_depth=2, reshape_arg=1, replay=True)
    created.append(wrapper)
    with pytest.warns(RuntimeWarning):
        for a, w in zip(arg_list, want):
            assert_batch_equal(wrapper.next_batch(*a), w)


# ---------------------------------------------------------------------------
# 9. __getattr__ settles the loader where the caller left it
# ---------------------------------------------------------------------------


def test_getattr_settles_to_direct_state(clean_prefetchers):
    gates, created = clean_prefetchers
    depth = 3
    gate = CallGate(upto=7 + depth + 1)
    gates.append(gate)
    inner = []

    def make(d):
        inner.append(FakeTokenLoader(2003, d, on_call=gate if not inner else None))
        return inner[-1]

    arg_list = [ARGS] * 12
    want, direct = direct_batches(lambda d: FakeTokenLoader(2003, d), arg_list)
    direct7 = FakeTokenLoader(2003, CPU)
    for a in arg_list[:7]:
        direct7.next_batch(*a)

    wrapper = _make_train_loader(make, CPU, queue_depth=depth, attrs=True, replay=True)
    created.append(wrapper)
    for i in range(7):
        assert_batch_equal(wrapper.next_batch(*ARGS), want[i])
    gate.wait(7 + depth + 1)  # the worker has built ahead of the caller
    assert inner[0].pos != direct7.pos or inner[0].wraps != direct7.wraps

    assert wrapper.pos == direct7.pos
    assert wrapper.wraps == direct7.wraps
    assert wrapper.calls == 7
    assert wrapper.tokens is not None
    assert not prefetch_threads()  # settling stops building ahead
    for i in range(7, 12):
        assert_batch_equal(wrapper.next_batch(*ARGS), want[i])
    assert wrapper.pos == direct.pos


def test_getattr_private_names_do_not_settle(clean_prefetchers):
    _, created = clean_prefetchers
    wrapper = _make_train_loader(lambda d: FakeTokenLoader(500, d), CPU, attrs=True, replay=True)
    created.append(wrapper)
    wrapper.next_batch(*ARGS)
    with pytest.raises(AttributeError):
        wrapper._no_such_private_attr
    assert not wrapper._settled
    assert wrapper._worker is not None


def test_without_attrs_attribute_reads_fail_loudly(clean_prefetchers):
    # A script the survey finds never reading the loader's attributes gets no settling
    # code; a read then fails instead of seeing a loader that ran ahead.
    _, created = clean_prefetchers
    wrapper = _make_train_loader(lambda d: FakeTokenLoader(500, d), CPU)
    created.append(wrapper)
    wrapper.next_batch(*ARGS)
    with pytest.raises(AttributeError):
        wrapper.pos


def test_getattr_method_call_sees_caller_state(clean_prefetchers):
    """`train_loader.stream.take(n)`-style use: a method reached through the wrapper."""
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(700, d)
    direct = make(CPU)
    wrapper = _make_train_loader(make, CPU, queue_depth=4, attrs=True, replay=True)
    created.append(wrapper)
    for _ in range(5):
        assert_batch_equal(wrapper.next_batch(*ARGS), direct.next_batch(*ARGS))
    assert torch.equal(wrapper.take(100), direct.take(100))  # advances the caller-visible stream
    got = getattr(wrapper, "next_batch")(*ARGS)  # still the wrapper's own method
    assert_batch_equal(got, direct.next_batch(*ARGS))


# ---------------------------------------------------------------------------
# 10. _stage copies, so reused buffers cannot change queued batches
# ---------------------------------------------------------------------------


def test_buffer_reusing_loader_yields_distinct_batches(clean_prefetchers):
    gates, created = clean_prefetchers
    depth = 4
    gate = CallGate(upto=depth + 2)
    gates.append(gate)
    want, _ = direct_batches(lambda d: BufferReusingLoader(d), [ARGS] * 10)
    assert not torch.equal(want[0][0], want[1][0])
    wrapper = _make_train_loader(lambda d: BufferReusingLoader(d, on_call=gate), CPU, queue_depth=depth)
    created.append(wrapper)
    got = [wrapper.next_batch(*ARGS)]
    gate.wait(depth + 2)  # the queue holds `depth` batches built from the one buffer
    got += [wrapper.next_batch(*ARGS) for _ in range(9)]
    for g, w in zip(got, want):
        assert_batch_equal(g, w)
    ptrs = {t.data_ptr() for batch in got for t in batch}
    assert len(ptrs) == 2 * len(got)  # no two handed-out tensors share memory


class RecordingLoader(FakeTokenLoader):
    """FakeTokenLoader that keeps every batch it returned, to compare memory."""

    def __init__(self, n_tokens, device, **kwargs):
        super().__init__(n_tokens, device, **kwargs)
        self.returned = []

    def next_batch(self, *args):
        batch = super().next_batch(*args)
        self.returned.append(batch)
        return batch


@pytest.mark.parametrize("host_copy", [False, True])
def test_host_copy_decides_whether_host_batches_are_copied(host_copy, clean_prefetchers):
    # host_copy=False (the survey found no array write in the loader): on a host device
    # the batch built ahead is handed out as built; True: a copy in fresh memory.
    _, created = clean_prefetchers
    want, _ = direct_batches(lambda d: FakeTokenLoader(5000, d), [ARGS] * 6)
    wrapper = _make_train_loader(lambda d: RecordingLoader(5000, d), CPU, queue_depth=2, host_copy=host_copy)
    created.append(wrapper)
    got = [wrapper.next_batch(*ARGS) for _ in range(6)]
    for g, w in zip(got, want):
        assert_batch_equal(g, w)
    built = wrapper._loader.returned[:6]
    shared = [g[0].data_ptr() == b[0].data_ptr() and g[1].data_ptr() == b[1].data_ptr() for g, b in zip(got, built)]
    assert shared == [not host_copy] * 6


def test_handoff_take_leaves_the_producer_asleep_until_room():
    # Taking a batch must not wake the worker: the caller wakes it after its own torch
    # calls (`room()`), so that the worker's Python cannot run inside next_batch.
    handoff = _Handoff(1)
    assert handoff.put("a", 1.0)
    appended = threading.Event()

    def producer():
        if handoff.put("b", WAIT_S * 6):
            appended.set()

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    assert handoff.get(1.0) == "a"
    # A bounded wait for something that must not happen before room().
    assert not appended.wait(0.3), "get() woke the producer"
    handoff.room()
    assert appended.wait(WAIT_S)
    assert handoff.get(1.0) == "b"
    thread.join(WAIT_S)


def test_handoff_is_a_bounded_fifo():
    handoff = _Handoff(3)
    assert [handoff.put(i, 0.05) for i in range(4)] == [True, True, True, False]  # no room for the 4th
    assert handoff.full() and handoff.qsize() == 3
    assert [handoff.get(0.05) for _ in range(4)] == [0, 1, 2, _EMPTY]
    assert handoff.empty()


def test_handoff_wait_full_returns_when_the_producer_fills_it():
    handoff = _Handoff(5)
    thread = threading.Thread(target=lambda: [handoff.put(i, WAIT_S) for i in range(5)], daemon=True)
    thread.start()
    assert handoff.wait_full(WAIT_S)
    assert [handoff.get(0.05) for _ in range(5)] == list(range(5))
    thread.join(WAIT_S)
    assert not _Handoff(2).wait_full(0.05)


def test_stage_copies_structure():
    x = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    y = torch.arange(6, dtype=torch.float32)[::2]  # non-contiguous
    staged = _stage([x, (y, 7)], pin=False)
    assert type(staged) is list and type(staged[1]) is tuple and staged[1][1] == 7
    assert torch.equal(staged[0], x) and staged[0].data_ptr() != x.data_ptr()
    assert torch.equal(staged[1][0], y) and staged[1][0].dtype == torch.float32
    x.fill_(-1)
    assert torch.equal(staged[0], torch.arange(12, dtype=torch.int64).reshape(3, 4))


# ---------------------------------------------------------------------------
# 11. _h2d
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("copy_stream", [True, False])
@pytest.mark.parametrize("device", ["cpu", CPU])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint16, torch.bfloat16, torch.float32, torch.bool])
def test_h2d_cpu_matches_to(copy_stream, device, dtype):
    src = (torch.arange(24).reshape(4, 6) % 5).to(dtype)[:, ::2]  # non-contiguous view
    want = src.to(device, non_blocking=True)
    before = len(copy_stream_mod._copy_streams)
    got = _h2d(src, device, copy_stream=copy_stream)
    assert got.device.type == "cpu"
    assert got.dtype == dtype
    assert got.shape == src.shape
    assert got.stride() == want.stride()
    assert torch.equal(got.to(torch.float32), src.to(torch.float32))
    assert len(copy_stream_mod._copy_streams) == before  # no CUDA stream on a CPU device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("copy_stream", [True, False])
def test_h2d_cuda_values_after_sync(copy_stream):
    src = torch.arange(1 << 20, dtype=torch.int64).reshape(1024, 1024).pin_memory()
    got = _h2d(src, "cuda", copy_stream=copy_stream)
    assert got.device.type == "cuda" and got.dtype == torch.int64 and got.shape == src.shape
    # Work queued on the compute stream after the copy must see the copied values.
    total = (got * 2).sum()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(got.cpu(), src)
    assert total.item() == int(src.sum()) * 2
    if copy_stream:
        dev = torch.device("cuda", torch.cuda.current_device())
        assert dev in copy_stream_mod._copy_streams
        assert copy_stream_mod._copy_streams[dev] != torch.cuda.current_stream()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetch_to_cuda_exact(clean_prefetchers):
    _, created = clean_prefetchers
    make = lambda d: FakeTokenLoader(3001, d)
    want, _ = direct_batches(make, [ARGS] * 20)
    wrapper = _make_train_loader(make, torch.device("cuda"), queue_depth=2)
    created.append(wrapper)
    for w in want:
        got = wrapper.next_batch(*ARGS)
        assert all(t.device.type == "cuda" for t in got)
        torch.cuda.current_stream().synchronize()
        assert_batch_equal(tuple(t.cpu() for t in got), w)


# ---------------------------------------------------------------------------
# 12-13. Process exit: dropped wrappers and KeyboardInterrupt
# ---------------------------------------------------------------------------

CHILD_PRELUDE = textwrap.dedent(
    f"""
    import sys, threading, time
    sys.path.insert(0, {str(REPO)!r})
    import torch
    # One intra-op thread: with several busy processes, OpenMP spin-waiting can stretch the
    # fake's few ms of torch work to seconds, past the template's exit-time join.
    torch.set_num_threads(1)
    from patcher.templates.prefetch_loader import _make_train_loader

    class Fake:
        # block_after: calls past it wait forever on an Event (a stuck read).
        # busy_from: calls from it first do a few ms of torch work (building a big batch).
        def __init__(self, device, block_after=None, busy_from=None):
            self.device, self.pos = device, 0
            self.block_after, self.busy_from = block_after, busy_from
            self.never, self.blocked, self.busy = threading.Event(), threading.Event(), threading.Event()
        def next_batch(self, n, seq_len, gas):
            self.pos += 1
            if self.block_after is not None and self.pos > self.block_after:
                self.blocked.set()
                self.never.wait()
            if self.busy_from is not None and self.pos >= self.busy_from:
                self.busy.set()
                for _ in range(300):
                    w = torch.arange(100000).reshape(-1, 10) + 1
            x = torch.arange(self.pos * n, (self.pos + 1) * n).reshape(-1, seq_len)
            return x.to(self.device, non_blocking=True), (x + 1).to(self.device, non_blocking=True)

    inner = []
    def make(d, **kw):
        inner.append(Fake(d, **kw))
        return inner[-1]
    """
)


def run_child(body):
    return subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(body)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_child(child, timeout):
    try:
        return child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


def test_process_exits_cleanly_when_consumer_stops_with_idle_worker():
    # Two batches drawn, the worker has filled its queue and waits for room; the script
    # ends without shutdown() (as a training script does) and must exit 0.
    child = run_child(
        """
        loader = _make_train_loader(make, torch.device("cpu"), queue_depth=2)
        a = loader.next_batch(8, 4, 1)
        b = loader.next_batch(8, 4, 1)
        assert torch.equal(b[0], torch.arange(16, 24).reshape(2, 4)), b
        deadline = time.monotonic() + 10
        while not loader._worker.queue.full():  # bounded poll on queue state
            assert time.monotonic() < deadline
            inner[0].never.wait(0.01)
        print("drew", len(a), len(b), flush=True)
        """
    )
    out, err = finish_child(child, 20)
    assert child.returncode == 0, err
    assert "drew 2 2" in out


def test_process_exits_cleanly_when_consumer_stops_while_worker_builds():
    # Two batches drawn, then the script ends while the worker is building batch 3 (a few
    # ms of torch work). The original script would exit 0; so must the patched one.
    child = run_child(
        """
        loader = _make_train_loader(lambda d: make(d, busy_from=3), torch.device("cpu"), queue_depth=2)
        a = loader.next_batch(8, 4, 1)
        b = loader.next_batch(8, 4, 1)
        inner[0].busy.wait()
        print("drew", len(a), len(b), flush=True)
        """
    )
    out, err = finish_child(child, 20)
    assert "drew 2 2" in out
    assert "terminate called" not in err
    assert child.returncode == 0, err


STUCK_IN_LOADER = """
    loader = _make_train_loader(lambda d: make(d, block_after=3), torch.device("cpu"), queue_depth=2)
    loader.next_batch(8, 4, 1)
    loader.next_batch(8, 4, 1)
    assert inner[0].blocked.wait(10)
    del loader
    print("done", flush=True)
"""

BLOCKED_CALLER = """
    loader = _make_train_loader(lambda d: make(d, block_after=1), torch.device("cpu"), queue_depth=2)
    loader.next_batch(8, 4, 1)
    assert inner[0].blocked.wait(10)
    print("ready", flush=True)
    loader.next_batch(8, 4, 1)  # the worker never delivers batch 2
    print("unreachable", flush=True)
"""


@pytest.fixture(scope="module")
def stuck_children():
    """Both children whose worker is stuck for good, started together so their exits overlap."""
    children = {"stuck": run_child(STUCK_IN_LOADER), "sigint": run_child(BLOCKED_CALLER)}
    yield children
    for child in children.values():
        if child.poll() is None:
            child.kill()
        child.communicate()


@pytest.mark.skipif(os.name != "posix", reason="SIGINT delivery to a child is POSIX-only here")
def test_keyboard_interrupt_while_waiting_for_batch(stuck_children):
    # The main thread waits in next_batch for a batch the worker never delivers; Ctrl-C
    # must end the process promptly, as it would the original script.
    child = stuck_children["sigint"]
    try:
        assert readable_within(child.stdout, 20), "child never printed ready"
        line = child.stdout.readline()
        assert line.strip() == "ready", (line, child.stderr.read() if child.poll() is not None else "")
        t0 = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert "KeyboardInterrupt" in err
    assert "unreachable" not in out
    # CPython ends an uncaught KeyboardInterrupt by re-raising SIGINT: -2, not an abort.
    assert child.returncode == -signal.SIGINT, err
    assert elapsed < 10


def test_process_exits_when_worker_is_stuck_in_loader(stuck_children):
    # The worker is stuck inside the loader for good (a read that never returns); the
    # process must still end, with the wrapper never shut down.
    child = stuck_children["stuck"]
    out, err = finish_child(child, 20)
    assert child.returncode == 0, err
    assert "done" in out


# ---------------------------------------------------------------------------
# Rollback: a changed argument restores the snapshot taken before the next batch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 3])
def test_rollback_on_changed_batch_size_is_exact_without_replay(depth):
    make = lambda d: FakeTokenLoader(3001, d)
    schedule = [(512, 16, 2)] * 6 + [(1024, 16, 2)] * 4 + [(256, 16, 2)] * 7
    want, _ = direct_batches(make, schedule)
    built = []

    def counting(d):
        loader = make(d)
        built.append(loader)
        return loader

    wrapper = _make_train_loader(counting, CPU, queue_depth=depth, rollback=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a replay would warn
        for args, w in zip(schedule, want):
            assert_batch_equal(wrapper.next_batch(*args), w)
    assert len(built) == 1  # never rebuilt: rolled back from snapshots


def test_snapshot_shares_arrays_and_copies_positions():
    from patcher.templates.prefetch_loader import _snapshot

    loader = FakeTokenLoader(1000, CPU)
    loader.next_batch(*ARGS)
    copy = _snapshot(loader)
    assert copy.tokens is loader.tokens  # the shard is shared, not copied
    assert copy.pos == loader.pos
    loader.next_batch(*ARGS)
    assert copy.pos != loader.pos  # positions are the copy's own
