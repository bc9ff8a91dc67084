"""Tests for templates/prefetch_lean.py, the runtime of scripts whose `next_batch`
arguments are run constants, as plain Python and as the cut copy a script receives.

The loader is a small TokenStream-like fake: a deterministic token array read with a
cursor that wraps around, `next_batch(global_tokens, seq_len) -> (x, y)` int64
`[-1, seq_len]`. Every expectation is a direct, unwrapped fake called with the same
arguments. The producer is a forked child, so the fake counts its calls in shared
memory (`multiprocessing.Value`) and signals each call with a `multiprocessing.Event`
that a test waits on; no test sleeps. Children are found in /proc (the runtime forks
them with `os.fork`, not as `multiprocessing` processes); a child that was killed and
reaped is gone from there (`os.kill(pid, 0)` fails), a zombie is not.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import traceback
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import libcst as cst
import numpy as np
import pytest
import torch

import processes
from processes import exits_within
from patcher.proof import host_cuda
from patcher.proof.host_cuda import cuda_on_host
from patcher.proof.compare import copy_batch
from patcher.render import render
from patcher.templates import copy_stream, prefetch_lean, staging
from patcher.templates.prefetch_lean import _live_prefetchers, _make_train_loader, _threads_a_fork_lacks

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
WAIT_S = 10.0  # upper bound on an Event wait that is expected to succeed
ARGS = (96, 8)
FORK = multiprocessing.get_context("fork")


class Stream:
    """TokenStream-like: `next_batch(global_tokens, seq_len)`; `count` (shared) counts
    calls in whichever process makes them and `called[n]` is set at call n; `fail_at`:
    the call number that raises, `error`: what it raises there (call number -> exception);
    `reuse`: hand out views of one buffer it rewrites; `reshape_at`: the call number from
    which batches have another shape."""

    def __init__(self, device, n_tokens=1000, fail_at=None, reuse=False, reshape_at=None, error=None):
        self.tokens = torch.from_numpy((np.arange(n_tokens, dtype=np.int64) * 7919 + 13) % 50257)
        self.device, self.pos, self.fail_at, self.reuse, self.reshape_at = device, 0, fail_at, reuse, reshape_at
        self.error = error or (lambda calls: ValueError(f"shard broken at call {calls}"))
        self.buffer = torch.empty(0, dtype=torch.int64)
        self.count = FORK.Value("i", 0)
        self.called = [FORK.Event() for _ in range(60)]

    def next_batch(self, global_tokens, seq_len):
        self.count.value += 1
        calls = self.count.value
        self.called[min(calls, 59)].set()
        if calls == self.fail_at:
            raise self.error(calls)
        k = global_tokens + 1
        if self.pos + k > self.tokens.numel():
            self.pos = 0
        chunk = self.tokens[self.pos : self.pos + k]
        self.pos += global_tokens
        if self.reuse:
            self.buffer.resize_(k).copy_(chunk)
            chunk = self.buffer
        if self.reshape_at is not None and calls >= self.reshape_at:
            seq_len *= 2
        return chunk[:-1].reshape(-1, seq_len).to(self.device), chunk[1:].reshape(-1, seq_len).to(self.device)


def direct(n, **kwargs):
    loader = Stream(CPU, **{k: v for k, v in kwargs.items() if k != "reuse"})
    return [tuple(t.clone() for t in loader.next_batch(*ARGS)) for _ in range(n)]


def same(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def children() -> set[int]:
    """The pids of this process's children, zombies included."""
    return set(processes.children(os.getpid()))


def reaped(pid: int) -> bool:
    """Whether `pid` is gone: exited and reaped (a zombie still answers `kill(pid, 0)`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# Children alive before the current test began (another test file in this worker may
# have left one behind); the tests here look only at the children they started.
_EARLIER: set = set()


def producers():
    return sorted(children() - _EARLIER)


@pytest.fixture(autouse=True)
def no_live_prefetchers():
    # The runtime forks only where no other thread runs: one left by an earlier test would
    # make every loader here run without prefetch.
    assert not _threads_a_fork_lacks(), "threads left running by an earlier test"
    _EARLIER.clear()
    _EARLIER.update(children())
    yield
    for loader in list(_live_prefetchers.values()):
        loader.shutdown()
    _live_prefetchers.clear()
    assert not producers()


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_batches_are_the_loaders_in_order_across_wraparound(depth):
    want = direct(40)  # 40 x 96 tokens over a 1000-token array: wraps around several times
    loader = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=depth)
    for w in want:
        assert same(loader.next_batch(*ARGS), w)
    assert producers() == [loader.pid]


def cuda_batches(n, monkeypatch, **on_host):
    """`n` batches of a loader with `pinned_slots` (`_hand_out_pinned`: the H2D straight
    from a registered slot) on CUDA driven with host memory (`cuda_on_host`, the H2D
    copies from pinned memory left in flight until something waits for them), all held
    and compared after the block's final synchronize, as a GPU's last step would use
    them. Returns (the batches, the sources of the H2D copies, whether each source is
    pinned memory, the registrations made)."""
    sources = []  # what each H2D reads: the slot, or the pinned copy `_staged_h2d` makes of it
    record = lambda t, *a: sources.append(t) or copy_stream._h2d(t, *a)
    monkeypatch.setattr(prefetch_lean, "_h2d", record)
    monkeypatch.setattr(staging, "_h2d", record)
    with cuda_on_host(**on_host):
        loader = _make_train_loader(lambda d: Stream(d), torch.device("cuda"), queue_depth=2, pinned_slots=True)
        got = [loader.next_batch(*ARGS) for _ in range(n)]
        registered = torch.cuda.cudart().registered
        pinned = [host_cuda.active_copies().is_pinned(t) for t in sources]
    return [tuple(t.as_subclass(torch.Tensor) for t in batch) for batch in got], sources, pinned, registered


def test_on_cuda_a_slot_is_handed_out_through_the_shared_staging(monkeypatch):
    # The default hand-out on CUDA (no `pinned_slots`): each batch is copied out of its
    # slot into pinned memory and its H2D queued from there (templates/staging.py,
    # `_staged_h2d`), so the child refilling the slot cannot change a batch handed out.
    staged = []
    monkeypatch.setattr(prefetch_lean, "_staged_h2d", lambda t, *a: staged.append(t) or staging._staged_h2d(t, *a))
    want = direct(8)
    with cuda_on_host():
        loader = _make_train_loader(lambda d: Stream(d), torch.device("cuda"), queue_depth=2)
        got = [loader.next_batch(*ARGS) for _ in range(8)]
    assert len(got) == 8 and all(same(g, w) for g, w in zip(got, want)) and producers() == [loader.pid]  # each still whole after the 7 later
    assert len(staged) == 16  # x and y of each batch


def test_on_cuda_the_h2d_reads_the_registered_slot_and_the_slot_waits_for_its_copies(monkeypatch):
    # The slots' memory is registered as pinned once, each H2D reads its slot directly
    # (no host copy), and a slot goes back only once the event behind its batch's copies
    # has completed: the copies of 8 batches still in flight until then are exact.
    want = direct(8)
    got, sources, pinned, registered = cuda_batches(8, monkeypatch)
    assert all(same(g, w) for g, w in zip(got, want))
    assert registered == 1 and len(sources) == 16 and all(pinned)  # x and y of each batch, from registered memory


def test_on_cuda_a_slot_given_back_before_its_copies_completed_changes_the_batch(monkeypatch):
    # The planted fault: an event that says "completed" at once gives the slot back with
    # its copies still in flight; the producer refills it, and the copy reads the later batch.
    monkeypatch.setattr(host_cuda._HostEvent, "query", lambda self: True)
    want = direct(8)
    got, _, _, _ = cuda_batches(8, monkeypatch)
    assert not same(got[0], want[0])


def test_on_cuda_a_gpu_far_behind_makes_the_hand_out_wait_for_the_last_slots_copies(monkeypatch):
    # A GPU that never catches up by itself: an event completes only once the host waits
    # for it. Lending the last free slot would leave the producer none and the next hand-out
    # waiting for a batch forever; the hand-out waits for that batch's copies instead.
    monkeypatch.setattr(host_cuda._HostEvent, "query", lambda self: getattr(self, "waited", False))
    monkeypatch.setattr(host_cuda._HostEvent, "synchronize", lambda self: setattr(self, "waited", True) or host_cuda.active_copies().run_through(self.upto))
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("the hand-out waits for a slot that never comes back")))
    signal.setitimer(signal.ITIMER_REAL, WAIT_S)  # a guard against the hang, never reached when it passes
    try:
        got, _, _, _ = cuda_batches(8, monkeypatch)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    assert all(same(g, w) for g, w in zip(got, direct(8)))


def test_on_cuda_a_failed_registration_copies_into_pinned_memory_and_says_so_once(monkeypatch, capfd):
    want = direct(8)
    got, sources, pinned, registered = cuda_batches(8, monkeypatch, register_error=2)
    assert all(same(g, w) for g, w in zip(got, want))
    assert registered == 0 and len(sources) == 16 and all(pinned)  # each a pinned copy
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("prefetch:")]
    assert lines == ["prefetch: slot memory not pinned (2): each batch is copied into pinned memory first"]


@pytest.mark.parametrize("depth", [2, 3])
def test_the_producer_runs_depth_batches_ahead_of_the_batch_held(depth):
    # depth + 2 slots: `depth` built ahead, the batch the caller holds, and the one it
    # held before, which it still holds while it asks for the next (`x, y =
    # next_batch(...)`); a slot goes back at the first hand-out after its batch died.
    loader = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=depth)
    inner = loader.loader
    held = loader.next_batch(*ARGS)  # batch 1, lent while `held` lives
    assert inner.called[depth + 2].wait(WAIT_S)  # every slot filled
    assert not inner.called[depth + 3].wait(0.3), "the producer ran past its slots"
    held = loader.next_batch(*ARGS)  # batch 2, asked for while batch 1 was held
    assert not inner.called[depth + 3].wait(0.3), "a slot given back while its batch was held"
    held = loader.next_batch(*ARGS)  # batch 3: batch 1 has died, its slot goes back
    assert inner.called[depth + 3].wait(WAIT_S)  # depth ahead of batch 3
    assert not inner.called[depth + 4].wait(0.3), "one slot given back, two batches built"
    del held
    loader.next_batch(*ARGS)  # batches 2 and 3 have died: both slots go back
    assert inner.called[depth + 5].wait(WAIT_S)
    assert not inner.called[depth + 6].wait(0.3), "two slots given back, three batches built"


def test_a_batch_handed_out_is_a_view_of_its_slot_until_it_dies():
    # No copy on the CPU: the batch's tensors are views of the shared slot, and the slot
    # goes back to the producer only once the last of them (a derived view included) has
    # died: at the first hand-out after that.
    want = direct(12)
    loader = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=2)
    x, y = loader.next_batch(*ARGS)
    slot = loader.slots[0]
    assert x.untyped_storage().data_ptr() == slot.ctypes.data and list(loader.lent) == [0]
    kept = x[:, :5]  # the user's own view outlives x and y
    del x, y
    got = [copy_batch(loader.next_batch(*ARGS)) for _ in range(11)]  # through the other slots
    assert all(same(g, w) for g, w in zip(got, want[1:])) and torch.equal(kept, want[0][0][:, :5])
    assert loader.lent[0]() is not None
    del kept
    loader.next_batch(*ARGS)
    assert 0 not in loader.lent


@pytest.mark.parametrize("depth", [1, 2])
def test_a_caller_that_keeps_every_batch_gets_clones_past_the_last_free_slot(depth):
    # Every batch kept: the views would take every slot and the producer would wait
    # forever. The hand-out that would leave it none is a clone, its slot freed at once.
    want = direct(10)
    loader = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=depth)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the hand-out waited for a slot no batch frees"))
    signal.alarm(int(WAIT_S))
    try:
        kept = [loader.next_batch(*ARGS) for _ in range(10)]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert all(same(k, w) for k, w in zip(kept, want)) and sum(ref() is not None for ref in loader.lent.values()) == len(loader.slots) - 1


def test_the_training_process_runs_no_thread_of_the_prefetcher():
    # A thread in the training process would take the GIL between the loop's kernel
    # launches; the hand-out is done by the caller, the building by the child.
    before = threading.active_count()
    loader = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=2)
    for w in direct(6):
        assert same(loader.next_batch(*ARGS), w)
    assert threading.active_count() == before


def test_prefetch_off_is_the_original_loader():
    loader = _make_train_loader(lambda d: Stream(d), CPU, prefetch=False)
    assert type(loader) is Stream and not producers()


def test_rebuilding_the_same_variable_resets_its_producer_without_a_new_fork():
    # The warm-up reset: the child that forked at the first batch builds the loader
    # again itself; the batches it had built ahead from the old loader are dropped.
    first = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=3)
    for w in direct(4):
        assert same(first.next_batch(*ARGS), w)
    child = first.pid
    assert first.loader.called[4 + 3].wait(WAIT_S)  # the slots full of the old loader's batches
    second = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=3)
    assert second is first and second.pid == child and producers() == [child]
    for w in direct(10):  # the new loader starts from the beginning
        assert same(second.next_batch(*ARGS), w)
    assert producers() == [child]


SHARD_TOKENS = 1000  # a module global that a rebuild's expression reads


@pytest.mark.parametrize("changed", ["closure", "global"])
def test_a_rebuild_reads_the_values_its_expression_reads_now(changed, monkeypatch):
    # The child's copies of `n` and SHARD_TOKENS are the values at the fork; the rebuild
    # sends today's.
    n = 0
    loader = _make_train_loader(lambda d: Stream(d, n_tokens=n + SHARD_TOKENS), CPU)
    loader.next_batch(*ARGS)
    if changed == "closure":
        n = -500
    else:
        monkeypatch.setattr(sys.modules[__name__], "SHARD_TOKENS", 500)
    want = direct(12, n_tokens=500)
    assert not all(same(a, b) for a, b in zip(want, direct(12))), "the two lengths must give other batches"
    assert _make_train_loader(lambda d: Stream(d, n_tokens=n + SHARD_TOKENS), CPU) is loader
    for w in want:
        assert same(loader.next_batch(*ARGS), w)


def test_a_rebuild_that_cannot_be_sent_starts_a_new_producer():
    # A value of the expression that does not pickle (a lock here): the old child is
    # killed and reaped, and a new one forks at the new loader's first batch.
    lock = threading.Lock()
    first = _make_train_loader(lambda d: Stream(d), CPU)
    first.next_batch(*ARGS)
    child = first.pid
    second = _make_train_loader(lambda d: (lock, Stream(d))[1], CPU)
    assert second is not first and reaped(child)
    for w in direct(5):
        assert same(second.next_batch(*ARGS), w)
    assert producers() == [second.pid]


def test_a_rebuild_whose_construction_fails_raises_it_where_the_script_builds():
    first = _make_train_loader(lambda d: Stream(d), CPU)
    first.next_batch(*ARGS)
    child = first.pid
    with pytest.raises(NeedsTwoArguments, match="shard 3 broken at call 0"):
        _make_train_loader(lambda d: (_ for _ in ()).throw(NeedsTwoArguments(3, 0)), CPU)
    assert reaped(child) and not producers()


def test_a_rebuild_with_values_larger_than_a_pipe_buffer_does_not_wait_forever():
    # The child writes each batch's values after counting it filled; a value larger
    # than the pipe's buffer (64 KiB) blocks it until the caller reads. A rebuild must
    # read them while it waits for the child to see the order.
    def make(d):
        stream = Stream(d)
        return types.SimpleNamespace(next_batch=lambda *a: (stream.next_batch(*a), "x" * 200_000 + str(stream.pos)), called=stream.called)

    loader = _make_train_loader(make, CPU, queue_depth=2)
    loader.next_batch(*ARGS)
    assert loader.loader.called[2].wait(WAIT_S)  # a slot filled; the child is blocked writing its value
    rebuilt = []
    rebuild = threading.Thread(target=lambda: rebuilt.append(_make_train_loader(make, CPU, queue_depth=2)))
    rebuild.start()
    rebuild.join(WAIT_S)
    assert rebuilt == [loader], "the rebuild waited on a child blocked writing a value"
    stream = Stream(CPU)
    for _ in range(4):
        xy, value = loader.next_batch(*ARGS)
        assert same(xy, stream.next_batch(*ARGS)) and value == "x" * 200_000 + str(stream.pos)


def test_a_rebuild_drops_the_old_batches_values_too():
    # Batches with non-tensor leaves: each batch's values travel on a pipe beside the
    # slot; those of the dropped batches must not be handed out with the new ones.
    def make(d):
        stream = Stream(d)
        return types.SimpleNamespace(next_batch=lambda *a: {"xy": stream.next_batch(*a), "pos": stream.pos}, called=stream.called)

    def want(n):
        stream = Stream(CPU)
        return [(stream.next_batch(*ARGS), stream.pos) for _ in range(n)]

    loader = _make_train_loader(make, CPU, queue_depth=2)
    for xy, pos in want(3):
        batch = loader.next_batch(*ARGS)
        assert same(batch["xy"], xy) and batch["pos"] == pos
    assert loader.loader.called[3 + 2].wait(WAIT_S)  # two batches of the old loader in the slots
    assert _make_train_loader(make, CPU, queue_depth=2) is loader
    for xy, pos in want(6):
        batch = loader.next_batch(*ARGS)
        assert same(batch["xy"], xy) and batch["pos"] == pos


def test_a_producer_error_reaches_the_caller_at_its_batch_with_its_traceback():
    want = direct(4)  # (a failing call advances no cursor: the call after it returns the 4th batch)
    loader = _make_train_loader(lambda d: Stream(d, fail_at=4), CPU, queue_depth=3)
    child = None
    for w in want[:3]:
        assert same(loader.next_batch(*ARGS), w)
        child = child or loader.pid
    with pytest.raises(ValueError, match="shard broken at call 4") as raised:
        loader.next_batch(*ARGS)
    # The child's traceback travels as the cause: raised in _produce, inside the loader.
    remote = str(raised.value.__cause__)
    assert "in _produce" in remote and remote.strip('\n"').splitlines()[-1] == "ValueError: shard broken at call 4"
    assert "in next_batch" in remote.split("in _produce", 1)[1]
    # The producer goes on, as the loader would at a next call (a caller that catches the error)
    assert same(loader.next_batch(*ARGS), want[3]) and loader.pid == child


class NeedsTwoArguments(Exception):
    """Pickles, but its class cannot be rebuilt from its args (one message, two parameters)."""

    def __init__(self, shard, call):
        super().__init__(f"shard {shard} broken at call {call}")
        self.shard = shard


class HoldsALock(Exception):
    """Does not pickle: it holds a lock."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def test_an_error_whose_class_takes_other_arguments_arrives_as_itself():
    # The script's own `except ShardError:` still catches it: same class, same message,
    # same attributes, made without calling its __init__; the child's traceback is the cause.
    loader = _make_train_loader(lambda d: Stream(d, fail_at=3, error=lambda calls: NeedsTwoArguments(7, calls)), CPU, queue_depth=2)
    loader.next_batch(*ARGS)
    loader.next_batch(*ARGS)
    with pytest.raises(NeedsTwoArguments) as raised:
        loader.next_batch(*ARGS)
    assert type(raised.value) is NeedsTwoArguments
    assert str(raised.value) == "shard 7 broken at call 3" and raised.value.args == ("shard 7 broken at call 3",) and raised.value.shard == 7
    remote = str(raised.value.__cause__)  # the child's formatted traceback
    assert remote.startswith("Traceback (most recent call last)") and "in next_batch" in remote.split("in _produce", 1)[1]
    assert remote.rstrip().splitlines()[-1].endswith("NeedsTwoArguments: shard 7 broken at call 3")
    assert same(loader.next_batch(*ARGS), direct(3)[2])  # the producer goes on


def test_an_error_that_does_not_pickle_arrives_as_its_type_name_message_and_traceback():
    # Neither an unpickling TypeError in the caller nor a child that dies sending it
    # ("exit code 1"): the type's name, its message and the child's formatted traceback arrive.
    loader = _make_train_loader(lambda d: Stream(d, fail_at=3, error=lambda calls: HoldsALock(f"no lock at call {calls}")), CPU, queue_depth=2)
    loader.next_batch(*ARGS)
    loader.next_batch(*ARGS)
    with pytest.raises(RuntimeError, match="^prefetch: HoldsALock in the producer: no lock at call 3$") as raised:
        loader.next_batch(*ARGS)
    remote = str(raised.value.__cause__)
    assert remote.startswith("Traceback (most recent call last)") and "in next_batch" in remote.split("in _produce", 1)[1]
    assert remote.rstrip().splitlines()[-1].endswith("HoldsALock: no lock at call 3")  # module-qualified, as Python prints it
    assert same(loader.next_batch(*ARGS), direct(3)[2])  # the producer goes on


def test_a_producer_that_dies_is_an_error_with_its_exit_code():
    loader = _make_train_loader(lambda d: Stream(d), CPU, queue_depth=2)
    loader.next_batch(*ARGS)
    assert loader.loader.called[4].wait(WAIT_S)  # every slot filled (depth + 2)
    child = loader.pid
    os.kill(child, signal.SIGKILL)  # as the OOM killer would
    with pytest.raises(RuntimeError, match=f"producer exit code {-signal.SIGKILL}"):
        for _ in range(4):  # the batches already built come first
            loader.next_batch(*ARGS)
    assert reaped(child)


def test_a_producer_that_exits_is_an_error_with_its_own_exit_code():
    # The caller kills and reaps the child it found gone: the code is the child's, not the kill's.
    class Exits(Stream):
        def next_batch(self, *args):
            if self.count.value == 3:
                os._exit(3)
            return super().next_batch(*args)

    loader = _make_train_loader(lambda d: Exits(d), CPU, queue_depth=2)
    loader.next_batch(*ARGS)
    child = loader.pid
    with pytest.raises(RuntimeError, match="^prefetch: producer exit code 3$"):
        for _ in range(3):  # the batch built before the exit comes first
            loader.next_batch(*ARGS)
    assert reaped(child)


def test_an_error_larger_than_a_pipe_buffer_reaches_the_caller():
    # The child blocks in its send until the caller reads: the caller must look for a
    # message while the child is still alive, not only after it exits.
    class Huge(Stream):
        def next_batch(self, *args):
            if self.count.value == 2:
                raise ValueError("x" * 300_000)
            return super().next_batch(*args)

    loader = _make_train_loader(lambda d: Huge(d), CPU, queue_depth=2)
    loader.next_batch(*ARGS)
    loader.next_batch(*ARGS)
    with pytest.raises(ValueError, match="^x{300000}$"):
        loader.next_batch(*ARGS)


def _script_with_a_waiting_producer(path: Path, ending: str) -> Path:
    """Write a script to `path` that starts a lean loader, waits until its child has
    filled both slots and waits for a free one, prints the child's pid, then runs
    `ending` (Python, indented freely). Returns `path`."""
    path.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from patcher.templates.prefetch_lean import _make_train_loader
        from test_prefetch_lean import Stream
        loader = _make_train_loader(lambda d: Stream(d), torch.device("cpu"), queue_depth=2)
        loader.next_batch(96, 8)
        assert loader.loader.called[3].wait(10)  # the child waits for a free slot
        print(loader.pid, flush=True)
    """) + textwrap.dedent(ending))
    return path


def test_the_producer_leaves_when_the_training_process_is_killed(tmp_path):
    # SIGKILL runs no exit handler: the child notices that its parent is gone.
    script = _script_with_a_waiting_producer(tmp_path / "killed.py", """
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    child = int(run.stdout.split()[0])
    assert exits_within(child, WAIT_S), "the producer outlived the training process"


def test_batches_of_another_shape_than_the_first_are_handed_out_exactly():
    # From call 3 on, each batch is twice as wide: the slots are sized by the child's first
    # batch (call 2), so these travel in their messages; the loader's own order still holds.
    want = direct(12, reshape_at=3)
    loader = _make_train_loader(lambda d: Stream(d, reshape_at=3), CPU)
    for w in want:
        assert same(loader.next_batch(*ARGS), w)
    assert producers() == [loader.pid]


def test_other_arguments_or_a_call_after_shutdown_raise():
    want = direct(2)
    loader = _make_train_loader(lambda d: Stream(d), CPU)
    assert same(loader.next_batch(*ARGS), want[0])
    with pytest.raises(RuntimeError, match=r"next_batch\(48, 8\) after next_batch\(96, 8\)"):
        loader.next_batch(48, 8)
    assert same(loader.next_batch(*ARGS), want[1])
    child = loader.pid
    loader.shutdown()
    assert reaped(child)
    with pytest.raises(RuntimeError):
        loader.next_batch(*ARGS)
    never_started = _make_train_loader(lambda d: Stream(d), CPU, name="other")
    never_started.shutdown()
    with pytest.raises(RuntimeError):
        never_started.next_batch(*ARGS)


def test_batches_kept_by_the_caller_do_not_change_when_slots_are_reused():
    # A loader that rewrites one buffer, and a caller that keeps every batch: each
    # batch is copied out of its slot before the slot goes back to the child.
    want = direct(12)
    loader = _make_train_loader(lambda d: Stream(d, reuse=True), CPU, queue_depth=2)
    kept = [loader.next_batch(*ARGS) for _ in range(12)]
    assert all(same(k, w) for k, w in zip(kept, want))


def test_a_script_exits_promptly_with_a_producer_waiting_and_on_ctrl_c(tmp_path):
    script = _script_with_a_waiting_producer(tmp_path / "run.py", """
        if sys.argv[1] == "interrupt":
            raise KeyboardInterrupt
        print("done")
    """)
    for mode in ("exit", "interrupt"):
        run = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60)
        child = int(run.stdout.split()[0])
        with pytest.raises(ProcessLookupError):  # no producer left behind
            os.kill(child, 0)
        assert "Traceback" not in run.stderr.replace("KeyboardInterrupt", "") or mode == "interrupt", run.stderr[-2000:]
        if mode == "exit":
            assert run.returncode == 0 and run.stdout.split()[1] == "done", run.stderr[-2000:]
        else:
            # CPython ends an uncaught KeyboardInterrupt by re-raising SIGINT.
            assert run.returncode == -signal.SIGINT and "KeyboardInterrupt" in run.stderr and "Fatal" not in run.stderr


# --------------------------------------------------------------------------- where a fork cannot be trusted


def function_in(module: str, source: str):
    """The function that `source` defines, as if defined in a module named `module`
    (its frames' globals say `__name__ == module`)."""
    namespace: dict = {"__name__": module}
    exec(compile(textwrap.dedent(source), f"<{module}>", "exec"), namespace)
    return next(v for k, v in namespace.items() if callable(v) and not k.startswith("__"))


def test_the_threads_a_fork_lacks_are_all_but_torch_internals_and_tqdm():
    stop = threading.Event()
    serve = "def serve(stop):\n    stop.wait()\n"
    in_torch = function_in("torch._inductor.compile_worker.subproc_pool", serve)
    threads = {
        # excused: inductor's compile-worker reader, tqdm's monitor
        "torch-internal": (in_torch, False),
        "tqdm-monitor": (function_in("tqdm._monitor", serve), False),
        # counted: the script's own, a script's thread that is inside a torch call, a
        # DataLoader's pin-memory thread, a library that is not torch (torchdata)
        "scripts-own": (stop.wait, True),
        "scripts-own-in-torch": (lambda stop: in_torch(stop), True),
        "pin-memory": (function_in("torch.utils.data._utils.pin_memory", serve), True),
        "torchdata": (function_in("torchdata.nodes.prefetch", serve), True),
    }
    started = [threading.Thread(target=target, args=() if target == stop.wait else (stop,), name=name) for name, (target, _) in threads.items()]
    pool = ThreadPoolExecutor(1, thread_name_prefix="pool")
    pool.submit(lambda: None).result()  # its worker runs concurrent.futures code: counted
    for thread in started:
        thread.start()
    try:
        assert sorted(_threads_a_fork_lacks()) == sorted([name for name, (_, counted) in threads.items() if counted] + ["pool_0"])
    finally:
        stop.set()
        pool.shutdown()
        for thread in started:
            thread.join()
    assert _threads_a_fork_lacks() == []


def prefetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("prefetch ")]


def test_a_thread_alive_at_the_first_batch_means_a_producer_thread_and_one_line(monkeypatch, capsys):
    # No fork (the child would lack the script's thread): a thread of this process builds
    # the batches ahead, the loader's own calls in order; one line says so, and building
    # the variable again (the warm-up reset) resets that thread, without the line.
    moved = []
    monkeypatch.setattr(prefetch_lean, "_staged_h2d", lambda t, device, copy_stream: moved.append((device, copy_stream)) or t)
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="shard-reader")
    helper.start()
    try:
        threads = set()
        for build in range(2):
            loader = _make_train_loader(lambda d: Stream(d, reuse=True), CPU, copy_stream=False, queue_depth=2, name="threaded")
            want = direct(8)
            assert same(loader.next_batch(*ARGS), want[0])
            # Built ahead: the thread fills the slots without a further call here.
            assert loader.loader.called[3 - build].wait(WAIT_S) and prefetch_threads() == ["prefetch threaded"]
            threads.add(loader.thread)
            for w in want[1:]:  # a loader that reuses its buffer: each batch in a slot is a copy
                assert same(loader.next_batch(*ARGS), w)
            assert not producers()
        assert len(threads) == 1, "a rebuild started another thread"
        assert moved == []  # on a CPU device the views are the batch: no staging call (no op)
        _make_train_loader(lambda d: Stream(d), CPU, prefetch=False, name="threaded")  # shuts the thread down, joined
        assert not prefetch_threads()
    finally:
        stop.set()
        helper.join()
    assert capsys.readouterr().err.splitlines() == [
        "prefetch: threads running ['shard-reader']: a forked producer would not have them; threaded prefetches on a thread (TRAIN_PREFETCH=0 silences this)"]


def test_shutting_down_a_producer_thread_blocked_on_a_large_value_returns():
    # The thread writes each batch's values after counting it filled; one larger than
    # the pipe's buffer blocks it until read. A shutdown that joins it must read them.
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="shard-reader")
    helper.start()
    try:
        stream = Stream(CPU)
        loader = _make_train_loader(lambda d: types.SimpleNamespace(next_batch=lambda *a: (stream.next_batch(*a), "x" * 200_000), called=stream.called), CPU, name="blocked")
        loader.next_batch(*ARGS)
        assert stream.called[2].wait(WAIT_S)  # a slot filled; the thread blocked writing its value
        done = threading.Thread(target=lambda: _make_train_loader(lambda d: Stream(d), CPU, prefetch=False, name="blocked"))
        done.start()
        done.join(WAIT_S)
        assert not done.is_alive() and not loader.thread.is_alive(), "the shutdown waited on a thread blocked writing a value"
    finally:
        stop.set()
        helper.join()


def test_a_producer_threads_error_arrives_as_itself_at_its_batch():
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="shard-reader")
    helper.start()
    try:
        loader = _make_train_loader(lambda d: Stream(d, fail_at=3, error=lambda calls: NeedsTwoArguments(7, calls)), CPU, name="threaded_error")
        want = direct(2)
        for w in want:
            assert same(loader.next_batch(*ARGS), w)
        with pytest.raises(NeedsTwoArguments, match="shard 7 broken at call 3") as raised:
            loader.next_batch(*ARGS)
        assert "in next_batch" in "".join(traceback.format_tb(raised.value.__traceback__))
        assert same(loader.next_batch(*ARGS), direct(3)[2])  # the producer goes on
    finally:
        stop.set()
        helper.join()


def test_torch_pools_are_told_apart_by_identity():
    # inductor's compile pool, made by a torch.compile on the CPU: excused; a script's
    # pool with the same thread names: counted.
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    if get_compile_threads() < 2:
        pytest.skip("inductor makes no compile pool with one compile thread")
    compile_pool = AsyncCompile.pool()
    compile_pool.submit(lambda: None).result()
    script_pool = ThreadPoolExecutor(1, thread_name_prefix=compile_pool._thread_name_prefix)
    script_pool.submit(lambda: None).result()
    try:
        names = [t.name for t in script_pool._threads]
        assert _threads_a_fork_lacks() == names
    finally:
        script_pool.shutdown()
    assert _threads_a_fork_lacks() == []


def test_the_slots_are_an_anonymous_file_that_goes_with_the_producer():
    # Nothing named in /dev/shm (a container's is 64 MB, and a killed run leaves no file):
    # the slots are a memfd, mapped here while the producer runs, unmapped after.
    def mapped() -> int:
        return open("/proc/self/maps").read().count("memfd:prefetch-slots")

    before = mapped()
    loader = _make_train_loader(lambda d: Stream(d), CPU, name="memfd")
    for w in direct(6):
        assert same(loader.next_batch(*ARGS), w)
    assert mapped() > before and producers() == [loader.pid]
    _make_train_loader(lambda d: Stream(d), CPU, prefetch=False, name="memfd")
    loader.slots.clear()
    import gc

    gc.collect()
    assert mapped() == before


def test_a_full_dev_shm_keeps_the_forked_producer(monkeypatch, capsys):
    # A full /dev/shm refuses a named semaphore (sem_open: ENOSPC) and a torch shared
    # tensor; the producer uses neither: a forked child, no line.
    import _multiprocessing

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    stream, want = Stream(CPU), direct(6)  # before the patch: the fake's counters are semaphores
    monkeypatch.setattr(_multiprocessing, "SemLock", no_room)
    monkeypatch.setattr(torch.Tensor, "share_memory_", no_room)
    loader = _make_train_loader(lambda d: stream, CPU, name="full_shm")
    for w in want:
        assert same(loader.next_batch(*ARGS), w)
    assert producers() == [loader.pid] and loader.slots[0] is not None
    assert capsys.readouterr().err == ""


def test_without_memfd_the_batches_travel_in_their_messages_from_the_forked_producer(monkeypatch, capsys):
    # No anonymous file (not Linux, or no memory for it): still the forked producer, no
    # line, each batch's tensors in its message.
    def no_memfd(*args):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "memfd_create", no_memfd)
    loader = _make_train_loader(lambda d: Stream(d, reuse=True), CPU, name="no_memfd")
    for w in direct(8):
        assert same(loader.next_batch(*ARGS), w)
    assert producers() == [loader.pid] and loader.slots == [None] * 4
    assert capsys.readouterr().err == ""


def test_a_process_the_script_forks_does_not_touch_the_producer():
    # What a child of the training process runs at its exit (the runtime's exit hook,
    # a rebuild) shuts down nothing of the training process's, and the batch it
    # inherited dies there without freeing its slot: the training process still holds it.
    want = direct(8)
    loader = _make_train_loader(lambda d: Stream(d), CPU)
    held = loader.next_batch(*ARGS)
    child = os.fork()
    if child == 0:
        try:
            del held
            for prefetcher in list(_live_prefetchers.values()):
                prefetcher.shutdown()
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    for w in want[1:]:
        assert same(loader.next_batch(*ARGS), w)
    assert same(held, want[0]) and producers() == [loader.pid]


def test_a_process_the_script_forks_keeps_the_batch_it_had():
    # A child forked right after next_batch reads its batch after the training process
    # freed that batch's slot and the producer refilled it: the child has its own copy,
    # as fork gives the original's. The child waits on a pipe, not a sleep.
    want = direct(8)
    loader = _make_train_loader(lambda d: Stream(d), CPU)
    held = loader.next_batch(*ARGS)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        ok = False
        try:
            os.close(write)
            os.read(read, 1)
            ok = same(held, want[0])
        finally:
            os._exit(0 if ok else 1)
    os.close(read)
    del held
    for w in want[1:6]:  # more batches than slots: the held batch's slot refilled
        assert same(loader.next_batch(*ARGS), w)
    os.write(write, b"x")
    os.close(write)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0


def _cut_runtime(options: dict) -> dict:
    """The lean runtime a script whose one call passes `options` receives, executed as a module."""
    facts = render.cut_facts(["prefetch_lean"], {"_make_train_loader": [options]})
    body = render.runtime_block(["prefetch_lean"], set(), False, ["TRAIN_PREFETCH"], facts, {"_make_train_loader", "next_batch"})
    module = sys.modules["cut_runtime"] = types.ModuleType("cut_runtime")  # importable, as a script's __main__ is: its batches' parts pickle by name
    exec(compile(cst.Module(body=body).code, "<cut runtime>", "exec"), module.__dict__)
    return module.__dict__


def test_the_cut_copy_hands_out_the_loaders_batches():
    runtime = _cut_runtime({})
    want = direct(12)
    first = runtime["_make_train_loader"](lambda d: Stream(d), CPU)
    first.next_batch(*ARGS)
    child = first.pid
    loader = runtime["_make_train_loader"](lambda d: Stream(d), CPU)  # reset: every name `reset` and `_produce` need (marshal, types) is there
    assert loader is first and producers() == [child]
    for w in want:
        assert same(loader.next_batch(*ARGS), w)
    # The error path too: every name it needs (pickle, traceback) is imported in the cut copy.
    failing = runtime["_make_train_loader"](lambda d: Stream(d, fail_at=2), CPU, name="other")
    failing.next_batch(*ARGS)
    with pytest.raises(ValueError, match="shard broken at call 2") as raised:
        failing.next_batch(*ARGS)
    assert "in _produce" in str(raised.value.__cause__)
    loader.shutdown()
    failing.shutdown()
    assert not producers()
    runtime["_live_prefetchers"].clear()  # their slots unmapped: a later test counts the mappings
    del sys.modules["cut_runtime"]


def test_the_cut_copy_has_only_what_a_default_script_uses():
    facts = render.cut_facts(["prefetch_lean"], {"_make_train_loader": [{"prefetch": True, "copy_stream": True}]})
    code = cst.Module(body=render.runtime_block(["prefetch_lean"], set(), False, [], facts, {"_make_train_loader", "next_batch"})).code
    for gone in ('"""', "# ", "_stage(", "_h2d_timers", "queue_depth", "pinned_slots", "_hand_out_pinned", "cudaHostRegister"):
        assert gone not in code.strip().split("\n", 1)[1], gone  # after the header line
    assert "class _PrefetchLoader" in code and "def _produce" in code and "_h2d" in code
    # Bytes a raw-counted script pays: 13,035 today (`pinned_slots`, an option no patch
    # passes yet, is cut: 821 bytes; 12,999 before each producer's lent
    # slots were registered once, not a weak dictionary entry a hand-out (36); 12,896 before a hand-out with fewer
    # torch calls: numpy views of the slots, one view and one as_strided a tensor, no
    # `.to()` on the CPU, and a span that travels padded to 64 bytes (103); 11,998 before tensors whose bytes
    # overlap in one storage travelled as one span, with their strides (898); 11,150 before a process the script
    # forks kept the batch it had, its lent slots' pages made private there (848); 10,794 before a built-in exception
    # kept its fields (150: SystemExit.code, OSError.filename), a loader error the caller
    # catches left the producer going (-1), next_batch took a lock (130) and a child the
    # kernel reaped was accepted at exit (74); 7,309 before the producer ran where
    # a fork cannot be trusted, 9,136 before one producer started once, 10,509 before
    # the staging, error transport and signal set-up every producer shares, 10,912 before
    # a producer thread was stopped and joined at exit, 11,019 before the one process
    # producer's transport: memfd slots, a message a batch, free slots as bytes; 10,459
    # before a batch was lent as views of its slot, freed when they die). 1,109 of them
    # hand out batches of any structure; about 1,700 survive what real scripts do (the
    # child forked with os.fork and reaped, the default signal handlers in it, its
    # back-off while idle); about 1,800 run the producer where a fork cannot be trusted
    # (on a thread, torch's own pools told by identity, the script's exception rebuilt
    # as itself, its pipes read while it is joined); about 1,200 reset the producer at a
    # rebuild instead of forking again.
    assert len(code.encode()) <= 13035, len(code.encode())


# --------------------------------------------------------------------------- any batch structure

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Packed:
    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int


class Structured:
    """A loader whose batches carry per-batch non-tensor values beside tensors, in the
    structures real loaders return (nanochat's state dict, modded-nanogpt's numpy array,
    a step counter, a document-packing dataclass). `shape(calls)`: the structure of call n."""

    def __init__(self, device, shape):
        self.device, self.shape, self.calls = device, shape, 0

    def next_batch(self, global_tokens, seq_len):
        self.calls += 1
        n = self.calls
        x = (torch.arange(global_tokens, dtype=torch.int64) * n).reshape(-1, seq_len).to(self.device)
        return self.shape(n, x)


STRUCTURES = {
    "tuple-with-int-counter": lambda n, x: (x, x + 1, n),
    "dict-with-state": lambda n, x: {"inputs": x, "state": {"pq_idx": n // 3, "rg_idx": n % 3, "epoch": 1.5 * n}},
    "namedtuple": lambda n, x: Pair(x, x * 2),
    "dataclass": lambda n, x: Packed(x, torch.tensor([0, n, 2 * n], dtype=torch.int32), 7 * n),
    "list-with-numpy-string-none": lambda n, x: [x, np.arange(n % 4 + 1, dtype=np.int64), f"shard_{n}", None],
    "one-tensor": lambda n, x: x,
}


def _thread_runtime_loader(make_loader, device, name):
    from patcher.templates.prefetch_loader import _make_train_loader as make_thread_loader

    return make_thread_loader(make_loader, device, name=name)


RUNTIMES = {
    "forked": lambda make_loader, device, name: _make_train_loader(make_loader, device, name=name),
    "thread": _thread_runtime_loader,
}


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("name", list(STRUCTURES))
def test_every_batch_structure_is_handed_out_exactly_with_its_own_values(name, runtime):
    from patcher.proof.compare import first_difference

    shape = STRUCTURES[name]
    reference = Structured(CPU, shape)
    want = [reference.next_batch(*ARGS) for _ in range(12)]
    loader = RUNTIMES[runtime](lambda d: Structured(d, shape), CPU, f"structured_{name}")
    try:
        for n, w in enumerate(want):
            got = loader.next_batch(*ARGS)
            assert type(got) is type(w)
            assert first_difference(w, got) is None, (n, first_difference(w, got))
    finally:
        loader.shutdown()


def test_a_change_of_structure_mid_run_is_handed_out_as_it_is():
    # Each batch's message carries its own structure: the int that becomes a float at
    # call 4, and a third tensor from call 6, arrive as the loader made them.
    def shape(n, x):
        return (x, n) if n < 4 else (x, float(n)) if n < 6 else (x, float(n), x * 3)

    reference = Structured(CPU, shape)
    want = [reference.next_batch(*ARGS) for _ in range(10)]
    loader = _make_train_loader(lambda d: Structured(d, shape), CPU)
    from patcher.proof.compare import first_difference

    try:
        for n, w in enumerate(want):
            got = loader.next_batch(*ARGS)
            assert type(got[1]) is type(w[1]) and first_difference(w, got) is None, (n, first_difference(w, got))
    finally:
        loader.shutdown()
