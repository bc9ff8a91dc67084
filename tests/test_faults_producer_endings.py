"""How a run ends when its loader or its script does something the producer must pass on
as the original would (templates/prefetch_lean.py, templates/staging.py):
a script that ignores SIGCHLD (the kernel reaps its children), a loader that calls
`sys.exit`, a built-in exception with fields outside its `args`, tensors of a batch that share
memory, a loader error the
caller catches before it calls `next_batch` again, and `next_batch` from two threads at
once. The rule: the patched run ends as the original (the same values, the same exit
code, the same last line) and prints nothing more on stderr.

The loader is `Shards`, a small counter-based loader (batch k is `arange` over call k's
range, so a batch names its call); the starts under test are the forked producer and
the producer thread (`_threads_a_fork_lacks` made to name a thread), and, in one script
run, the spawned generator (module mode).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import traceback
from pathlib import Path

import pytest
import torch

from patcher.templates import prefetch_lean, prefetch_loader
from patcher.templates.prefetch_lean import _live_prefetchers, _make_train_loader
from patcher.templates.staging import _producer_error, _rebuilt
from processes import readable_within

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
WAIT_S = 30.0  # a join expected to succeed; longer means a hang


class ShardError(Exception):
    """The script's own error: its `__init__` takes other arguments than its args."""

    def __init__(self, shard, call):
        super().__init__(f"shard {shard} unreadable at call {call}")
        self.shard = shard


class Shards:
    """`next_batch(n) -> (x, y)`, int64 `[n]`: call k's batch is `arange(k*n, k*n+n+1)`
    split as x, y. `fail`: call number -> the exception that call raises (the loader
    goes on at the next call, as a loader that skips a bad shard does)."""

    def __init__(self, device, fail=None):
        self.calls, self.fail = 0, fail or {}

    def next_batch(self, n):
        self.calls += 1
        if self.calls in self.fail:
            raise self.fail[self.calls](self.calls)
        chunk = torch.arange(self.calls * n, self.calls * n + n + 1)
        return chunk[:-1], chunk[1:]


def original(n_calls, fail=None):
    """What the original loop sees: each call's batch, or its exception (class, str)."""
    return patched(Shards(CPU, fail), n_calls)


def patched(loader, n_calls):
    """What a loop that catches each error sees of `loader`: each call's batch, or its exception (class, str)."""
    seen = []
    for _ in range(n_calls):
        try:
            seen.append(tuple(t.clone() for t in loader.next_batch(8)))
        except BaseException as error:
            seen.append((type(error), str(error)))
    return seen


def same(got, want):
    return len(got) == len(want) and all(
        type(g) is type(w) and (g == w if not isinstance(g[0], torch.Tensor) else all(torch.equal(a, b) for a, b in zip(g, w))) for g, w in zip(got, want))


@pytest.fixture(autouse=True)
def no_live_prefetchers():
    yield
    for loader in list(_live_prefetchers.values()):
        loader.shutdown()
    _live_prefetchers.clear()


@pytest.fixture(params=["forked", "thread"])
def start(request, monkeypatch, capsys):
    """The producer's start: a forked child, or a thread of this process (the fork refused)."""
    if request.param == "thread":
        monkeypatch.setattr(prefetch_lean, "_threads_a_fork_lacks", lambda: ["reader"])
    yield request.param
    err = capsys.readouterr().err.splitlines()
    assert err == ([] if request.param == "forked" else [
        "prefetch: threads running ['reader']: a forked producer would not have them; train_loader prefetches on a thread (TRAIN_PREFETCH=0 silences this)"])


# --------------------------------------------------------------------------- 2, 3. the exception as the original's

def _errors():
    try:
        b"\xff\xfeok".decode("utf-8")
    except UnicodeDecodeError as error:
        decode = error
    return {
        "SystemExit(5)": SystemExit(5),
        "sys.exit(message)": SystemExit("loader gave up: no more shards"),
        "FileNotFoundError": FileNotFoundError(2, "No such file or directory", "/data/missing_shard_0042.bin"),
        "OSError with filename2": OSError(18, "Invalid cross-device link", "/a/shard.bin", None, "/b/shard.bin"),
        "UnicodeDecodeError": decode,
        "StopIteration.value": StopIteration(41),
        "ImportError name": ImportError("no module sentencepiece", name="sentencepiece"),
        "script's own class": ShardError(42, 7),
    }


FIELDS = ("args", "code", "errno", "strerror", "filename", "filename2", "value", "encoding", "object", "start", "end", "reason", "name", "path", "shard")


@pytest.mark.parametrize("name", list(_errors()))
def test_an_exception_arrives_with_its_fields_and_the_originals_last_line(name):
    error = _errors()[name]
    got = _rebuilt(pickle.loads(pickle.dumps(_producer_error(error))))  # as it crosses from a producer process
    assert type(got) is type(error)
    assert traceback.format_exception_only(got) == traceback.format_exception_only(error)
    assert {f: getattr(got, f, None) for f in FIELDS} == {f: getattr(error, f, None) for f in FIELDS}


@pytest.mark.parametrize("error", [lambda call: SystemExit(5), lambda call: SystemExit("loader gave up: no more shards"),
                                   lambda call: FileNotFoundError(2, "No such file or directory", f"/data/missing_shard_{call:04d}.bin")],
                         ids=["SystemExit(5)", "sys.exit(message)", "FileNotFoundError"])
def test_a_producers_exit_or_oserror_ends_the_run_as_the_originals(start, error):
    # SystemExit(5) at the 5th call: the original exits 5; sys.exit(message): exit 1, the
    # message printed; a missing shard: the same last line, its filename in it.
    loader = _make_train_loader(lambda d: Shards(d, {5: error}), CPU, queue_depth=2)
    for want in original(4):
        assert same([tuple(t.clone() for t in loader.next_batch(8))], [want])
    with pytest.raises(BaseException) as raised:
        loader.next_batch(8)
    want = error(5)
    assert type(raised.value) is type(want) and traceback.format_exception_only(raised.value) == traceback.format_exception_only(want)
    assert getattr(raised.value, "code", None) == getattr(want, "code", None)
    assert getattr(raised.value, "filename", None) == getattr(want, "filename", None)


def test_the_thread_runtimes_worker_passes_a_systemexit_on_with_its_code():
    loader = prefetch_loader._make_train_loader(lambda d: Shards(d, {3: lambda call: SystemExit(5)}), CPU, queue_depth=2, name="thread_runtime")
    try:
        loader.next_batch(8)
        loader.next_batch(8)
        with pytest.raises(SystemExit) as raised:
            loader.next_batch(8)
        assert raised.value.code == 5
    finally:
        loader.shutdown()


# --------------------------------------------------------------------------- 4. tensors that share memory

def masked(loader, n_calls):
    """A loop that masks token 0 of its targets in place (`y[y % 5 == 0] = 0`): where x
    and y overlap (parameter-golf's `x, y = t[:-1], t[1:]`), x changes too. Each call's
    x and y after the mask."""
    seen = []
    for _ in range(n_calls):
        x, y = loader.next_batch(8)
        y[y % 5 == 0] = 0
        seen.append((x.clone(), y.clone()))
    return seen


def test_tensors_that_overlap_in_the_loaders_batch_overlap_when_handed_out(start):
    # Before: each tensor travelled into its own part of the slot, so the mask left x as
    # it was and every x differed from the original's.
    want = masked(Shards(CPU), 6)
    assert not torch.equal(want[0][0], torch.arange(8, 16)), "the mask shows in x in the original"
    got = masked(_make_train_loader(lambda d: Shards(d), CPU, queue_depth=2), 6)
    assert same(got, want)


def test_the_thread_runtimes_batches_overlap_as_the_originals():
    # The thread runtime (per-step arguments) copies each batch before its queue: the
    # copy keeps x and y overlapping, one span of the copy.
    want = masked(Shards(CPU), 6)
    loader = prefetch_loader._make_train_loader(lambda d: Shards(d), CPU, queue_depth=2, name="thread_runtime")
    try:
        assert same(masked(loader, 6), want)
    finally:
        loader.shutdown()


class Widening:
    """`next_batch(n) -> (w, v)`: one int32 storage of `2 n k + 1` values at call k, w its
    first `2 n k` as int64 `[n k]`, v all but its first as int32: they overlap, and the
    storage ends 4 bytes past w's last int64. Each batch is larger than the one before:
    from the third on it has no room in the slots and travels in its message."""

    def __init__(self, device):
        self.calls = 0

    def next_batch(self, n):
        self.calls += 1
        base = torch.arange(2 * n * self.calls + 1, dtype=torch.int32) * 1_000_003
        return base[:-1].view(torch.int64), base[1:]


def test_overlapping_tensors_of_two_dtypes_travel_in_a_message_and_overlap_as_the_originals(start):
    # The span is 4 bytes longer than a whole number of int64s: the message carries it
    # padded to whole 64 bytes, so that the int64 view of it can be made (unpadded: "must be
    # divisible by 8 to view Byte as Long" at the third batch).
    loader, want = _make_train_loader(lambda d: Widening(d), CPU, queue_depth=2), Widening(CPU)
    for _ in range(5):
        (w, v), (ww, vv) = loader.next_batch(3), want.next_batch(3)
        assert torch.equal(w, ww) and torch.equal(v, vv)
        v[0] = -1  # the high half of w[0], in both
        vv[0] = -1
        assert torch.equal(w, ww)


class Apart:
    """`next_batch(n) -> (x, y)`: two tensors of one large storage, far apart, not overlapping."""

    def __init__(self, device):
        self.calls, self.tokens = 0, torch.arange(1 << 20)

    def next_batch(self, n):
        self.calls += 1
        return self.tokens[self.calls : self.calls + n], self.tokens[-self.calls - n : -self.calls]


def test_tensors_of_one_storage_that_do_not_overlap_travel_apart(start):
    # Only overlapping bytes travel together: a slot holds the two tensors' bytes (64
    # each, in spans rounded to 64-byte boundaries at both ends), not the 8 MiB between them.
    loader = _make_train_loader(lambda d: Apart(d), CPU, queue_depth=2)
    want = Apart(CPU)
    for _ in range(5):
        assert same([loader.next_batch(8)], [want.next_batch(8)])
    assert max(slot.size for slot in loader.slots) <= 2 * (64 + 2 * 64)


# --------------------------------------------------------------------------- 7. a caught error, then a retry

def test_a_caught_loader_error_then_a_retry_gets_the_originals_next_batch(start):
    # More errors than slots (depth 2: four): an error's slot goes back at the next call.
    fail = {k: (lambda call: ShardError(call % 3, call)) for k in (3, 5, 6, 7, 8, 9, 12)}
    want = original(16, fail)
    loader = _make_train_loader(lambda d: Shards(d, fail), CPU, queue_depth=2)
    got = patched(loader, 1)  # the producer starts here (a fork needs the main thread alone)
    caller = threading.Thread(target=lambda: got.extend(patched(loader, 15)), daemon=True)
    caller.start()
    caller.join(WAIT_S)
    if caller.is_alive():  # waits for a slot that never comes back
        loader.shutdown()
        pytest.fail(f"hung after {len(got)} calls")
    assert same(got, want)
    assert sum(isinstance(w[0], type) for w in want) == 7


def test_the_thread_runtime_after_a_caught_error_gets_the_originals_next_batch():
    # The per-step-argument runtime's worker (templates/prefetch_loader.py) goes on after
    # an error, as the loader would. Before: it stopped at the first one, and every call
    # after it raised "prefetch: next_batch after shutdown", a shutdown nobody asked for.
    fail = {k: (lambda call: ShardError(call % 3, call)) for k in (3, 5, 6, 7, 8, 9, 12)}
    want = original(16, fail)
    loader = prefetch_loader._make_train_loader(lambda d: Shards(d, fail), CPU, queue_depth=2, name="thread_runtime")
    try:
        assert same(patched(loader, 16), want)
    finally:
        loader.shutdown()


def test_an_error_the_caller_does_not_retry_leaves_the_producer_bounded(start):
    # A loader that fails at every call from the 3rd on, and a caller that stops at the
    # first error: the producer goes on only while it has free slots (depth 2: four), as
    # for batches. Calls 1-4 fill them; the caller's 2nd and 3rd calls free two: six calls.
    read, write = os.pipe()

    class Counted(Shards):
        def next_batch(self, n):
            os.write(write, b"x")
            return super().next_batch(n)

    try:
        loader = _make_train_loader(lambda d: Counted(d, {k: (lambda call: ShardError(0, call)) for k in range(3, 100)}), CPU, queue_depth=2)
        assert isinstance(patched(loader, 3)[2][0], type)
        calls = 0
        while readable_within(read, WAIT_S if calls < 6 else 0.3):  # then nothing more for 0.3 s
            calls += len(os.read(read, 100))
        loader.shutdown()
    finally:
        os.close(read)
        os.close(write)
    assert calls == 6


# --------------------------------------------------------------------------- 8. two threads at once

def test_next_batch_from_two_threads_at_once_never_hangs_and_hands_each_batch_once(start):
    loader = _make_train_loader(lambda d: Shards(d), CPU, queue_depth=2)
    loader.next_batch(8)  # the producer starts here (a fork needs the main thread alone)
    got, errors = [[], []], []

    def take(into):
        try:
            for _ in range(40):
                into.append(loader.next_batch(8)[0][0].item() // 8)  # the call that built it
        except BaseException as error:  # pragma: no cover - the failure under test
            errors.append(error)

    threads = [threading.Thread(target=take, args=(into,), daemon=True) for into in got]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    hung = [thread for thread in threads if thread.is_alive()]
    if hung:
        loader.shutdown()  # ends the hung reads (end of file)
    assert not hung and not errors, errors
    assert sorted(got[0] + got[1]) == list(range(2, 82))  # every call's batch, each once
    assert got[0] == sorted(got[0]) and got[1] == sorted(got[1])


# --------------------------------------------------------------------------- 1. SIGCHLD ignored

@pytest.fixture
def sigchld_ignored():
    old = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGCHLD, old)


def test_with_sigchld_ignored_a_killed_producer_is_one_error_and_shutdown_is_quiet(sigchld_ignored):
    loader = _make_train_loader(lambda d: Shards(d), CPU, queue_depth=2)
    loader.next_batch(8)
    os.kill(loader.pid, signal.SIGKILL)  # the kernel reaps it: no zombie, no exit code
    with pytest.raises(RuntimeError, match=r"^prefetch: producer exit code None$"):
        for _ in range(6):  # the batches built already come first
            loader.next_batch(8)
    other = _make_train_loader(lambda d: Shards(d), CPU, queue_depth=2, name="other")
    other.next_batch(8)
    assert other.shutdown() is None  # the exit hook's reaping: the kernel reaped it already


SCRIPT = """
import os, signal, sys
sys.path.insert(0, {repo!r})
sys.path.insert(0, {here!r})
import torch
from patcher.templates import prefetch_lean
from patcher.templates.prefetch_lean import _make_train_loader, _spawn_generator
from gen_module import gen
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps this script's children
on = os.environ["PREFETCH"] == "1"
class Loader:
    def __init__(self, device, exit_at=None):
        self.calls, self.exit_at = 0, exit_at
    def next_batch(self, n):
        self.calls += 1
        if self.calls == self.exit_at:
            sys.exit("loader gave up: no more shards")
        return torch.arange(self.calls * n, self.calls * n + n)
forked = _make_train_loader(lambda d: Loader(d, exit_at=4), torch.device("cpu"), prefetch=on)
spawned = _spawn_generator(gen, {{"n": 50, "device": "cpu"}}, "device", prefetch=on)
ending = _spawn_generator(gen, {{"n": 4, "device": "cpu", "exit_at": 2}}, "device", prefetch=on)
print([forked.next_batch(4).tolist() for _ in range(3)], [next(spawned)[0].tolist() for _ in range(3)], flush=True)
try:
    print([next(ending)[0].tolist() for _ in range(3)])
except SystemExit as error:
    print("caught", repr(error.code))
if on:  # a producer killed mid-run (spawned; the forked one in the in-process test)
    killed = _spawn_generator(gen, {{"n": 50, "device": "cpu"}}, "device")
    next(killed)
    os.kill(list(prefetch_lean._spawned)[-1].pid, signal.SIGKILL)  # its producer, the last spawned
    try:
        [next(killed) for _ in range(6)]
    except RuntimeError as error:
        print(error, file=sys.stderr)
forked.next_batch(4)  # the 4th call: sys.exit(message) in the loader
"""

GEN = """
import sys
import torch

def gen(n, device="cpu", exit_at=None):
    for k in range(n):
        if k == exit_at:
            sys.exit(3)
        yield torch.arange(k, k + 4), {"k": k}
"""


def test_a_script_that_ignores_sigchld_and_exits_from_its_loader_ends_as_the_original(tmp_path):
    # Forked and spawned producers alive at exit in a script whose children the kernel
    # reaps: the exit hooks print nothing. The forked loader's sys.exit(message) ends
    # the run: exit 1 and the message, as the original; the spawned one's SystemExit(3)
    # arrives with its code.
    (tmp_path / "gen_module.py").write_text(GEN)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT.format(repo=str(REPO), here=str(tmp_path))))
    runs = {on: subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=dict(os.environ, PREFETCH=on, OMP_NUM_THREADS="1"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for on in ("0", "1")}
    ends = {on: (run.wait(120), *run.communicate()) for on, run in runs.items()}
    assert ends["0"] == (1, "[[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]] [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]\ncaught 3\n", "loader gave up: no more shards\n")
    assert ends["1"] == (1, ends["0"][1], "prefetch: the producer of this loader died (exit code None)\n" + ends["0"][2])
