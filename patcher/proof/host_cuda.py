"""CUDA on a CPU-only host: the script's CUDA path driven with host memory, or its CUDA calls kept on the host.

`cuda_on_host` makes `torch.cuda.is_available()` True and CUDA mean host memory, so
pinned staging buffers, copy streams and events run with the same values, and an
asynchronous H2D copy from pinned memory reads its source as late as a GPU may
(`AsyncCopies`: the host running `run_ahead` micro-steps ahead of the device); `cuda_as_host` and `host_only_pinning` let a script's hard-coded
`.cuda()` / `.to("cuda")` and `pin_memory` run on a machine without CUDA. With real
CUDA present, none of them changes anything.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque

import torch
import torch.utils._pytree as pytree


# torch factories whose `device=` / `pin_memory=` a loader or the injected runtime may pass
_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "empty_like", "zeros_like", "ones_like", "full_like", "empty_strided", "randint", "randperm", "from_numpy")


# How many micro-steps the host runs ahead of the GPU by default. A GPU-bound step lets
# the host queue the next micro-step's copies and kernels before the GPU has run this
# one's; a compiled model's few launches let it queue a second before a `.item()`, the
# launch queue or the caching allocator stops it. Two is the least that shows a reused
# pinned buffer of two slots without a fence (the common hand-written double buffer);
# `--run-ahead` raises it for deeper rings.
RUN_AHEAD = 2

# Tensor functions that read no element: views and metadata. Any other use of a device
# tensor whose copy is still pending runs that copy first (the use is stream-ordered
# after it on a GPU).
_NO_READ = frozenset({
    "__get__", "view", "view_as", "narrow", "select", "squeeze", "unsqueeze",
    "t", "transpose", "permute", "expand", "expand_as", "split", "chunk", "unbind", "as_strided",
    "size", "dim", "numel", "stride", "storage_offset", "element_size", "is_contiguous", "data_ptr", "is_pinned",
    "record_stream", "__len__", "untyped_storage", "ndimension", "nelement",
})


class _Copy:
    """One H2D copy in flight: `dst` (host memory standing for the device) gets `src` when it runs."""

    __slots__ = ("seq", "tick", "src", "dst", "storage")

    def __init__(self, seq: int, tick: int, src: torch.Tensor, dst: torch.Tensor):
        self.seq, self.tick, self.src, self.dst, self.storage = seq, tick, src, dst, _storage(dst)


class AsyncCopies:
    """The host model of CUDA's asynchronous H2D copies (the state `cuda_on_host` keeps).

    A `non_blocking=True` copy from pinned memory (`.to("cuda")`, `.cuda()`, or
    `device_tensor.copy_(pinned)`) returns at once and reads its source when the GPU
    would run it, not at the call: `run_ahead` micro-steps later (the harness counts
    them with `tick()`), or earlier where the stream order or the host forces it: an
    in-place write of the destination, a value of it the host reads (a device op that
    reads it is queued behind the copy instead, `_Kernel`: the host does not wait for
    it on a GPU), `torch.cuda.synchronize()`, a stream's
    `synchronize()`, an event recorded after it that the host waits on
    (`synchronize()`, `query()`), a D2H read (`.item()`, `.cpu()`, `.tolist()`,
    `.numpy()`), or a blocking copy. A copy from pageable memory, or a blocking one,
    reads its source at the call (CUDA stages pageable memory before it returns). A
    pinned buffer rewritten before its copy ran therefore changes the batch, as on a GPU
    whose copy runs late ("a systematic loss offset with zero timing signature",
    modded-nanogpt #349). Pinned blocks from `pin_memory()` or `pin_memory=True` are
    never handed out again, as torch's caching host allocator hands a block out again
    only after the event behind its last copy has completed.

    Running a copy earlier than a GPU would can hide a race but never invent one: where
    the model is unsure (two streams, a use it cannot see through), it runs copies early.
    reference: copies run at the call, whatever `run_ahead` (the original script's data
    as meant). blocking: copies that ran at the call (pageable, or not `non_blocking`):
    on a GPU each waits for all the work queued before it on its stream, a drain of the
    host's run-ahead. waits: those of them that found copies of this model in flight.
    """

    def __init__(self, run_ahead: int = RUN_AHEAD):
        if run_ahead < 0:
            raise ValueError(f"run_ahead must be 0 or more micro-steps, not {run_ahead}")
        self.run_ahead = run_ahead
        self.clock = 0
        self.pending: deque[_Copy] = deque()
        self.issued = 0
        self.reference = False
        self.blocking = 0
        self.waits = 0
        self._last_into: dict[int, int] = {}  # device storage -> the last pending copy into it
        # Called with a copy's micro-step before it writes device memory: the micro-steps
        # before it have been consumed on the GPU (their forward was queued before it).
        self.watchers: list = []
        # A loader's own threads copy too (a hand-written prefetch): one copy, run or tick at a time.
        self.lock = threading.RLock()
        self._pinned: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Host memory registered as pinned (`cudaHostRegister`): [first byte, end byte) each.
        self.registered: list[tuple[int, int]] = []

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark `tensor` (and every view of it) pinned; returns it."""
        base = tensor._base if tensor._base is not None else tensor
        self._pinned[id(base)] = base
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Pinned by `pin` (a view of a pinned tensor too), or its first byte in memory registered (`register`)."""
        base = tensor._base if tensor._base is not None else tensor
        if self._pinned.get(id(base)) is base:
            return True
        with torch._C.DisableTorchFunctionSubclass():
            first = tensor.data_ptr()
        return any(lo <= first < hi for lo, hi in self.registered)

    def register(self, address: int, size: int) -> None:
        """`cudaHostRegister(address, size)`: `size` bytes of host memory from `address` are pinned."""
        self.registered.append((address, address + size))

    def copy(self, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> None:
        """`dst.copy_(src)` (dst: plain host memory standing for the device), queued; it
        runs now unless it is asynchronous from pinned memory on a non-reference side."""
        with self.lock:
            item = _Copy(self.issued, self.clock, src, dst)
            self.issued += 1
            if self.reference:
                _run(item)  # this copy alone: the other side's copies keep their own time
                return
            self.queue(item)
            if not (non_blocking and self.is_pinned(src)):
                # The host waits for the stream: the GPU catches up with it, this copy included.
                self.blocking += 1
                if len(self.pending) > 1:
                    self.waits += 1
                self.run_through(item.seq + 1)

    def queue(self, item) -> None:
        """Put a copy or a device op (`_Kernel`) on the stream, behind every item issued before it."""
        with self.lock:
            self.issued = max(self.issued, item.seq + 1)
            self.pending.append(item)
            for storage in _storages(item):
                self._last_into[storage] = item.seq

    def pending_into(self, tensor: torch.Tensor) -> int:
        """The sequence number of the last pending copy into `tensor`'s storage, or -1."""
        return self._last_into.get(_storage(tensor), -1)

    def run_through(self, seq: int) -> None:
        """Run every pending copy issued before copy number `seq`, in issue order."""
        with self.lock:
            while self.pending and self.pending[0].seq < seq:
                self._ran(self.pending.popleft())

    def tick(self) -> None:
        """The harness drew one micro-step's batch: the GPU reaches the copies issued
        `run_ahead` micro-steps ago (a run-ahead of 0 runs this micro-step's)."""
        with self.lock:
            while self.pending and self.pending[0].tick <= self.clock - self.run_ahead:
                self._ran(self.pending.popleft())
            self.clock += 1

    def drain(self) -> None:
        """`torch.cuda.synchronize()`: every pending copy runs."""
        self.run_through(self.issued)

    def _ran(self, item: _Copy) -> None:
        for watcher in self.watchers:
            watcher(item.tick)
        _run(item)
        for storage in _storages(item):
            if self._last_into.get(storage) == item.seq:
                del self._last_into[storage]


def _storage(tensor: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.untyped_storage().data_ptr()


def _storages(item) -> list[int]:
    return item.storage if isinstance(item.storage, list) else [item.storage]


def _run(item) -> None:
    if isinstance(item, _Kernel):
        item.run()
        return
    with torch._C.DisableTorchFunctionSubclass():
        _ORIGINAL_COPY(item.dst, item.src)


_ORIGINAL_COPY = torch.Tensor.copy_
_ACTIVE: list[AsyncCopies] = []  # the model of the `cuda_on_host` block we are in (innermost last)


def active_copies() -> AsyncCopies | None:
    """The model of the innermost `cuda_on_host` block, or None outside one (or with real CUDA)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def reference_side():
    """Inside: copies run at the call (the original's data as meant), whatever the run-ahead."""
    model = active_copies()
    if model is None:
        yield
        return
    saved, model.reference = model.reference, True
    try:
        yield
    finally:
        model.reference = saved


def tick() -> None:
    """One micro-step drawn (`AsyncCopies.tick` of the active model; nothing outside one)."""
    model = active_copies()
    if model is not None:
        model.tick()


def run_ahead() -> int:
    """Micro-steps the host runs ahead of the GPU in the active model (0 outside one)."""
    model = active_copies()
    return model.run_ahead if model is not None else 0


def drain() -> None:
    """Every pending copy of the active model runs (nothing outside one)."""
    model = active_copies()
    if model is not None:
        model.drain()


class _OnDevice(torch.Tensor):
    """Host memory standing for device memory inside `cuda_on_host`. A device op that
    reads a tensor with a copy still pending into it is stream-ordered after that copy
    on a GPU, and the host does not wait for it: the op runs now for its result's
    shape and dtype, and again, into that result, when the model runs the copy
    (`_Kernel`, queued behind it). An in-place op, or one whose result is no tensor
    (the host reads a value), runs the copies first, as does a D2H read (all of them)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        model = active_copies()
        name = getattr(func, "__name__", "")
        if model is None or not model.pending or name in _NO_READ:
            return super().__torch_function__(func, types, args, kwargs)
        if name in ("item", "tolist", "cpu", "numpy"):
            model.drain()
            return super().__torch_function__(func, types, args, kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        after = max((model.pending_into(a) for a in leaves if isinstance(a, _OnDevice)), default=-1)
        if after >= 0 and not _in_place(name, kwargs):
            with model.lock:
                try:
                    out = super().__torch_function__(func, types, args, kwargs)
                except Exception:  # on what the memory held before the copy: run it first, as below
                    out = None
                results = pytree.tree_leaves(out)
                if out is not None and results and all(isinstance(r, torch.Tensor) for r in results):
                    inputs = {_storage(a) for a in leaves if isinstance(a, torch.Tensor)}
                    fresh = [r for r in results if _storage(r) not in inputs]  # not a view of an input
                    if fresh:
                        model.queue(_Kernel(model.issued, model.clock, func, args, kwargs, out, fresh))
                    return out
        model.run_through(after + 1)
        return super().__torch_function__(func, types, args, kwargs)


def _in_place(name: str, kwargs: dict) -> bool:
    """Whether a tensor op of this name writes one of its inputs (`add_`, `__setitem__`, `__iadd__`, `out=`)."""
    return "out" in kwargs or name == "__setitem__" or (name.endswith("_") and not name.startswith("__")) or (name.startswith("__i") and name not in ("__index__", "__int__", "__invert__"))


class _Kernel:
    """A device op queued behind the copy it reads (`_OnDevice`): when it runs, `func`
    is computed again and its tensor results written into `outs` (those of `out` in
    storage of their own, not views of an input)."""

    __slots__ = ("seq", "tick", "func", "args", "kwargs", "out", "outs", "storage")

    def __init__(self, seq: int, tick: int, func, args, kwargs, out, outs: list):
        self.seq, self.tick, self.func, self.args, self.kwargs, self.out, self.outs = seq, tick, func, args, kwargs, out, outs
        self.storage = [_storage(t) for t in outs]

    def run(self) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            fresh = self.func(*self.args, **self.kwargs)
            old = [t for t in pytree.tree_leaves(self.out) if isinstance(t, torch.Tensor)]
            new = [t for t in pytree.tree_leaves(fresh) if isinstance(t, torch.Tensor)]
            for target, value in zip(old, new):
                if any(target is t for t in self.outs):
                    _ORIGINAL_COPY(target, value)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor) if isinstance(tensor, _OnDevice) else tensor


_DEFAULT_RUN_AHEAD: list[int] = [RUN_AHEAD]


@contextlib.contextmanager
def run_ahead_of(micro_steps: int):
    """Inside: `cuda_on_host` blocks that name no run-ahead use `micro_steps` (verify's `--run-ahead`).
    Raises ValueError for a negative count."""
    if micro_steps < 0:
        raise ValueError(f"run_ahead must be 0 or more micro-steps, not {micro_steps}")
    _DEFAULT_RUN_AHEAD.append(micro_steps)
    try:
        yield
    finally:
        _DEFAULT_RUN_AHEAD.pop()


@contextlib.contextmanager
def cuda_on_host(notes: list[str] | None = None, run_ahead: int | None = None, register_error: int = 0):
    """Inside: `torch.cuda.is_available()` is True and CUDA means host memory, so code
    that takes its CUDA path (pinned staging buffers, a copy stream, events,
    `record_stream`) runs on a CPU-only machine with the same values.

    An H2D copy (`.to("cuda")`, `.cuda()`, `device_tensor.copy_(host)`) gives a tensor
    standing for device memory (a block of its own), filled when the copy runs: at the
    call from pageable memory or when blocking, and as late as a GPU running
    `run_ahead` micro-steps behind the host may from pinned memory (`AsyncCopies`; the
    harness counts micro-steps with `tick()`; None: `RUN_AHEAD`, or `run_ahead_of`'s). `pin_memory()` returns a pinned copy (as
    torch does); a `pin_memory=True` or `device="cuda"` argument of a factory means
    pinned or device memory on the host; `torch.cuda.cudart().cudaHostRegister(address,
    size, flags)` pins that memory, or returns `register_error` where it is not 0 (a
    failed registration, as a container's locked-memory limit makes it). With real CUDA
    present nothing changes (yields False). Not thread-safe against other code patching torch at the same time.
    """
    if torch.cuda.is_available():
        yield False
        return
    run_ahead = _DEFAULT_RUN_AHEAD[-1] if run_ahead is None else run_ahead
    model = AsyncCopies(run_ahead)
    saved_cuda = {name: getattr(torch.cuda, name, None) for name in ("is_available", "current_device", "device_count", "set_device", "synchronize", "Stream", "Event", "current_stream", "default_stream", "stream", "cudart")}
    saved_tensor = {name: getattr(torch.Tensor, name) for name in ("cuda", "cpu", "to", "pin_memory", "record_stream", "is_pinned", "copy_")}
    saved_factories = {name: getattr(torch, name) for name in _FACTORIES if hasattr(torch, name)}
    original_to, original_cpu, empty_like = saved_tensor["to"], saved_tensor["cpu"], saved_factories["empty_like"]

    def h2d(self, non_blocking: bool, convert=None):
        if isinstance(self, _OnDevice):  # on the device already: torch returns it, or converts it there
            return self if convert is None else convert(self)
        dtype = self.dtype if convert is None else convert(saved_factories["empty"]((0,), dtype=self.dtype)).dtype
        dst = empty_like(self, dtype=dtype)
        model.copy(self, dst, non_blocking)
        return dst.as_subclass(_OnDevice)

    def host_to(self, *args, **kwargs):
        to_cuda = any(_is_cuda(a) for a in args) or _is_cuda(kwargs.get("device"))
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if not to_cuda:
            if isinstance(self, _OnDevice) and (any(_is_cpu(a) for a in args) or _is_cpu(kwargs.get("device"))):
                return host_cpu(self).to(*args, **kwargs)  # D2H
            return original_to(self, *args, **kwargs)
        non_blocking = bool(kwargs.pop("non_blocking", False) or any(a is True for a in args))
        args = tuple(a for a in args if not isinstance(a, bool))
        kwargs.pop("copy", None)
        converts = any(isinstance(a, torch.dtype) for a in args) or "dtype" in kwargs
        return h2d(self, non_blocking, (lambda t: original_to(t, *args, **kwargs)) if converts else None)

    def host_cuda(self, *args, **kwargs):
        return h2d(self, bool(kwargs.get("non_blocking", False) or any(a is True for a in args)))

    def host_cpu(self, *args, **kwargs):
        if not isinstance(self, _OnDevice):
            return original_cpu(self, *args, **kwargs)
        model.drain()  # a D2H copy waits for the stream
        return _plain(self).clone()

    def host_copy(self, src, non_blocking=False):
        if isinstance(self, _OnDevice) and isinstance(src, torch.Tensor) and not isinstance(src, _OnDevice):
            model.copy(src, _plain(self), non_blocking)  # H2D into device memory the script holds
            return self
        return _ORIGINAL_COPY(self, src, non_blocking)

    def pinned_copy(self, *args, **kwargs):
        return model.pin(_ORIGINAL_COPY(empty_like(_plain(self)), _plain(self)))

    def on_host(factory):
        def make(*args, **kwargs):
            pinned = bool(kwargs.pop("pin_memory", False))
            on_device = _is_cuda(kwargs.get("device"))
            if on_device:
                kwargs["device"] = "cpu"
            out = factory(*args, **kwargs)
            if pinned:
                model.pin(out)
            return out.as_subclass(_OnDevice) if on_device and not isinstance(out, _OnDevice) else out

        return make

    host_stream = _HostStream()
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: model.drain()
    torch.cuda.Stream, torch.cuda.Event = _HostStream, _HostEvent
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: host_stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    host_cudart = _HostCudart(model, register_error)
    torch.cuda.cudart = lambda: host_cudart
    torch.Tensor.cuda = host_cuda
    torch.Tensor.cpu = host_cpu
    torch.Tensor.to = host_to
    torch.Tensor.copy_ = host_copy
    torch.Tensor.pin_memory = pinned_copy
    torch.Tensor.record_stream = lambda self, *a, **k: None
    torch.Tensor.is_pinned = lambda self, *a, **k: model.is_pinned(_plain(self))
    for name, factory in saved_factories.items():
        setattr(torch, name, on_host(factory))
    _ACTIVE.append(model)
    try:
        yield True
    finally:
        _ACTIVE.remove(model)
        model.drain()  # what a script leaves in flight lands (a process exits after a synchronize)
        for name, value in saved_cuda.items():
            if value is not None:
                setattr(torch.cuda, name, value)
        for name, value in saved_tensor.items():
            setattr(torch.Tensor, name, value)
        for name, factory in saved_factories.items():
            setattr(torch, name, factory)
        if notes is not None:
            note = (f"CUDA path driven on host memory: is_available() True, pinned staging and copy-stream calls run, an asynchronous H2D copy "
                    f"from pinned memory reads its source as late as a GPU {run_ahead} micro-step(s) behind the host may (--run-ahead; events and synchronize calls respected)")
            if note not in notes:
                notes.append(note)


class _HostCudart:
    """Stands in for `torch.cuda.cudart()`: `cudaHostRegister` pins host memory in the
    model (`AsyncCopies.register`) and returns 0, or returns `error` and pins nothing
    where it is not 0, or 712 (cudaErrorHostMemoryAlreadyRegistered) for memory that
    overlaps memory registered before."""

    def __init__(self, model: AsyncCopies, error: int = 0):
        self.model, self.error = model, error

    @property
    def registered(self) -> int:
        """The calls that pinned memory."""
        return len(self.model.registered)

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        if self.error:
            return self.error
        if any(lo < address + size and address < hi for lo, hi in self.model.registered):
            return 712
        self.model.register(address, size)
        return 0


class _HostStream:
    """Stands in for `torch.cuda.Stream` on a machine without CUDA. Waits between
    streams order the device only; the host waits in `synchronize()` (every copy in
    flight runs: one stream's order is not kept apart from another's)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event if event is not None else _HostEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        drain()

    def query(self) -> bool:
        drain()
        return True


class _HostEvent:
    """Stands in for `torch.cuda.Event`: `record()` marks the copies issued so far;
    the host waiting on it (`synchronize()`, `query()`) runs them."""

    def __init__(self, *args, **kwargs):
        self.upto = 0

    def record(self, stream=None) -> None:
        model = active_copies()
        self.upto = model.issued if model is not None else 0

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        model = active_copies()
        if model is not None:
            model.run_through(self.upto)

    def query(self) -> bool:
        self.synchronize()  # a host that polls is a host that waits
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


@contextlib.contextmanager
def cuda_as_host(notes: list[str]):
    """Without CUDA, `.cuda()` and `.to("cuda", ...)` keep tensors on the host (values are the same).

    For data generators that hard-code their H2D copy; with CUDA present, nothing changes.
    """
    if torch.cuda.is_available():
        yield
        return
    original_cuda, original_to = torch.Tensor.cuda, torch.Tensor.to

    def host_cuda(self, *args, **kwargs):
        return self

    def host_to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    torch.Tensor.cuda, torch.Tensor.to = host_cuda, host_to
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.Tensor.to = original_cuda, original_to
        notes.append("no CUDA here: the generator's .cuda() / .to('cuda') copies kept on the host (values are the same)")


@contextlib.contextmanager
def host_only_pinning(notes: list[str]):
    """Without CUDA, pinning raises; make `pin_memory()` a plain copy (as it is for an
    unpinned tensor: never a view of its input) and drop `pin_memory=True` (values are the same)."""
    if torch.cuda.is_available():
        yield
        return
    originals = {name: getattr(torch, name) for name in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like")}
    original_pin = torch.Tensor.pin_memory

    def unpinned(factory):
        def make(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return make

    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self.clone()
    for name, factory in originals.items():
        setattr(torch, name, unpinned(factory))
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original_pin
        for name, factory in originals.items():
            setattr(torch, name, factory)
        notes.append("no CUDA here: pinned-memory requests treated as plain host memory (values are the same)")


def _is_cpu(value) -> bool:
    if isinstance(value, str):
        return value == "cpu"
    return isinstance(value, torch.device) and value.type == "cpu"


def _is_cuda(value) -> bool:
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


def device_for(host_cuda: bool) -> torch.device:
    """The device a run hands batches to: CUDA (inside `cuda_on_host`, host memory) or the CPU."""
    return torch.device("cuda", 0) if host_cuda else torch.device("cpu")
