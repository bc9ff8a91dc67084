"""CUDA on a CPU-only host: the script's CUDA path driven with host memory, or its CUDA calls kept on the host.

`cuda_on_host` makes `torch.cuda.is_available()` True and CUDA mean host memory, so
pinned staging buffers, copy streams and events run (as synchronous stand-ins) with
the same values; `cuda_as_host` and `host_only_pinning` let a script's hard-coded
`.cuda()` / `.to("cuda")` and `pin_memory` run on a machine without CUDA. With real
CUDA present, none of them changes anything.
"""

from __future__ import annotations

import contextlib

import torch


# torch factories whose `device=` / `pin_memory=` a loader or the injected runtime may pass
_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "empty_like", "zeros_like", "ones_like", "full_like", "empty_strided", "randint", "randperm", "from_numpy")


@contextlib.contextmanager
def cuda_on_host(notes: list[str] | None = None):
    """Inside: `torch.cuda.is_available()` is True and CUDA means host memory, so code
    that takes its CUDA path (pinned staging buffers, a copy stream, events,
    `record_stream`) runs on a CPU-only machine with the same values.

    An H2D copy (`.to("cuda")`, `.cuda()`) returns the host tensor itself, not a copy:
    a device tensor that still views its pinned staging buffer, the worst case of an
    asynchronous copy in flight, so that a staging buffer overwritten while its batch
    is in use changes that batch. `pin_memory()` returns a copy (as torch does); a
    `pin_memory=True` or `device="cuda"` argument of a factory means host memory.
    Streams and events are synchronous stand-ins. With real CUDA present nothing
    changes. Not thread-safe against other code patching torch at the same time.
    """
    if torch.cuda.is_available():
        yield False
        return
    saved_cuda = {name: getattr(torch.cuda, name, None) for name in ("is_available", "current_device", "device_count", "set_device", "synchronize", "Stream", "Event", "current_stream", "default_stream", "stream")}
    saved_tensor = {name: getattr(torch.Tensor, name) for name in ("cuda", "to", "pin_memory", "record_stream", "is_pinned")}
    saved_factories = {name: getattr(torch, name) for name in _FACTORIES if hasattr(torch, name)}
    original_to = saved_tensor["to"]

    def host_to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    def on_host(factory):
        def make(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    host_stream = _HostStream()
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream, torch.cuda.Event = _HostStream, _HostEvent
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: host_stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.to = host_to
    torch.Tensor.pin_memory = lambda self, *a, **k: self.clone()
    torch.Tensor.record_stream = lambda self, *a, **k: None
    torch.Tensor.is_pinned = lambda self, *a, **k: True
    for name, factory in saved_factories.items():
        setattr(torch, name, on_host(factory))
    try:
        yield True
    finally:
        for name, value in saved_cuda.items():
            if value is not None:
                setattr(torch.cuda, name, value)
        for name, value in saved_tensor.items():
            setattr(torch.Tensor, name, value)
        for name, factory in saved_factories.items():
            setattr(torch, name, factory)
        if notes is not None:
            note = "CUDA path driven on host memory: is_available() True, pinned staging and copy-stream calls run, an H2D copy keeps viewing its staging buffer (the worst case of a copy in flight)"
            if note not in notes:
                notes.append(note)


class _HostStream:
    """Stands in for `torch.cuda.Stream` on a machine without CUDA: work is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostEvent:
    """Stands in for `torch.cuda.Event`: always complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
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


def _is_cuda(value) -> bool:
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


def device_for(host_cuda: bool) -> torch.device:
    """The device a run hands batches to: CUDA (inside `cuda_on_host`, host memory) or the CPU."""
    return torch.device("cuda", 0) if host_cuda else torch.device("cpu")
