"""The thread producer's generator runner (templates/prefetch_loader.py) as plain Python: a data generator run ahead on a thread."""

from __future__ import annotations

import threading
import traceback

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patcher.templates.prefetch_loader import _prefetch_iterator, _prefetch_next_batch, _PrefetchIterator, _record_stream
from patcher.templates.prefetch_loader import _live_prefetchers

WAIT_S = 5.0


def token_generator(n_items=None, fail_at=None, gate=None, made=None):
    """Yields (inputs, targets, numpy array) built from a counter; optional end, failure, gate."""
    i = 0
    while n_items is None or i < n_items:
        if gate is not None:
            gate(i)
        if fail_at is not None and i == fail_at:
            raise ValueError(f"bad shard at item {i}")
        base = torch.arange(12, dtype=torch.int32) * 7 + 1000 * i
        if made is not None:
            made.append(i)
        yield base[:-1].view(-1, 11).to(torch.int64), base[1:].view(-1, 11).to(torch.int64), base.numpy().copy()
        i += 1


def assert_item_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got[:2], want[:2]):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    assert (got[2] == want[2]).all()


@pytest.fixture
def clean():
    created = []
    _live_prefetchers.clear()
    yield created
    for it in list(_live_prefetchers.values()) + created:
        it.shutdown()
    _live_prefetchers.clear()


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_items_in_order_and_identical(depth, clean):
    want = list(token_generator(30))
    it = _prefetch_iterator(lambda: token_generator(), queue_depth=depth)
    clean.append(it)
    assert isinstance(it, _PrefetchIterator)
    for w in want:
        assert_item_equal(next(it), w)


def test_end_of_data_is_stop_iteration_at_the_same_item(clean):
    it = _prefetch_iterator(lambda: token_generator(5), queue_depth=3)
    clean.append(it)
    assert len([item for item in it]) == 5  # a for loop ends where the generator ends
    with pytest.raises(StopIteration):
        next(it)


def test_exception_reraised_at_its_item_with_the_workers_traceback(clean):
    it = _prefetch_iterator(lambda: token_generator(fail_at=3), queue_depth=2)
    clean.append(it)
    for _ in range(3):
        next(it)
    with pytest.raises(ValueError, match="bad shard at item 3") as info:
        next(it)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "token_generator" in frames  # the worker's frames, not only the caller's


def test_prefetch_off_returns_the_generator_itself(clean):
    gen = token_generator(3)
    assert _prefetch_iterator(lambda: gen, prefetch=False) is gen


def resizable_generator(tokens_per_item=6, made=None):
    """A stream of int32 tokens cut into items whose length `.send(n)` changes (the
    modded-nanogpt shape: the new size applies from the next item on)."""
    stream = torch.arange(100_000, dtype=torch.int32) * 3
    pos = 0
    while True:
        item = stream[pos : pos + tokens_per_item].clone()
        pos += tokens_per_item
        if made is not None:
            made.append(pos)
        new = yield item, tokens_per_item
        if new is not None:
            tokens_per_item = new


def drive(iterator, calls):
    """Items of `iterator` for `calls` (None: next(); int: send(int))."""
    return [next(iterator) if c is None else iterator.send(c) for c in calls]


def test_send_none_is_next(clean):
    want = list(token_generator(2))
    it = _prefetch_iterator(lambda: token_generator(), queue_depth=2)
    clean.append(it)
    assert_item_equal(it.send(None), want[0])
    assert_item_equal(it.send(None), want[1])


@settings(max_examples=25, deadline=None)
@given(calls=st.lists(st.none() | st.integers(1, 9), min_size=1, max_size=25), depth=st.integers(1, 3))
def test_send_of_a_value_hands_out_what_the_generator_would(calls, depth):
    """Items built ahead with the old size are never handed out: every item equals the
    plain generator's under the same next/send sequence."""
    calls = [None] + calls  # a just-started generator takes no value
    it = _prefetch_iterator(lambda: resizable_generator(), queue_depth=depth)
    try:
        got = drive(it, calls)
    finally:
        it.shutdown()
    want = drive(resizable_generator(), calls)
    assert [(g[0].tolist(), g[1]) for g in got] == [(w[0].tolist(), w[1]) for w in want]


def test_send_rebuilds_then_runs_ahead_again(clean):
    made = []
    it = _prefetch_iterator(lambda: resizable_generator(made=made), queue_depth=2)
    clean.append(it)
    drive(it, [None, None, None])
    item = it.send(4)
    assert item[1] == 4 and item[0].tolist() == [3 * t for t in range(18, 22)]
    # after the send, the new generator runs ahead with the new size
    it._worker.queue.wait_full(WAIT_S)
    assert made[-1] > 22 and (made[-1] - 22) % 4 == 0


def test_send_before_the_first_item_and_without_a_rebuild_recipe(clean):
    it = _prefetch_iterator(lambda: resizable_generator(), queue_depth=2)
    clean.append(it)
    with pytest.raises(TypeError, match="just-started"):
        it.send(5)
    plain = _PrefetchIterator(resizable_generator(), queue_depth=2)
    clean.append(plain)
    next(plain)
    with pytest.raises(RuntimeError, match="cannot be rebuilt"):
        plain.send(5)


def test_send_after_the_end_is_stop_iteration(clean):
    it = _prefetch_iterator(lambda: token_generator(1), queue_depth=2)
    clean.append(it)
    next(it)
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(StopIteration):
        it.send(3)


def test_builds_at_most_depth_plus_two_items_ahead(clean):
    # One handed out, `depth` queued, one built and waiting for room.
    depth = 3
    reached = threading.Event()
    overrun = threading.Event()
    made = []

    def gate(i):
        if i == depth + 1:
            reached.set()
        if i > depth + 1:
            overrun.set()

    it = _prefetch_iterator(lambda: token_generator(gate=gate, made=made), queue_depth=depth)
    clean.append(it)
    next(it)
    assert reached.wait(WAIT_S)
    assert not overrun.wait(0.5), "worker built more than depth + 2 items"
    assert len(made) == depth + 2


def test_rebuilding_the_variable_stops_the_previous_worker(clean):
    first = _prefetch_iterator(lambda: token_generator(), queue_depth=2)
    next(first)
    thread = first._worker.thread
    second = _prefetch_iterator(lambda: token_generator(), queue_depth=2)
    clean.append(second)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        next(first)
    assert_item_equal(next(second), next(token_generator()))


class _CudaLooking(torch.Tensor):
    """A host tensor that says it is on CUDA, to see which tensors get `record_stream`."""

    @property
    def is_cuda(self):
        return True


def test_record_stream_reaches_cuda_tensors_only(monkeypatch):
    """Nested tuples, lists and dicts are walked; host tensors and other values get no CUDA call."""
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append((self, stream)), raising=False)
    deep = torch.zeros(3).as_subclass(_CudaLooking)
    _record_stream((torch.zeros(2), [torch.ones(1), {"a": deep, "b": torch.zeros(1)}], 3, None), stream="side")
    assert len(recorded) == 1
    assert recorded[0][0] is deep and recorded[0][1] == "side"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_items_identical_on_the_copy_stream(clean):
    def cuda_generator():
        for item in token_generator(20):
            yield tuple(t.to("cuda", non_blocking=True) for t in item[:2])

    want = [tuple(t.cpu() for t in item) for item in cuda_generator()]
    it = _prefetch_iterator(cuda_generator, queue_depth=2, copy_stream=True)
    clean.append(it)
    for w in want:
        got = next(it)
        assert all(g.is_cuda for g in got)
        assert all(torch.equal(g.cpu(), x) for g, x in zip(got, w))


# ---------------------------------------------------------------------------
# _prefetch_next_batch: a loader class whose next_batch() moves batches itself


class CountingLoader:
    """next_batch() -> (x, y) from a cursor; reset() rewinds; ntok_total is an attribute."""

    built = 0

    def __init__(self):
        CountingLoader.built += 1
        self.pos = 0
        self.ntok_total = 10_000

    def reset(self):
        self.pos = 0

    def next_batch(self, rows=2):
        base = torch.arange(self.pos, self.pos + rows * 8, dtype=torch.int64).reshape(rows, 8)
        self.pos += rows * 8
        return base, base + 1


def direct_calls(calls):
    loader, out = CountingLoader(), []
    for name, args in calls:
        result = getattr(loader, name)(*args)
        if name == "next_batch":
            out.append(result)
    return out


def test_calls_ahead_exact_with_reset_and_attribute_reads(clean):
    calls = [("next_batch", ())] * 5 + [("reset", ())] + [("next_batch", ())] * 4 + [("next_batch", (3,))] * 3
    want = direct_calls(calls)
    loader = _prefetch_next_batch(CountingLoader, queue_depth=3)
    clean.append(loader)
    assert loader.ntok_total == 10_000  # read before any batch: prefetch still starts
    got = []
    for name, args in calls:
        result = getattr(loader, name)(*args)
        if name == "next_batch":
            got.append(result)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])


def test_calls_ahead_runs_ahead_until_something_else_is_used(clean):
    loader = _prefetch_next_batch(CountingLoader, queue_depth=2)
    clean.append(loader)
    loader.ntok_total
    loader.next_batch()
    assert loader._ahead is not None and loader._ahead._worker.thread.is_alive()
    built_before = CountingLoader.built
    loader.reset()  # the loader ran ahead: rebuilt and replayed to the caller's position first
    assert CountingLoader.built == built_before + 1 and loader._ahead is None
    x, _ = loader.next_batch()
    assert torch.equal(x[0], torch.arange(8))  # after reset: the start of the stream


def test_calls_ahead_prefetch_off_is_the_loader(clean):
    assert type(_prefetch_next_batch(CountingLoader, prefetch=False)) is CountingLoader
