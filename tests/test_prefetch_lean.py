"""Tests for templates/prefetch_lean.py, the runtime of scripts whose `next_batch`
arguments are run constants, as plain Python and as the cut copy a script receives.

The loader is a small TokenStream-like fake: a deterministic token array read with a
cursor that wraps around, `next_batch(global_tokens, seq_len) -> (x, y)` int64
`[-1, seq_len]`. Every expectation is a direct, unwrapped fake called with the same
arguments. The worker is observed and steered with threading.Event, never sleeps.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import traceback
from pathlib import Path

import libcst as cst
import numpy as np
import pytest
import torch

from patcher.render import render
from templates import prefetch_lean
from templates.prefetch_lean import _live_prefetchers, _make_train_loader

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
WAIT_S = 5.0  # upper bound on an Event wait that is expected to succeed
ARGS = (96, 8)


class Stream:
    """TokenStream-like: `next_batch(global_tokens, seq_len)`; `calls` counts calls and
    `called` (an Event per call number) lets a test wait for the worker; `fail_at`:
    the call number that raises; `reuse`: hand out views of one buffer it rewrites."""

    def __init__(self, device, n_tokens=1000, fail_at=None, reuse=False):
        self.tokens = torch.from_numpy((np.arange(n_tokens, dtype=np.int64) * 7919 + 13) % 50257)
        self.device, self.pos, self.calls, self.fail_at, self.reuse = device, 0, 0, fail_at, reuse
        self.buffer = torch.empty(0, dtype=torch.int64)
        self.called = [threading.Event() for _ in range(200)]

    def next_batch(self, global_tokens, seq_len):
        self.calls += 1
        self.called[self.calls].set()
        if self.calls == self.fail_at:
            raise ValueError(f"shard broken at call {self.calls}")
        k = global_tokens + 1
        if self.pos + k > self.tokens.numel():
            self.pos = 0
        chunk = self.tokens[self.pos : self.pos + k]
        self.pos += global_tokens
        if self.reuse:
            self.buffer.resize_(k).copy_(chunk)
            chunk = self.buffer
        return chunk[:-1].reshape(-1, seq_len).to(self.device), chunk[1:].reshape(-1, seq_len).to(self.device)


def direct(n, **kwargs):
    loader = Stream(CPU, **{k: v for k, v in kwargs.items() if k != "reuse"})
    return [tuple(t.clone() for t in loader.next_batch(*ARGS)) for _ in range(n)]


def workers():
    return [t for t in threading.enumerate() if t.name == "train-prefetch" and t.is_alive()]


@pytest.fixture(autouse=True)
def no_live_prefetchers():
    yield
    for loader in list(_live_prefetchers.values()):
        loader.shutdown()
    _live_prefetchers.clear()
    assert not workers()


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_batches_are_the_loaders_in_order_across_wraparound(depth):
    want = direct(40)  # 40 x 96 tokens over a 1000-token array: wraps around several times
    loader = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=depth)
    for w in want:
        got = loader.next_batch(*ARGS)
        assert all(torch.equal(g, x) for g, x in zip(got, w))
    assert len(workers()) == 1


def test_worker_runs_at_most_depth_plus_one_batches_ahead():
    depth = 2
    loader = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=depth)
    inner = loader.loader
    loader.next_batch(*ARGS)
    assert inner.called[1 + depth + 1].wait(WAIT_S)  # depth queued, one more built and waiting for room
    assert not inner.called[1 + depth + 2].wait(0.3), "the worker ran past its queue"
    loader.next_batch(*ARGS)
    assert inner.called[1 + depth + 2].wait(WAIT_S)


def test_prefetch_off_is_the_original_loader():
    loader = _make_train_loader(lambda d: Stream(d), CPU, prefetch=False)
    assert type(loader) is Stream and not workers()


def test_rebuilding_the_same_slot_stops_the_previous_worker():
    first = _make_train_loader(lambda d: Stream(d), CPU)
    first.next_batch(*ARGS)
    second = _make_train_loader(lambda d: Stream(d), CPU)  # the warm-up reset
    assert not first.thread.is_alive()
    want = direct(5)
    for w in want:  # the new loader starts from the beginning
        assert all(torch.equal(g, x) for g, x in zip(second.next_batch(*ARGS), w))
    assert workers() == [second.thread]


def test_a_worker_error_reaches_the_caller_at_its_batch_with_its_traceback():
    want = direct(3)
    loader = _make_train_loader(lambda d: Stream(d, fail_at=4), CPU, queue_depth=3)
    for w in want:
        assert all(torch.equal(g, x) for g, x in zip(loader.next_batch(*ARGS), w))
    with pytest.raises(ValueError, match="shard broken at call 4") as raised:
        loader.next_batch(*ARGS)
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert "_run" in frames and frames[-1] == "next_batch"  # raised inside the worker, in the loader
    assert not loader.thread.is_alive()
    with pytest.raises(RuntimeError, match="shutdown"):
        loader.next_batch(*ARGS)


def test_other_arguments_or_a_call_after_shutdown_raise():
    want = direct(2)
    loader = _make_train_loader(lambda d: Stream(d), CPU)
    assert all(torch.equal(g, x) for g, x in zip(loader.next_batch(*ARGS), want[0]))
    with pytest.raises(RuntimeError, match=r"next_batch\(48, 8\) after next_batch\(96, 8\)"):
        loader.next_batch(48, 8)
    assert all(torch.equal(g, x) for g, x in zip(loader.next_batch(*ARGS), want[1]))
    loader.shutdown()
    assert not loader.thread.is_alive()
    with pytest.raises(RuntimeError):
        loader.next_batch(*ARGS)


@pytest.mark.parametrize("host_copy", [True, False])
def test_host_copy_protects_batches_from_a_loader_that_reuses_its_buffer(host_copy):
    want = direct(6)
    loader = _make_train_loader(lambda d: Stream(d, reuse=True), CPU, queue_depth=3, host_copy=host_copy)
    got = [loader.next_batch(*ARGS) for _ in range(6)]
    exact = [all(torch.equal(g, x) for g, x in zip(b, w)) for b, w in zip(got, want)]
    # Without the copy, queued batches view the one buffer the loader keeps rewriting.
    assert all(exact) if host_copy else not all(exact)


def test_shutdown_wakes_a_worker_waiting_for_room():
    loader = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=1)
    loader.next_batch(*ARGS)
    assert loader.loader.called[3].wait(WAIT_S)  # one queued, one built: the worker waits for room
    loader.shutdown()
    assert not loader.thread.is_alive()


def test_a_script_exits_promptly_with_a_worker_waiting_and_on_ctrl_c(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from templates.prefetch_lean import _make_train_loader
        from test_prefetch_lean import Stream
        loader = _make_train_loader(lambda d: Stream(d), torch.device("cpu"), queue_depth=2)
        loader.next_batch(96, 8)
        assert loader.loader.called[4].wait(5)
        if sys.argv[1] == "interrupt":
            raise KeyboardInterrupt
        print("done")
    """))
    done = subprocess.run([sys.executable, str(script), "exit"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
    interrupted = subprocess.run([sys.executable, str(script), "interrupt"], capture_output=True, text=True, timeout=60)
    # CPython ends an uncaught KeyboardInterrupt by re-raising SIGINT; no abort from a worker inside torch.
    assert interrupted.returncode == -signal.SIGINT and "KeyboardInterrupt" in interrupted.stderr and "Fatal" not in interrupted.stderr


def _cut_runtime(passed: set[str]) -> dict:
    """The lean runtime a script passing the keywords `passed` receives, executed as a module."""
    facts = render.cut_facts(["prefetch_lean"], passed)
    body = render.runtime_block(["prefetch_lean"], set(), False, ["TRAIN_PREFETCH"], facts, {"_make_train_loader", "next_batch"})
    namespace: dict = {"__name__": "cut_runtime"}
    exec(compile(cst.Module(body=body).code, "<cut runtime>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("options", [{}, {"host_copy": False}], ids=["default", "host-copy-off"])
def test_the_cut_copy_hands_out_the_loaders_batches(options):
    runtime = _cut_runtime(set(options))
    want = direct(12)
    first = runtime["_make_train_loader"](lambda d: Stream(d), CPU, queue_depth=2, **options)
    first.next_batch(*ARGS)
    loader = runtime["_make_train_loader"](lambda d: Stream(d), CPU, queue_depth=2, **options)
    assert not first.thread.is_alive()
    for w in want:
        assert all(torch.equal(g, x) for g, x in zip(loader.next_batch(*ARGS), w))
    loader.shutdown()
    assert not workers()


def test_the_cut_copy_has_only_what_a_default_script_uses():
    facts = render.cut_facts(["prefetch_lean"], set())
    code = cst.Module(body=render.runtime_block(["prefetch_lean"], set(), False, [], facts, {"_make_train_loader", "next_batch"})).code
    for gone in ("assembly", "host_copy", '"""', "# ", "_CUT_OPTIONS"):
        assert gone not in code.strip().split("\n", 1)[1], gone  # after the header line
    assert "class _PrefetchLoader" in code and "_h2d" in code
    assert len(code.encode()) < 3400, len(code.encode())  # bytes a raw-counted script pays (3,248 today)
    assert prefetch_lean._CUT_OPTIONS == {"host_copy": True, "assembly": None}
