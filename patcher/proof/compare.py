"""Compare what the original and the patched data source hand out, and what they leave running.

`first_difference` compares two batches field by field (dtype, shape, bytes);
`compare_phases` builds both sides phase by phase and compares their draws in order;
`harness_step` and `draw_deadline` keep a failure or a hang of the harness apart from
a difference. The thread checks find a replaced loader's threads and child processes
still alive after a rebuild. A comparison ends with None (no difference), a
`Difference`, or `CannotVerify`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import multiprocessing
import os
import random
import signal
import socket
import struct
import sys
import termios
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from patcher.proof import host_cuda
from patcher.proof.harness import HarnessError
from patcher.templates.staging import _each_leaf, _span_copies, _spans


class CannotVerify(Exception):
    """Verification cannot run (one line, says why)."""


@dataclass
class Difference:
    """The first mismatch: rank, phase ("warmup", "train", "val:<function>"), batch index (from 0), field index, what differs."""

    rank: int
    phase: str
    batch: int
    field: int | str | None  # the top-level field (index) or the path (`2['pq_idx']`) that differs; None: not one field (an exception, a thread left running)
    what: str
    configuration: str | None = None  # how the patched loader ran (the producer, the device)


@dataclass
class VerifyResult:
    """identical: every batch matched. batches_compared: per rank, both phases. notes: how
    it ran. prefetched: the patched script prefetches its training batches (else only
    what else was patched, such as the copy stream or validation, was put to the test)."""

    identical: bool
    world_size: int
    batches_compared: int
    difference: Difference | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    val_batches_compared: int = 0
    # False when the patched script holds no training prefetch (train_prefetch was
    # skipped): its training loader is the script's own, so "identical" proves no prefetch.
    prefetched: bool = True
    # True when the training generator is not run ahead but its own H2D copies are
    # staged (pinned_staging): "identical" proves the staged copies.
    staged: bool = False
    # True when the patched side holds no runtime of this tool: a hand-edited version of
    # the original, driven through its own loader and its own calls.
    edited: bool = False
    # Micro-steps the host ran ahead of the GPU on the CUDA path (`host_cuda.AsyncCopies`).
    run_ahead: int = 0
    # What the run crossed ("2 stage changes (synthesized)", "2 shard boundaries") and
    # what it could not exercise, with the reason: the verdict is "partial" where any is.
    exercised: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    # Threads or child processes of a replaced loader still alive after the script
    # rebuilt it, one line each (`describe_leak`): no difference in the batches, but
    # memory held (the old loader's shard) and a worker never stopped.
    leaks: list[str] = dataclasses.field(default_factory=list)
    # The tokenizer a data-loader module was driven with ("byte-level stand-in", "rustbpe
    # BPE, vocab 512, trained on the synthetic corpus"); None for a training script.
    tokenizer: str | None = None

    def as_dict(self) -> dict:
        d = {
            "identical": self.identical,
            "world_size": self.world_size,
            "batches_compared": self.batches_compared,
            "difference": None if self.difference is None else vars(self.difference),
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
            "val_batches_compared": self.val_batches_compared,
            "prefetched": self.prefetched,
            "staged": self.staged,
            "edited": self.edited,
            "run_ahead": self.run_ahead,
            "exercised": self.exercised,
            "skipped": self.skipped,
            "leaks": self.leaks,
            "tokenizer": self.tokenizer,
        }
        return d


def first_difference(a, b, sharing: bool = True) -> tuple[int | str, str] | None:
    """The first place where batch `b` differs from batch `a`, as (where, what differs),
    or None when they are the same.

    A batch is whatever the loader returns. Tuples, lists, dicts, namedtuples and
    dataclass instances are compared element by element, their types and keys
    included; a class is compared by what it is (its qualified name and bases, its
    fields), not by identity, since each script defines its own; tensors by dtype, shape and bytes; numpy arrays by dtype, shape and bytes;
    anything else (a Python scalar, a string, None) by type and `==`. where: the index
    of a top-level field of a tuple or list batch (an int, as for `(x, y)`), else a
    path such as `[2]['pq_idx']` or `x` (a namedtuple's or dataclass's field); 0 for
    a batch that is one value. Tensors whose bytes overlap in one storage (`x, y =
    t[:-1], t[1:]`: a write to `y` shows in `x`) must overlap the same way on both sides
    (`_overlaps`; not compared with `sharing` False: `b` drawn where copies keep them
    apart); the path is then that of the later tensor of the first pair that differs.
    """
    found = _difference(a, b, "") or (_overlap_difference(a, b) if sharing else None)
    if found is None:
        return None
    path, what = found
    if not path:
        return 0, what
    if path.startswith("[") and path.endswith("]") and path[1:-1].isdigit():
        return int(path[1:-1]), what
    return path.removeprefix("."), what


def _kind(t: type) -> tuple[str, ...]:
    """A class as what it is, not which object it is: the qualified names of its MRO.

    The original and the edited script are loaded apart, so a batch class they both
    define (`Pair = namedtuple("Pair", "x y")`, a dataclass) is two class objects."""
    return tuple(c.__qualname__ for c in t.__mro__)


def _by_attributes(a, same_class: bool) -> bool:
    """Whether to compare `a` by its attributes: a plain object (not a tensor or array)
    whose class has no `__eq__` of its own, or whose counterpart is another load's class."""
    if isinstance(a, (torch.Tensor, np.ndarray)) or callable(a) or not hasattr(a, "__dict__"):
        return False
    return not same_class or type(a).__eq__ is object.__eq__


def _difference(a, b, path: str) -> tuple[str, str] | None:
    """(path, what) of the first difference below `path`, or None."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        what = _leaf_difference(a, b)  # a tensor standing for device memory (`host_cuda`) is a tensor
        return None if what is None else (path, what)
    same_class = type(a) is type(b)
    if not same_class and _kind(type(a)) != _kind(type(b)):
        return path, f"{type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return path, f"keys {list(a)} vs {list(b)}"
        pairs = [(f"{path}[{k!r}]", a[k], b[k]) for k in a]
    elif isinstance(a, (tuple, list)):
        names = getattr(a, "_fields", None)
        if names != getattr(b, "_fields", None):
            return path, f"{type(a).__name__} fields {list(names or ())} vs {list(getattr(b, '_fields', None) or ())}"
        if len(a) != len(b):
            return path, f"{len(a)} fields vs {len(b)}"
        pairs = [(f"{path}.{names[i]}" if names else f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b))]
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        fields_a, fields_b = [f.name for f in dataclasses.fields(a)], [f.name for f in dataclasses.fields(b)]
        if fields_a != fields_b:
            return path, f"{type(a).__name__} fields {fields_a} vs {fields_b}"
        pairs = [(f"{path}.{name}", getattr(a, name), getattr(b, name)) for name in fields_a]
    elif _by_attributes(a, same_class) and hasattr(b, "__dict__"):
        # A plain object: its attributes, as a dataclass's fields.
        if list(vars(a)) != list(vars(b)):
            return path, f"{type(a).__name__} attributes {list(vars(a))} vs {list(vars(b))}"
        pairs = [(f"{path}.{name}", value, vars(b)[name]) for name, value in vars(a).items()]
    else:
        what = _leaf_difference(a, b)
        return None if what is None else (path, what)
    for where, x, y in pairs:
        found = _difference(x, y, where)
        if found is not None:
            return found
    return None


def _leaf_difference(x, y) -> str | None:
    """What differs between two leaves of the same type, or None."""
    if isinstance(x, torch.Tensor):
        if x.dtype != y.dtype:
            return f"dtype {x.dtype} vs {y.dtype}"
        if x.shape != y.shape:
            return f"shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if not (x.dtype.is_floating_point or x.dtype.is_complex) and x.device == y.device and torch.equal(x, y):
            return None  # integers: equal values are equal bytes
        xb, yb = _bytes(x), _bytes(y)
        if torch.equal(xb, yb):
            return None
        flat_x, flat_y = x.detach().cpu().reshape(-1), y.detach().cpu().reshape(-1)
        unequal = (xb.view(-1, x.element_size()) != yb.view(-1, y.element_size())).any(dim=1)
        at = int(unequal.nonzero()[0, 0]) if bool(unequal.any()) else 0
        index = tuple(int(v) for v in np.unravel_index(at, tuple(x.shape))) if x.dim() else ()
        return f"bytes differ: first at {list(index)}: {flat_x[at].item()!r} vs {flat_y[at].item()!r}"
    if isinstance(x, np.ndarray):
        if x.dtype != y.dtype:
            return f"dtype {x.dtype} vs {y.dtype}"
        if x.shape != y.shape:
            return f"shape {x.shape} vs {y.shape}"
        xb, yb = np.ascontiguousarray(x).reshape(-1).view(np.uint8), np.ascontiguousarray(y).reshape(-1).view(np.uint8)
        if xb.size == 0 or np.array_equal(xb, yb):
            return None
        at = int(np.flatnonzero((xb != yb).reshape(-1, x.itemsize).any(axis=1))[0])
        index = [int(v) for v in np.unravel_index(at, x.shape)] if x.ndim else []
        return f"bytes differ: first at {index}: {x.reshape(-1)[at].item()!r} vs {y.reshape(-1)[at].item()!r}"
    return None if x == y else f"{x!r} vs {y!r}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint8 (so -0.0 and 0.0, or two NaNs, compare as stored)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def copy_batch(batch):
    """A private copy of a batch of any structure (tensors cloned, numpy arrays copied,
    containers and dataclass instances rebuilt), walked as the runtime walks it
    (`templates/staging.py` `_each_leaf`). CPU tensors whose bytes overlap in one storage
    are copied as one span of it (the runtime's `_spans`) and overlap the same way in the
    copy, so that `first_difference` compares their sharing too."""
    with torch._C.DisableTorchFunctionSubclass():
        copies = _span_copies([span for span in _spans(_cpu_tensors(batch)) if len(span[3]) > 1])  # shared spans only: a tensor alone is cloned
    return _each_leaf(batch, lambda v: copies.get(id(v)) if id(v) in copies else v.detach().clone().as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else v.copy() if isinstance(v, np.ndarray) else v)


def _cpu_tensors(batch) -> list[torch.Tensor]:
    """The CPU tensors of a batch, in walk order, as plain tensors (not `host_cuda`'s device stand-ins)."""
    found: list[torch.Tensor] = []
    _each_leaf(batch, lambda v: found.append(v) if type(v) is torch.Tensor and v.device.type == "cpu" and v.layout == torch.strided else None)
    return found


def _overlaps(batch) -> list[tuple[int, int, int]]:
    """(i, j, bytes from tensor i's first byte to tensor j's) for each pair i < j of a
    batch's CPU tensors (`_cpu_tensors`, walk order) whose bytes overlap in one storage."""
    tensors = _cpu_tensors(batch)
    spans = {id(t): (span[0], span[1]) for span in _spans(tensors) for t in span[3]}
    firsts = [t.storage_offset() * t.element_size() for t in tensors]
    return [(i, j, firsts[j] - firsts[i]) for i in range(len(tensors)) for j in range(i + 1, len(tensors)) if spans[id(tensors[i])] == spans[id(tensors[j])]]


def _overlap_difference(a, b) -> tuple[str, str] | None:
    """(path, what) where the tensors of `a` and `b` share memory differently, or None."""
    want, got = _overlaps(a), _overlaps(b)
    if want == got:
        return None
    i, j, distance = min(set(want) ^ set(got))
    shared = (i, j, distance) in want
    positions = [k for k, v in enumerate(a) if isinstance(v, torch.Tensor)] if isinstance(a, (tuple, list)) else []
    path = f"[{positions[j]}]" if len(positions) > j and not dataclasses.is_dataclass(a) else ""
    where = f"tensor {j} starts {distance} bytes after tensor {i}, in one storage"
    return path, f"memory shared in the original ({where}), not in the patched batch" if shared else f"memory shared in the patched batch ({where}), not in the original"


class GlobalRng:
    """The global random state of each side of a comparison, kept apart: Python's
    `random`, numpy's global generator and torch's CPU generator. The original and the
    patched script each start from the same state (seeded with `seed`), as each would in
    a process of its own, and the draws of one never move the other's: a loader that
    draws from them (`random.shuffle`, where the patch leaves it on the training thread)
    hands out the same batches on both sides. The caller's state is restored at exit.

    Use: `with GlobalRng() as rng:`, then each side's work in `with rng.side(0 or 1):`."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def __enter__(self) -> "GlobalRng":
        self.saved = _rng_state()
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        self.sides = [_rng_state(), _rng_state()]
        return self

    @contextlib.contextmanager
    def side(self, index: int):
        _set_rng_state(self.sides[index])
        try:
            yield
        finally:
            self.sides[index] = _rng_state()

    def __exit__(self, *exc) -> None:
        _set_rng_state(self.saved)


def _rng_state() -> tuple:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_rng_state(state: tuple) -> None:
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


class InFlight:
    """Batches drawn whose H2D copies a GPU may not have run yet (`host_cuda`'s model of
    asynchronous copies, the host `run_ahead` micro-steps ahead): a batch is compared
    once its micro-step's copies have run, as the GPU used it (kept before a later
    micro-step's copy rewrites its device memory), and the rest when the phase ends (a
    synchronize). Outside the model (a CPU run) each batch is compared as it is drawn."""

    def __init__(self, use_delay: int = 0):
        # use_delay: draws between a batch's and the loop's use of it (1: the loop fetches
        # the next batch first, so the next micro-step's copies come before that use).
        self.use_delay = use_delay
        self.held: collections.deque = collections.deque()  # [micro-step, batch index, *batch]
        self.model = host_cuda.active_copies()
        self.run_ahead = self.model.run_ahead if self.model is not None else 0
        if self.model is not None:
            self.model.watchers.append(self._consumed)

    def _consumed(self, tick: int) -> None:
        """A copy of micro-step `tick` is about to write device memory: the batches drawn
        before it are what the GPU computed on; keep them as they are now (device memory
        a later micro-step reuses is written in stream order after their use)."""
        for i, (step, n, *batch) in enumerate(self.held):
            if step + self.use_delay < tick and not isinstance(batch[-1], _Landed):
                self.held[i] = (step, n, *batch[:-1], _Landed(_snapshot(batch[-1])))

    def drawn(self, n: int, *batch) -> list:
        """Batch `n` was drawn (one micro-step): the batches now due, as (index, *batch), in order."""
        if self.model is None:
            return [(n, *batch)]
        with self.model.lock:  # the loader's own threads may be copying (and calling `_consumed`)
            step = self.model.clock
            self.model.tick()
            self.held.append((step, n, *batch))
            due = []
            while self.held and self.held[0][0] + self.use_delay <= self.model.clock - 1 - self.run_ahead:
                due.append(_unwrapped(self.held.popleft()[1:]))
            return due

    def landed(self) -> list:
        """The phase ends: every copy runs; the batches still held, in order."""
        if self.model is None:
            return []
        with self.model.lock:
            self.model.drain()
            due, self.held = [_unwrapped(item[1:]) for item in self.held], collections.deque()
            if self._consumed in self.model.watchers:
                self.model.watchers.remove(self._consumed)
            return due


class _Landed:
    """A batch as the GPU used it, kept before a later copy rewrote its device memory."""

    def __init__(self, batch):
        self.batch = batch


def _snapshot(batch):
    """`copy_batch` of `batch` that reads no pending copy (they have run, or are not its own)."""
    with torch._C.DisableTorchFunctionSubclass():
        return copy_batch(batch)


def _unwrapped(item: tuple) -> tuple:
    last = item[-1]
    return (*item[:-1], last.batch) if isinstance(last, _Landed) else item


def compare_phases(rank: int, phases, build, draw, what: str, timeout_s: float) -> Difference | None:
    """Build both sides for each (phase, construction index, count) and compare `count`
    draws in order; the first difference, or None. build(side, index) -> source;
    draw(source, n) -> the n-th batch of the phase. Both sides are closed at the end.
    A draw that takes longer than `timeout_s` seconds raises CannotVerify (the patched
    side hangs) or DrawTimeout (the original does)."""
    sources = [None, None]
    with GlobalRng() as rng:
        return _compare_phases(rank, phases, build, draw, what, timeout_s, sources, rng)


def _compare_phases(rank, phases, build, draw, what, timeout_s, sources, rng: GlobalRng) -> Difference | None:
    try:
        for phase, index, count in phases:
            for side in (0, 1):
                close(sources[side])
                with rng.side(side):
                    sources[side] = harness_step(lambda: build(side, index), f"building the {'original' if side == 0 else 'patched'} {what} ({phase}) for rank {rank}")
            previous = None  # (n, reference, candidate) of the last item compared, checked again after the next is drawn
            in_flight = InFlight()
            for n in range(count):
                with draw_deadline(timeout_s), rng.side(0), host_cuda.reference_side():
                    reference = harness_step(lambda: draw(sources[0], n), f"the original {what}'s item {n} ({phase}) on rank {rank}")
                reference = copy_batch(reference)
                try:
                    with draw_deadline(timeout_s), rng.side(1):
                        candidate = draw(sources[1], n)
                except DrawTimeout as error:
                    raise CannotVerify(f"the patched {what} hangs here (rank {rank}, {phase} item {n}): {error}") from None
                except Exception as error:
                    return Difference(rank, phase, n, None, f"the patched {what} raised {type(error).__name__}: {one_line(error)}")
                # A buffer reused too early changes an item already handed out.
                late = previous and first_difference(*previous[1:])
                if late:
                    return Difference(rank, phase, previous[0], late[0], f"changed after the next item was drawn: {late[1]}")
                for m, expected, got in in_flight.drawn(n, reference, candidate):
                    diff = first_difference(expected, got)
                    if diff is not None:
                        return Difference(rank, phase, m, diff[0], diff[1])
                    previous = (m, expected, got)
            for m, expected, got in in_flight.landed():
                diff = first_difference(expected, got)
                if diff is not None:
                    return Difference(rank, phase, m, diff[0], diff[1])
    finally:
        for source in sources:
            close(source)
    return None


def first_rank_difference(compare, world_size: int) -> Difference | None:
    """`compare(rank)` for ranks 0, 1, ... until one differs; None when none does."""
    for rank in range(world_size):
        difference = compare(rank)
        if difference is not None:
            return difference
    return None


class DrawTimeout(Exception):
    """A draw from a loader or generator did not return within its deadline."""


@contextlib.contextmanager
def draw_deadline(seconds: float):
    """Raise `DrawTimeout` in the main thread if the body runs longer than `seconds`
    (SIGALRM interrupts a wait on a lock or event there). A no-op off the main thread
    or where SIGALRM does not exist."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame):
        raise DrawTimeout(f"no batch after {seconds:.0f} s (the data source waits on data that never comes)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def harness_step(step, what: str):
    """Run `step()`; an exception is the harness's problem, not a difference: CannotVerify
    "needs MODULE" for a missing module, else one line naming `what`."""
    try:
        return step()
    except (CannotVerify, DrawTimeout):
        raise
    except HarnessError as error:
        raise CannotVerify(str(error)) from None
    except ModuleNotFoundError as error:
        name = (error.name or str(error)).split(".")[0]
        raise CannotVerify(f"needs {error.name or error}: {what} imports it and it is not installed here; install it (pip install {name}, or the package that provides it) and verify again") from None
    except Exception as error:
        raise CannotVerify(f"{what} fails here: {type(error).__name__}: {one_line(error)}") from None


def one_line(error: BaseException) -> str:
    """`error`'s message on one line, at most 300 characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


def close(loader) -> None:
    """Shut `loader` down where its class has `shutdown()` (a patched loader's producer); else nothing."""
    shutdown = getattr(type(loader), "shutdown", None)
    if shutdown is not None:
        shutdown(loader)


def describe_leak(thread, started: dict) -> str:
    """One thread or child process a replaced loader left running, in words: what it
    is, what it holds (bytes of the tensors and numpy arrays reachable from its
    target's object and arguments, each storage counted once: `held_bytes`), and where
    it was started (`started`: thread -> "line N in FUNCTION", from `thread_starts`)."""
    if isinstance(thread, ChildProcess):
        return f"{thread.name} (not stopped; what it holds is in its own memory)"
    target = getattr(thread, "_target", None)
    owner = getattr(target, "__self__", None)
    held = held_bytes([owner, getattr(thread, "_args", ()), getattr(thread, "_kwargs", {})])
    code = getattr(target, "__code__", None) or getattr(getattr(target, "__func__", None), "__code__", None)
    runs = f"runs {getattr(target, '__qualname__', type(target).__name__)}" + (f" (line {code.co_firstlineno})" if code else "")
    where = f", started at {started[thread]}" if thread in started else ""
    return f"thread {thread.name}: {runs}{where}; holds {_size(held)} of tensors and arrays of the loader built before"


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit} ({count} bytes)"
    return f"{count} bytes"


def held_bytes(root, depth: int = 6) -> int:
    """Bytes of the distinct tensor storages and numpy buffers reachable from `root`
    through attributes, containers and queues, at most `depth` levels deep."""
    seen_objects, seen_buffers, total = set(), set(), 0
    stack = [(root, 0)]
    while stack:
        value, level = stack.pop()
        if id(value) in seen_objects or level > depth or value is None or isinstance(value, (str, bytes, int, float, bool, type)):
            continue
        seen_objects.add(id(value))
        if isinstance(value, torch.Tensor):
            with torch._C.DisableTorchFunctionSubclass():
                storage = value.untyped_storage()
                key = ("t", storage.data_ptr())
                if key not in seen_buffers:
                    seen_buffers.add(key)
                    total += storage.nbytes()
            continue
        if isinstance(value, np.ndarray):
            base = value
            while isinstance(base.base, np.ndarray):
                base = base.base
            key = ("a", base.__array_interface__["data"][0])
            if key not in seen_buffers:
                seen_buffers.add(key)
                total += base.nbytes
            continue
        if isinstance(value, dict):
            children = list(value.values())
        elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
            children = list(value)
        elif hasattr(value, "__dict__") and not callable(value):
            children = list(vars(value).values())
        else:
            children = []
        stack.extend((child, level + 1) for child in children)
    return total


@contextlib.contextmanager
def thread_starts():
    """Inside: every `threading.Thread.start` is recorded, the thread -> "line N in
    FUNCTION" of the first caller outside `threading` (the script's own call). Yields that dict."""
    started: dict = {}
    original = threading.Thread.start

    def start(self, *args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename == threading.__file__:
            frame = frame.f_back
        if frame is not None:
            started[self] = f"line {frame.f_lineno} in {frame.f_code.co_name}"
        return original(self, *args, **kwargs)

    threading.Thread.start = start
    try:
        yield started
    finally:
        threading.Thread.start = original


def thread_kind(thread: threading.Thread) -> str:
    """A thread's name without its numbers (`ThreadPoolExecutor-2_0` -> `ThreadPoolExecutor-_`)."""
    return "".join(c for c in thread.name if not c.isdigit())


def script_threads() -> set:
    """The threads (but the main one) and the child processes running here: a loader's
    worker threads and (templates/prefetch_lean.py) its forked producer, whether started
    by multiprocessing or by `os.fork`. Both kinds have `name`, `join(timeout)` and `is_alive()`."""
    threads = {t for t in threading.enumerate() if t is not threading.main_thread()}
    return threads | set(multiprocessing.active_children()) | {ChildProcess(pid) for pid in child_pids()}


def child_pids() -> set[int]:
    """The live (not zombie) child processes of this process, from /proc (empty without it)."""
    mine, found = os.getpid(), set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit():
            state = _proc_state(int(entry))
            if state is not None and state[1] == mine and state[0] not in "ZX":
                found.add(int(entry))
    return found


def _proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of process `pid`, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1])


@dataclass(frozen=True)
class ChildProcess:
    """A child process seen in /proc, with the `name`, `join` and `is_alive` of a thread."""

    pid: int

    @property
    def name(self) -> str:
        return f"child process {self.pid}"

    def is_alive(self) -> bool:
        state = _proc_state(self.pid)
        return state is not None and state[0] not in "ZX"

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)


def reset_producer(loader) -> set:
    """The producer a rebuilt loader kept from the loader built before (templates/prefetch_lean.py
    resets its forked child or its thread at a rebuild instead of starting another): as
    `script_threads` lists it, or empty for other runtimes and a producer started anew.
    Reads the instance's own attributes only: a loader whose attribute reads settle it
    (templates/prefetch_loader.py's `_SettlingLoader`) must not be read through `getattr`."""
    own = vars(loader) if hasattr(loader, "__dict__") else {}
    pid, thread = own.get("pid"), own.get("thread")
    if type(pid) is int and pid > 0:
        return {ChildProcess(pid)}
    return {thread} if pid is False and thread is not None else set()


def queued_batches(loader) -> int | None:
    """How many messages the producer of a process-producer loader
    (templates/prefetch_lean.py) has sent that the loader has not read yet: the
    batches built ahead and waiting (a reset's answer would count too). Read from the
    loader's end of its socket pair without consuming anything (`MSG_PEEK`), counting
    the complete frames of `multiprocessing.connection` (a 4-byte big-endian length, or
    -1 and an 8-byte one, then the pickle). None for other loaders, or before the
    producer started. Assumes the slots' descriptor (sent once, before the first
    batch's message) has been received already: call it after a first batch.
    """
    own = vars(loader) if hasattr(loader, "__dict__") else {}  # not getattr: a `_SettlingLoader` settles on attribute reads
    conn = own.get("conn")
    if conn is None or "lent" not in own:
        return None
    (available,) = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.FIONREAD, bytes(4)))  # bytes waiting
    if not available:
        return 0
    with socket.socket(fileno=os.dup(conn.fileno())) as peer:
        waiting = peer.recv(available, socket.MSG_PEEK)
    count, at = 0, 0
    while at + 4 <= len(waiting):
        (size,) = struct.unpack("!i", waiting[at : at + 4])
        at += 4
        if size == -1:
            if at + 8 > len(waiting):
                break
            (size,) = struct.unpack("!Q", waiting[at : at + 8])
            at += 8
        if at + size > len(waiting):
            break
        count, at = count + 1, at + size
    return count


def still_alive(threads: set, grace_s: float, excused: collections.Counter | None = None) -> list:
    """The threads and processes of `threads` still alive beyond `excused` (`unexcused`:
    the kinds of thread the original also leaves running, and how many) after waiting up
    to `grace_s` seconds in all for them. Those it excuses are not waited for: an idle
    pool worker that the original's warm-up loader leaves behind never ends, and waiting
    for it cost verify the whole grace at every rebuild."""
    deadline = time.monotonic() + grace_s
    while (beyond := unexcused([t for t in threads if t.is_alive()], excused or collections.Counter())) and time.monotonic() < deadline:
        beyond[0].join(min(0.05, max(0.0, deadline - time.monotonic())))  # (a slice: another may end first and excuse this one)
    return beyond


def unexcused(threads: list, excused: collections.Counter) -> list:
    """The threads of `threads` beyond those of a kind (`thread_kind`) the original also left running, up to its count."""
    left = collections.Counter(excused)
    beyond = []
    for thread in threads:
        kind = thread_kind(thread)
        if left[kind] > 0:
            left[kind] -= 1
        else:
            beyond.append(thread)
    return beyond
